"""The official Stripe SDK for Python against the payments example, unchanged but for its base
URL (API_BASE): what `tests/stripe.rs` checks byte by byte, seen through the SDK itself."""

import os
import uuid

import stripe

stripe.api_base = os.environ["API_BASE"]
stripe.api_key = "sk_test_alice"
stripe.max_network_retries = 2
order = uuid.uuid4().hex

# A charge and its retry under the same key: one charge, the retry replayed.
charge = stripe.Charge.create(amount=2000, currency="usd", source="tok_visa",
                              idempotency_key=f"order-{order}")
again = stripe.Charge.create(amount=2000, currency="usd", source="tok_visa",
                             idempotency_key=f"order-{order}")
assert again.id == charge.id, (again.id, charge.id)
assert again.last_response.headers.get("idempotent-replayed") == "true"
assert charge.status == "captured" and charge.amount == 2000

# The same key for another request: the SDK's own IdempotencyError.
try:
    stripe.Charge.create(amount=2100, currency="usd", source="tok_visa",
                         idempotency_key=f"order-{order}")
    raise AssertionError("a reused key was accepted")
except stripe.IdempotencyError as err:
    assert err.http_status == 400, err.http_status

# A declined card: the SDK's CardError, with the failed charge.
try:
    stripe.Charge.create(amount=500, currency="eur", source="tok_chargeDeclined",
                         idempotency_key=f"declined-{order}")
    raise AssertionError("a declined card was charged")
except stripe.CardError as err:
    assert err.code == "card_declined", err.code
    declined = err.json_body["error"]["charge"]

# Authorize, then capture under a key of its own.
held = stripe.Charge.create(amount=700, currency="eur", source="tok_visa", capture=False,
                            idempotency_key=f"held-{order}")
assert held.status == "authorized" and held.captured is False
captured = stripe.Charge.capture(held.id, idempotency_key=f"capture-{order}")
assert captured.status == "captured" and captured.captured is True

# Read back, and listed newest first.
assert stripe.Charge.retrieve(charge.id).amount == 2000
listed = [c.id for c in stripe.Charge.list().data]
assert listed == [held.id, declined, charge.id], listed

# A blank API key reaches the server, whose 401 the SDK raises as its AuthenticationError.
try:
    stripe.Charge.list(api_key=" ")
    raise AssertionError("a blank API key was let in")
except stripe.AuthenticationError as err:
    assert err.http_status == 401, err.http_status

print("stripe-python: every check passed")
