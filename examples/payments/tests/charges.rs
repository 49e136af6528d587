//! Charges, captures, refunds and cancellations made once through the API on both ledgers, the
//! provider's calls counted at its HTTP edge: replays, refusals, keys the layer forgot, each money
//! defect found before, two instances on one database, the metrics; then the provider on its own.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Value, json};

use example_payments::provider::{
    Outcome, Payment, PaymentRecord, Provider, ProviderClient, ProviderError, Source, WINDOW,
};
use example_payments::reconciler::Reconciler;
use support::api::{ALICE, BOB, Call, Reply, authorize, create_charge, visa};
use support::harness::{Harness, SHORT_WINDOW, ids, on_both_ledgers};
use support::instruments::Gate;
use support::wait_until;

// ---------------------------------------------------------------------------------------------
// The means the scenarios share.

/// `POST /v1/charges` as ALICE under `key`.
fn create(h: &Harness, key: &str, body: &Value) -> Call {
    create_charge(&h.router, ALICE, key, body)
}

/// `POST /v1/charges/{id}/{action}` (`capture`, `refunds`, `cancel`) as ALICE under `key`.
fn act(h: &Harness, id: &str, action: &str, key: &str) -> Call {
    h.post(&format!("/v1/charges/{id}/{action}"))
        .auth(ALICE)
        .key(key)
}

/// A refund of `amount` of ALICE's charge `id` under `key`, as a form.
fn refund(h: &Harness, id: &str, key: &str, amount: i64) -> Call {
    act(h, id, "refunds", key).form(&format!("amount={amount}"))
}

/// `reply`, once it is `status`.
#[track_caller]
fn expect(reply: Reply, status: u16) -> Reply {
    assert_eq!(reply.status, status, "{}", reply.text());
    reply
}

/// Asserts the refusal of a key that names another request: 400 `idempotency_error`, whether the
/// layer (a problem document) or the ledger and the provider (the key it forgot) refused it.
#[track_caller]
fn assert_reused(reply: &Reply) {
    let kind = reply.error()["type"].as_str();
    let refusal = (reply.status.as_u16(), kind, reply.error_code());
    let reused = (400, Some("idempotency_error"), "idempotency_key_reused");
    assert_eq!(refusal, reused, "{}", reply.text());
}

/// Asserts each field of `expected` (an object) in `value`.
#[track_caller]
fn assert_fields(value: &Value, expected: &Value) {
    for (field, want) in expected.as_object().expect("an object") {
        assert_eq!(&value[field], want, "{field}: {value}");
    }
}

/// Asserts `503` `provider_unavailable`: nothing was done.
#[track_caller]
fn assert_unavailable(reply: &Reply) {
    let unavailable = (StatusCode::SERVICE_UNAVAILABLE, "api_error");
    reply.assert_error(unavailable.0, unavailable.1, "provider_unavailable");
}

/// Asserts a 400 `invalid_request_error` with `code`.
#[track_caller]
fn assert_invalid(reply: &Reply, code: &str) {
    reply.assert_error(StatusCode::BAD_REQUEST, "invalid_request_error", code);
}

/// The `id` of a charge, as its JSON gives it.
fn id(charge: &Value) -> String {
    charge["id"].as_str().expect("an id").to_owned()
}

/// The ids of `api_key`'s charges, as listed.
async fn listed(h: &Harness, api_key: &str) -> Vec<String> {
    let list = expect(h.get("/v1/charges").auth(api_key).send().await, 200);
    assert_eq!(list.json["object"], "list");
    ids(&list.json).into_iter().map(str::to_owned).collect()
}

/// ALICE's charge `id`'s status.
async fn status(h: &Harness, id: &str) -> Value {
    h.charge_status(ALICE, id).await["status"].clone()
}

// ---------------------------------------------------------------------------------------------
// Scenarios: each runs on both ledgers.

/// A charge: 201 with the charge, its retry replayed byte for byte, and the same key with another
/// amount refused as Stripe refuses it (a 400 its SDKs raise as `IdempotencyError`, not to be
/// retried): one provider call, one charge.
async fn a_charge_is_made_once_and_replayed(h: &mut Harness) {
    let body = json!({
        "amount": 1999, "currency": "EUR", "source": "tok_visa", "description": "a red bicycle",
    });
    let first = expect(create(h, "order-1", &body).send().await, 201);
    assert!(!first.replayed());
    let charge = &first.json;
    assert!(id(charge).starts_with("ch_"), "{charge}");
    let expected = json!({
        "object": "charge", "amount": 1999, "currency": "eur", "description": "a red bicycle",
        "status": "captured", "captured": true, "amount_refunded": 0,
    });
    assert_fields(charge, &expected);
    let created = charge["created"].as_u64().unwrap_or(0);
    assert!(created > 1_600_000_000, "{charge}");

    let retry = expect(create(h, "order-1", &body).send().await, 201);
    assert!(retry.replayed());
    assert_eq!(retry.bytes, first.bytes, "the same body, byte for byte");
    let other = create(h, "order-1", &visa(2000)).send().await;
    assert_reused(&other);
    assert_eq!(other.content_type(), "application/problem+json");
    assert_eq!(other.header("stripe-should-retry"), Some("false"));

    assert_eq!(h.provider_counts(), (1, 1), "one provider call");
    assert_eq!(&h.charge_status(ALICE, &id(charge)).await, charge);
    assert_eq!(listed(h, ALICE).await, [id(charge)]);
}

/// A declined card: 402 with the failed charge, replayed to the retry; one provider call.
async fn a_decline_is_402_and_replayed(h: &mut Harness) {
    let body = json!({ "amount": 700, "currency": "usd", "source": "tok_chargeDeclined" });
    let first = create(h, "order-2", &body).send().await;
    first.assert_error(StatusCode::PAYMENT_REQUIRED, "card_error", "card_declined");
    assert!(!first.replayed());
    let retry = create(h, "order-2", &body).send().await;
    assert!(retry.replayed());
    assert_eq!(retry.bytes, first.bytes);
    assert_eq!(h.provider_counts(), (1, 1), "one provider call");

    let failed = first.error()["charge"].as_str().expect("the failed charge");
    let charge = h.charge_status(ALICE, failed).await;
    assert_fields(&charge, &json!({ "status": "failed", "captured": false }));
}

/// The provider unavailable: 503, nothing recorded or stored, and the retry runs again (a charge,
/// a capture rolled back); but a resumed call it was down for may still land: 504.
async fn provider_unavailable_is_503_and_a_retry_runs_again(h: &mut Harness) {
    let body = json!({ "amount": 700, "currency": "usd", "source": "tok_pspUnavailable" });
    for _ in 0..2 {
        let reply = create(h, "order-3", &body).send().await;
        assert_unavailable(&reply);
        assert!(!reply.replayed(), "a 503 is not stored");
    }
    assert_eq!(h.provider_counts(), (6, 0), "three calls each, none made");
    assert!(listed(h, ALICE).await.is_empty(), "nothing recorded");

    let id = h.authorized(ALICE, 1000).await;
    h.parts.probe.set_down(true);
    let down = act(h, &id, "capture", "capture-3").send().await;
    assert_unavailable(&down);
    assert_eq!(status(h, &id).await, "authorized", "rolled back");
    h.parts.probe.set_down(false);
    let retry = expect(act(h, &id, "capture", "capture-3").send().await, 200);
    assert!(!retry.replayed());
    assert_eq!(retry.json["status"], "captured");
    // The authorization, three calls in the outage, the capture.
    assert_eq!(h.provider_counts(), (11, 2));

    // A capture whose answer was lost, then resumed while the provider is down: its first call
    // may still land, so `504`, not "nothing was done", and the reconciler makes it once.
    let id = h.authorized(ALICE, 1100).await;
    h.send_losing_the_answer(act(h, &id, "capture", "capture-4"))
        .await;
    h.parts.probe.set_down(true);
    act(h, &id, "capture", "capture-4")
        .send()
        .await
        .assert_outcome_unknown();
    assert_eq!(status(h, &id).await, "capturing", "not rolled back");
    h.parts.probe.set_down(false);
    h.reconcile_now().await;
    assert_eq!(status(h, &id).await, "captured");
}

/// Two accounts with one key get a charge each; each lists its own, newest first; another
/// account's charge is not found, to read or to act on.
async fn accounts_are_kept_apart(h: &mut Harness) {
    let alice = id(&expect(create(h, "shared-key", &authorize(100)).send().await, 201).json);
    let bob = create_charge(&h.router, BOB, "shared-key", &visa(100));
    let bob = expect(bob.send().await, 201);
    assert!(!bob.replayed(), "Bob never sees Alice's record");
    assert_eq!(h.provider_counts(), (2, 2));
    let newer = id(&h.charge(ALICE, visa(300)).await);
    let newest_first = [newer, alice.clone()];
    assert_eq!(listed(h, ALICE).await, newest_first);
    assert_eq!(listed(h, BOB).await, [id(&bob.json)]);

    let mut missing = Vec::new();
    for (api_key, charge) in [(BOB, alice.as_str()), (ALICE, "ch_nope")] {
        let path = format!("/v1/charges/{charge}");
        missing.push(h.get(&path).auth(api_key).send().await);
    }
    for action in ["capture", "refunds", "cancel"] {
        let path = format!("/v1/charges/{alice}/{action}");
        missing.push(h.post(&path).auth(BOB).key(action).send().await);
    }
    for reply in missing {
        let not_found = (StatusCode::NOT_FOUND, "invalid_request_error");
        reply.assert_error(not_found.0, not_found.1, "resource_missing");
    }
    assert_eq!(status(h, &alice).await, "authorized");
    assert_eq!(h.provider_counts(), (3, 3), "no call for Bob's attempts");
}

/// A capture and a cancellation each need a key, are made once and replayed; another one under a
/// new key finds the charge moved on (`invalid_state`), as does a refund of a charge not
/// captured, and none calls the provider.
async fn captures_and_cancellations_run_once(h: &mut Harness) {
    let id = h.authorized(ALICE, 1500).await;
    let no_key = h.post(&format!("/v1/charges/{id}/capture")).auth(ALICE);
    assert_eq!(no_key.send().await.status, 400, "a capture needs a key");
    let not_captured = act(h, &id, "refunds", "refund-authorized").send().await;
    assert_invalid(&not_captured, "invalid_state");
    let captured = expect(act(h, &id, "capture", "capture-1").send().await, 200);
    let expected = json!({ "id": id, "status": "captured", "captured": true });
    assert_fields(&captured.json, &expected);
    let retry = act(h, &id, "capture", "capture-1").send().await;
    assert!(retry.replayed());
    assert_eq!(retry.bytes, captured.bytes);
    for (action, key) in [("capture", "capture-2"), ("cancel", "cancel-captured")] {
        let moved_on = act(h, &id, action, key).send().await;
        assert_invalid(&moved_on, "invalid_state");
    }
    assert_eq!(h.provider_counts(), (2, 2), "no call for a refused capture");

    let id = h.authorized(ALICE, 1000).await;
    let canceled = expect(act(h, &id, "cancel", "cancel-1").send().await, 200);
    let expected = json!({ "status": "canceled", "captured": false });
    assert_fields(&canceled.json, &expected);
    assert!(act(h, &id, "cancel", "cancel-1").send().await.replayed());
    let canceled = act(h, &id, "capture", "capture-canceled").send().await;
    assert_invalid(&canceled, "invalid_state");
    assert_eq!(status(h, &id).await, "canceled");
    assert_eq!(h.provider_counts(), (4, 4));
}

/// Refunds of a captured charge add up to at most its amount: a partial one, replayed; one of more
/// than is left refused (`amount_too_large`), and one of nothing; no amount refunds the rest; then
/// nothing is left. One provider call per refund made, and the provider refunded as the ledger.
async fn refunds_add_up_to_the_charge(h: &mut Harness) {
    let id = id(&h.charge(ALICE, visa(1000)).await);
    let partial = expect(refund(h, &id, "refund-1", 300).send().await, 201);
    let made = &partial.json;
    let expected = json!({ "object": "refund", "amount": 300, "charge": id });
    assert_fields(made, &expected);
    let refund_id = made["id"].as_str().unwrap_or_default();
    assert!(refund_id.starts_with("re_"), "{made}");
    let retry = refund(h, &id, "refund-1", 300).send().await;
    assert!(retry.replayed());
    assert_eq!(retry.bytes, partial.bytes);
    h.assert_refunded(&id, "captured", 300).await;

    let over = refund(h, &id, "refund-2", 701).send().await;
    assert_invalid(&over, "amount_too_large");
    let nothing = refund(h, &id, "refund-0", 0).send().await;
    assert_invalid(&nothing, "parameter_invalid");
    h.assert_refunded(&id, "captured", 300).await;
    let rest = expect(act(h, &id, "refunds", "refund-3").send().await, 201);
    assert_eq!(rest.json["amount"], 700, "no amount: the rest");
    h.assert_refunded(&id, "refunded", 1000).await;
    assert_invalid(&refund(h, &id, "refund-4", 1).send().await, "invalid_state");

    assert_eq!(h.provider_counts(), (3, 3), "the charge, two refunds");
    assert_eq!(h.provider_refunded().await, [1000]);
}

/// A key the layer forgot (its record lost) but the ledger and the provider still hold: the same
/// request is its charge again, with no provider call; another request under it (another amount,
/// other metadata, which is part of a request as Stripe compares every parameter, or another
/// operation) is refused, and the charge it was aimed at left as it was.
async fn a_key_the_layer_forgot_still_names_its_request(h: &mut Harness) {
    let with_order = |amount: i64, order: &str| {
        let mut body = visa(amount);
        body["metadata"] = json!({ "order_id": order });
        body
    };
    let body = with_order(900, "1");
    let first = id(&expect(create(h, "order-4", &body).send().await, 201).json);
    for other in [with_order(1200, "1"), with_order(900, "2")] {
        h.lose_idempotency_records().await;
        assert_reused(&create(h, "order-4", &other).send().await);
    }
    h.lose_idempotency_records().await;
    let same = expect(create(h, "order-4", &body).send().await, 201);
    assert!(!same.replayed(), "the layer had forgotten the key");
    assert_eq!(id(&same.json), first, "the same charge");
    assert_eq!(h.provider_counts(), (1, 1), "answered by the ledger");
    assert_eq!(listed(h, ALICE).await, [first]);

    // A capture's key, sent again for a refund (the ledger refuses it), then for a charge (the
    // provider does).
    let id = h.authorized(ALICE, 1000).await;
    expect(act(h, &id, "capture", "op-4").send().await, 200);
    h.lose_idempotency_records().await;
    assert_reused(&act(h, &id, "refunds", "op-4").send().await);
    h.assert_refunded(&id, "captured", 0).await;
    h.lose_idempotency_records().await;
    assert_reused(&create(h, "op-4", &visa(1000)).send().await);
    assert_eq!(listed(h, ALICE).await.len(), 2);
    assert_eq!(h.provider_counts(), (4, 3), "one call refused");
}

/// Once the layer's and the provider's windows ran out, a key is new again: a charge's key and a
/// refund's, each sent for a charge, make new charges; the first stays as it was.
async fn a_key_is_new_again_after_the_providers_window(h: &mut Harness) {
    h.provider_window(SHORT_WINDOW);
    let first = id(&expect(create(h, "again-1", &visa(900)).send().await, 201).json);
    expect(refund(h, &first, "again-2", 900).send().await, 201);

    h.pass_the_windows().await;
    for (key, amount) in [("again-1", 1200), ("again-2", 700)] {
        let reply = expect(create(h, key, &visa(amount)).send().await, 201);
        assert!(!reply.replayed());
        assert_ne!(id(&reply.json), first, "{key}");
        let expected = json!({ "amount": amount, "status": "captured", "amount_refunded": 0 });
        assert_fields(&reply.json, &expected);
    }
    h.assert_refunded(&first, "refunded", 900).await;
    assert_eq!(listed(h, ALICE).await.len(), 3);

    // A cancellation's key sent again, past both windows, to capture: refused, nothing captured.
    let held = h.authorized(ALICE, 400).await;
    expect(act(h, &held, "cancel", "again-3").send().await, 200);
    h.pass_the_windows().await;
    let events = h.parts.backlog().await;
    assert_reused(&act(h, &held, "capture", "again-3").send().await);
    assert_eq!(status(h, &held).await, "canceled");
    assert_eq!(
        h.parts.backlog().await,
        events,
        "no event for a capture never made"
    );
}

/// A refund whose answer was lost, which the reconciler then learned was made, another refund,
/// and then the first one's retry: answered with its refund, and counted once, in the ledger as at
/// the provider. The same key for another amount is another request.
async fn a_refund_retried_after_another_refund_is_counted_once(h: &mut Harness) {
    let id = id(&h.charge(ALICE, visa(1000)).await);
    h.send_losing_the_answer(refund(h, &id, "refund-a", 300))
        .await;
    h.reconcile_now().await;
    h.assert_refunded(&id, "captured", 300).await;
    let second = expect(refund(h, &id, "refund-b", 200).send().await, 201);

    let retried = expect(refund(h, &id, "refund-a", 300).send().await, 201);
    assert_eq!(retried.json["amount"], 300);
    assert_ne!(retried.json["id"], second.json["id"]);
    h.assert_refunded(&id, "captured", 500).await;
    h.lose_idempotency_records().await;
    assert_reused(&refund(h, &id, "refund-a", 250).send().await);
    h.assert_refunded(&id, "captured", 500).await;
    assert_eq!(h.provider_refunded().await, [500]);
    assert_eq!(h.parts.probe.effects(), 3, "one payment, two refunds");
}

/// A capture sent again after a refund moved its charge on (its answer lost to the client, the
/// layer's record gone): the charge as it is now, with no provider call, not `invalid_state` for
/// a capture that was made.
async fn a_capture_retried_after_a_refund_gets_the_charge(h: &mut Harness) {
    let id = h.authorized(ALICE, 1000).await;
    expect(act(h, &id, "capture", "capture-r").send().await, 200);
    expect(refund(h, &id, "refund-r", 300).send().await, 201);

    h.lose_idempotency_records().await;
    let calls = h.parts.probe.calls();
    let again = expect(act(h, &id, "capture", "capture-r").send().await, 200);
    let expected = json!({ "status": "captured", "amount_refunded": 300 });
    assert_fields(&again.json, &expected);
    assert_eq!(h.parts.probe.calls(), calls, "no provider call");
}

/// A refund that found the provider down, held up before its rollback while the reconciler
/// settled its charge and a second refund reached the provider: the first request's rollback
/// leaves the second's call alone, and the second settles the charge refunded, as the provider did.
async fn a_late_rollback_leaves_another_requests_call_alone(h: &mut Harness) {
    let id = id(&h.charge(ALICE, visa(1000)).await);
    // The first refund begins, the provider is down for its call, and its rollback waits.
    h.parts.probe.set_down(true);
    let rollback = Arc::new(Gate::default());
    let rollback_held = rollback.shut().await;
    h.parts.ledger.hold_update(1, rollback.clone());
    let first = tokio::spawn(refund(h, &id, "refund-1", 400).send());
    wait_until("the rollback at the ledger", || rollback.waiting() == 1).await;
    // The provider is back; the reconciler sends the refund again under its key: made.
    h.parts.probe.set_down(false);
    h.reconcile_now().await;
    h.assert_refunded(&id, "captured", 400).await;
    // The second refund, of the rest, reaches the provider and waits there.
    let provider_held = h.parts.probe.stall().await;
    let second = tokio::spawn(act(h, &id, "refunds", "refund-2").send());
    let stalled = || h.parts.probe.stalled() == 1;
    wait_until("the refund at the provider", stalled).await;

    drop(rollback_held);
    // Its call was made meanwhile, by the reconciler: not "nothing was done", but unknown to
    // this run; the retry with its key learns it.
    let first = first.await.expect("the first refund");
    first.assert_outcome_unknown();
    drop(provider_held);
    let second = expect(second.await.expect("the second refund"), 201);
    assert_eq!(second.json["amount"], 600);
    let retried = expect(refund(h, &id, "refund-1", 400).send().await, 201);
    assert_eq!(retried.json["amount"], 400);
    h.assert_refunded(&id, "refunded", 1000).await;
    assert_eq!(h.provider_refunded().await, [1000]);
}

/// A capture whose answer was lost (`504`, not stored), then the same client key sent to cancel
/// the charge: another request under the capture's key, refused without a provider call; it
/// neither resumes the capture nor rolls it back. The reconciler then learns the capture was made.
async fn a_key_sent_again_for_another_operation_is_refused(h: &mut Harness) {
    let id = h.authorized(ALICE, 800).await;
    h.send_losing_the_answer(act(h, &id, "capture", "op-7"))
        .await;
    let calls = h.parts.probe.calls();
    assert_reused(&act(h, &id, "cancel", "op-7").send().await);
    assert_eq!(h.parts.probe.calls(), calls, "no call for the cancel");
    assert_eq!(status(h, &id).await, "capturing");

    h.reconcile_now().await;
    assert_eq!(status(h, &id).await, "captured");
    assert_eq!(h.parts.probe.effects(), 2, "one payment, one capture");
}

/// A capture held up at the provider while the reconciler settles its charge, sending the capture
/// again under its key: the provider makes it once, and the held-up run, landing last, answers the
/// captured charge without moving it again (nor rolling it back).
async fn a_capture_held_up_at_the_provider_is_made_once_by_the_reconciler(h: &mut Harness) {
    let id = h.authorized(ALICE, 700).await;
    let held = h.parts.probe.stall().await;
    let capture = tokio::spawn(act(h, &id, "capture", "held-capture").send());
    let stalled = || h.parts.probe.stalled() == 1;
    wait_until("the capture at the provider", stalled).await;
    // The reconciler reaches the provider past the held-up call.
    let provider = ProviderClient::new(h.parts.provider.router());
    let reconciler = Reconciler::new(h.parts.ledger.clone(), provider, Duration::ZERO);
    let round = reconciler.round().await.expect("a reconciler round");
    assert_eq!(round.settled, 1, "{round:?}");
    assert_eq!(status(h, &id).await, "captured");

    drop(held);
    let capture = expect(capture.await.expect("the capture"), 200);
    assert_eq!(capture.json["status"], "captured");
    assert_eq!(h.charge_status(ALICE, &id).await, capture.json);
}

/// A refund lost on its way, which the reconciler takes over while the client's retry finds the
/// provider down: the retry leaves it to the reconciler (`504`, no rollback, no call of its own),
/// and the refund the reconciler makes ends in the ledger as at the provider.
async fn a_call_the_reconciler_took_over_is_not_rolled_back_by_a_retry(h: &mut Harness) {
    let id = id(&h.charge(ALICE, visa(1000)).await);
    h.parts.probe.set_dropping_calls(true);
    let lost = refund(h, &id, "refund-t", 400).send().await;
    lost.assert_outcome_unknown();
    h.parts.probe.set_dropping_calls(false);
    // The reconciler takes the call over; its call waits at the provider.
    let held = h.parts.probe.stall().await;
    let reconciler = h.parts.reconciler(Duration::ZERO);
    let round = tokio::spawn(async move { reconciler.round().await });
    let stalled = || h.parts.probe.stalled() == 1;
    wait_until("the reconciler's refund at the provider", stalled).await;

    h.parts.probe.set_down(true);
    let calls = h.parts.probe.calls();
    let lost = refund(h, &id, "refund-t", 400).send().await;
    lost.assert_outcome_unknown();
    assert_eq!(h.parts.probe.calls(), calls, "no call of the retry's own");
    h.parts.probe.set_down(false);
    drop(held);
    let round = round.await.expect("the round").expect("a reconciler round");
    assert_eq!(round.settled, 1, "{round:?}");
    h.assert_refunded(&id, "captured", 400).await;
    assert_eq!(h.provider_refunded().await, [400]);
}

/// A capture whose answer was lost, which the reconciler then settled (sending it again under its
/// key): the client's retry gets the captured charge.
async fn a_capture_the_reconciler_settled_is_answered_to_its_retry(h: &mut Harness) {
    let id = h.authorized(ALICE, 900).await;
    h.send_losing_the_answer(act(h, &id, "capture", "capture-l"))
        .await;
    h.reconcile_now().await;
    let retried = expect(act(h, &id, "capture", "capture-l").send().await, 200);
    assert_eq!(retried.json["status"], "captured");
    assert_eq!(h.parts.probe.effects(), 2, "one payment, one capture");
}

on_both_ledgers!(
    a_charge_is_made_once_and_replayed,
    a_decline_is_402_and_replayed,
    provider_unavailable_is_503_and_a_retry_runs_again,
    accounts_are_kept_apart,
    captures_and_cancellations_run_once,
    refunds_add_up_to_the_charge,
    a_key_the_layer_forgot_still_names_its_request,
    a_key_is_new_again_after_the_providers_window,
    a_refund_retried_after_another_refund_is_counted_once,
    a_capture_retried_after_a_refund_gets_the_charge,
    a_late_rollback_leaves_another_requests_call_alone,
    a_key_sent_again_for_another_operation_is_refused,
    a_capture_held_up_at_the_provider_is_made_once_by_the_reconciler,
    a_call_the_reconciler_took_over_is_not_rolled_back_by_a_retry,
    a_capture_the_reconciler_settled_is_answered_to_its_retry,
);

/// Two instances on one database, calling one provider, with their own layer and ledger handles:
/// a retry that reaches the other instance once the layer forgot the key finds the first charge
/// (or refuses another request), and a refund made on one is answered, not made again, on the
/// other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_database_share_one_truth() {
    let mut first = Harness::postgres().await;
    let second = first.second_instance();
    let charged = expect(create(&first, "shared", &visa(900)).send().await, 201);
    let charge = id(&charged.json);

    first.lose_idempotency_records().await;
    let retry = expect(create(&second, "shared", &visa(900)).send().await, 201);
    assert!(!retry.replayed());
    assert_eq!(id(&retry.json), charge, "the same charge");
    assert_reused(&create(&second, "shared", &visa(1200)).send().await);
    assert_eq!(second.provider_counts(), (0, 0), "nothing charged again");

    let made = expect(refund(&second, &charge, "refund-s", 300).send().await, 201);
    first.lose_idempotency_records().await;
    let again = expect(refund(&first, &charge, "refund-s", 300).send().await, 201);
    assert_eq!(again.json["id"], made.json["id"]);
    first.assert_refunded(&charge, "captured", 300).await;
    assert_eq!(first.provider_refunded().await, [300]);
    assert_eq!(first.provider_counts(), (1, 1), "the charge");
    assert_eq!(second.provider_counts(), (1, 1), "the refund");
}

/// `GET /metrics`: the layer's counters and store latencies in Prometheus' text format, with no
/// API key, and nothing of a request (its key, its account) in a label.
#[tokio::test]
async fn metrics_are_served_in_prometheus_text() {
    let (recorder, handle) = example_payments::prometheus::recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let mut h = Harness::memory();
    h.state.metrics = Some(handle);
    h.router = Harness::app(&h.state, &h.records);
    expect(create(&h, "order-metrics", &visa(500)).send().await, 201);
    let replay = create(&h, "order-metrics", &visa(500)).send().await;
    assert!(replay.replayed());
    assert_reused(&create(&h, "order-metrics", &visa(600)).send().await);

    let reply = expect(h.get("/metrics").send().await, 200);
    assert!(reply.content_type().starts_with("text/plain"), "{reply:?}");
    let text = reply.text();
    for line in [
        "idempotency_requests_total{outcome=\"executed\"} 1",
        "idempotency_requests_total{outcome=\"replayed\"} 1",
        "idempotency_requests_total{outcome=\"mismatch\"} 1",
        "idempotency_store_call_duration_seconds_count{operation=\"claim\",result=\"ok\"} 3",
        "idempotency_store_call_duration_seconds_count{operation=\"complete\",result=\"ok\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
    }
    let bucket = "idempotency_store_call_duration_seconds_bucket{operation=\"claim\",result=\"ok\",le=\"0.001\"}";
    assert!(text.contains(bucket), "{text}");
    for private in ["order-metrics", "acct_"] {
        assert!(!text.contains(private), "{private}: {text}");
    }
}

// ---------------------------------------------------------------------------------------------
// The provider on its own.

/// A payment of `amount` from the card that pays, authorized only, under `key`.
async fn pay(provider: &Provider, key: &str, amount: i64) -> Result<Payment, ProviderError> {
    let call = (Source::Visa, amount, false);
    provider.create_payment(key, call, BTreeMap::new()).await
}

/// What the provider refunded of each of its payments, oldest first.
async fn refunded(provider: &Provider) -> Vec<i64> {
    let payments = provider.payments_since(0, 100).await;
    payments.iter().map(|p| p.refunded).collect()
}

/// The provider binds a key to its request (the operation and each parameter) for its window: the
/// same request again gets the first answer and moves no money, another one is refused; a
/// declined payment's key answers its decline again. A call it is down for does nothing and binds
/// no key. Once the window ran out, the key is new.
#[tokio::test(start_paused = true)]
async fn the_providers_key_is_bound_to_its_request_for_its_window() {
    use ProviderError::KeyReused;
    use Source::{ChargeDeclined, ProviderUnavailable, Visa};
    let window = Duration::from_secs(60);
    let provider = Provider::new(Duration::ZERO, window);
    let create = |key: &'static str, source, amount, capture| {
        provider.create_payment(key, (source, amount, capture), BTreeMap::new())
    };
    for _ in 0..2 {
        let down = create("k", ProviderUnavailable, 100, true).await;
        assert_eq!(down, Err(ProviderError::Unavailable), "nothing done");
    }
    let paid = create("k", Visa, 100, true).await.expect("the key is free");
    assert_eq!(paid.outcome, Outcome::Captured);
    assert_eq!(create("k", Visa, 100, true).await, Ok(paid.clone()));
    for other in [
        create("k", Visa, 101, true),
        create("k", Visa, 100, false),
        create("k", ChargeDeclined, 100, true),
    ] {
        assert_eq!(other.await, Err(KeyReused));
    }
    assert_eq!(provider.capture("k", &paid.id).await, Err(KeyReused));
    assert_eq!(provider.cancel("k", &paid.id).await, Err(KeyReused));
    assert_eq!(provider.refund("k", &paid.id, 100).await, Err(KeyReused));
    let refund = provider.refund("r", &paid.id, 40).await.expect("a refund");
    assert_eq!(provider.refund("r", &paid.id, 40).await, Ok(refund.clone()));
    assert_eq!(provider.refund("r", &paid.id, 60).await, Err(KeyReused));
    assert_eq!(provider.refund("r", "py_other", 40).await, Err(KeyReused));
    let declined = create("d", ChargeDeclined, 100, true).await;
    assert!(matches!(&declined, Ok(p) if p.outcome == Outcome::Declined));
    assert_eq!(create("d", ChargeDeclined, 100, true).await, declined);
    let mut refunds = refunded(&provider).await;
    refunds.sort_unstable();
    assert_eq!(refunds, [0, 40], "two payments, one refund");

    tokio::time::advance(window - Duration::from_millis(1)).await;
    assert_eq!(create("r", Visa, 100, true).await, Err(KeyReused));
    tokio::time::advance(Duration::from_millis(1)).await;
    let again = create("r", Visa, 100, true).await.expect("a new payment");
    assert_ne!(again.id, refund);
    assert_eq!(create("r", Visa, 100, true).await, Ok(again));
    let renewed = create("k", Visa, 100, true).await;
    assert_ne!(renewed.expect("a new payment"), paid);
    let payments = provider.payments_since(0, 100).await;
    assert_eq!(payments.len(), 4, "none while down");
}

/// The provider refunds at most what is left of a payment, whatever key a refund comes under
/// (refused, nothing done); a refund it made is answered again under its key even once nothing is
/// left; a refund of a payment it never made, or has not captured, is refused.
#[tokio::test]
async fn the_provider_refunds_at_most_what_is_left() {
    let provider = Provider::new(Duration::ZERO, WINDOW);
    let paid = pay(&provider, "pay", 1000).await.expect("a payment");
    let held = provider.refund("r0", &paid.id, 1).await.map(drop);
    provider.capture("c", &paid.id).await.expect("a capture");
    let mut answers = Vec::new();
    for (key, amount) in [("r1", 700), ("r2", 700), ("r3", 300), ("r4", 1)] {
        answers.push(provider.refund(key, &paid.id, amount).await.map(drop));
    }
    let too_large = |amount, refundable| Err(ProviderError::AmountTooLarge { amount, refundable });
    let expected = [Ok(()), too_large(700, 300), Ok(()), too_large(1, 0)];
    assert_eq!(answers, expected);
    assert_eq!(held, too_large(1, 0), "nothing taken before the capture");
    let resent = provider.refund("r1", &paid.id, 700).await;
    assert!(resent.is_ok(), "a resend gets its first answer");
    let none = provider.refund("r5", "py_none", 1).await;
    assert_eq!(none, Err(ProviderError::NoSuchPayment));
    assert_eq!(refunded(&provider).await, [1000]);
}

/// The provider finds payments by the value of a metadata field, and lists them by creation time,
/// from a time on and up to a limit, oldest first: how the reconciler finds a create whose outcome
/// it does not know, and a payment no charge names. A released payment is listed as canceled.
#[tokio::test]
async fn the_provider_finds_payments_by_metadata_and_lists_them_by_creation() {
    let provider = Provider::new(Duration::ZERO, WINDOW);
    let mut made = Vec::new();
    for (key, operation) in [("p1", "op-a"), ("p2", "op-b"), ("p3", "op-a")] {
        let metadata = BTreeMap::from([("operation".to_owned(), operation.to_owned())]);
        let call = (Source::Visa, 100, false);
        let payment = provider.create_payment(key, call, metadata).await;
        made.push(payment.expect("a payment").id);
        // `created` is in milliseconds of the system clock: one apart, the order is known.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let ids =
        |found: Vec<PaymentRecord>| -> Vec<String> { found.into_iter().map(|p| p.id).collect() };
    let found = provider.search("operation", "op-a").await;
    assert_eq!(found[0].metadata["operation"], "op-a", "kept as given");
    assert_eq!(ids(found), [made[0].clone(), made[2].clone()]);
    assert!(provider.search("operation", "op-c").await.is_empty());
    assert!(provider.search("account", "op-a").await.is_empty());

    provider.cancel("c", &made[1]).await.expect("released");
    let all = provider.payments_since(0, 100).await;
    let second = all[1].created;
    assert_eq!(all[1].outcome, Outcome::Canceled);
    assert_eq!(ids(all), made);
    assert_eq!(ids(provider.payments_since(0, 2).await), made[..2]);
    assert_eq!(ids(provider.payments_since(second, 100).await), made[1..]);
}
