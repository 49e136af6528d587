"""A small orders API with Idempotency-Key support, standard library only.

`POST /orders` creates an order; a retry under the same key gets the first response back
(draft-ietf-httpapi-idempotency-key-header-07). `.ci/wheel` runs the runner installed from its
wheel against it, with `api.toml`.

- `Authorization: Bearer <tenant>` is required (401 without); keys are scoped by tenant.
- `Idempotency-Key` is required, as an sf-string: `"..."` with 1 to 255 visible ASCII
  characters inside the quotes (400 when missing or malformed).
- The key is claimed atomically before the work runs. A duplicate while it runs gets `409` with
  `Retry-After: 1`; the same key with another method, path or body gets `422`.
- A `2xx` is stored and replayed byte for byte with `Idempotent-Replayed: true`; both state
  `Idempotency-Key-Expires`, 24 hours after the key's first use. A `4xx` or `5xx` is not
  stored: the key is released, so that the corrected retry runs.
- The body is `{"item": "...", "amount": <positive integer>}`; `"fail": true` answers 503, as if
  a dependency were down.

    python3 api.py --port 0            # prints `listening on http://127.0.0.1:PORT` first
    python3 api.py --bug no-scope      # keys shared across tenants, for the runner to catch
"""

import argparse
import hashlib
import json
import re
import threading
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RETENTION_SECONDS = 24 * 60 * 60
WORK_SECONDS = 0.1
MAX_BODY_BYTES = 64 * 1024
# An sf-string (RFC 9651 §3.3.3) of visible ASCII: `\"` and `\\` are its only escapes.
KEY = re.compile(r'"((?:[!#-\[\]-~]|\\["\\])+)"')
BEARER = re.compile(r"Bearer ([A-Za-z0-9._~+/-]+=*)")


class Record:
    """One key's use: its request's fingerprint, and its response once the work is done."""

    def __init__(self, fingerprint, expires_at):
        self.fingerprint = fingerprint
        self.expires_at = expires_at
        self.expires = formatdate(expires_at, usegmt=True)
        self.response = None  # (status, content type, body bytes) once stored


class Store:
    """The records by (tenant, key), in memory under one lock: claims are atomic."""

    def __init__(self, scoped):
        self.scoped = scoped
        self.lock = threading.Lock()
        self.records = {}
        self.orders = 0
        self.next_sweep = 0.0

    def scope(self, tenant, key):
        return (tenant if self.scoped else "*", key)

    def claim(self, scope, fingerprint):
        """("run", record) for a new key, ("replay", record), ("in flight", None) or
        ("mismatch", None)."""
        now = time.time()
        with self.lock:
            if now >= self.next_sweep:  # expired records go, at most once a minute
                self.records = {s: r for s, r in self.records.items() if r.expires_at > now}
                self.next_sweep = now + 60
            record = self.records.get(scope)
            if record is not None and record.expires_at <= now:
                record = None
            if record is None:
                record = self.records[scope] = Record(fingerprint, now + RETENTION_SECONDS)
                return "run", record
            if record.fingerprint != fingerprint:
                return "mismatch", None
            if record.response is None:
                return "in flight", None
            return "replay", record

    def complete(self, scope, record, response):
        """Stores a 2xx; anything else releases the key for the retry."""
        with self.lock:
            if 200 <= response[0] < 300:
                record.response = response
            elif self.records.get(scope) is record:
                del self.records[scope]

    def next_id(self):
        with self.lock:
            self.orders += 1
            return f"ord_{self.orders}"


def create_order(store, body):
    """The work: (status, content type, body bytes). Slow enough for duplicates to overlap."""
    time.sleep(WORK_SECONDS)
    try:
        order = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return error(400, "the body is not JSON")
    if not isinstance(order, dict):
        return error(400, "the body is not a JSON object")
    amount = order.get("amount")
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        return error(400, "amount must be a positive integer")
    if order.get("fail") is True:
        return error(503, "the payment provider is unavailable; retry later")
    created = {"id": store.next_id(), "item": order.get("item"), "amount": amount}
    return 201, "application/json", json.dumps(created).encode()


def error(status, message):
    return status, "application/json", json.dumps({"error": message}).encode()


def parse_key(values):
    """The key of the `Idempotency-Key` header's values; None when missing or malformed."""
    match = KEY.fullmatch(values[0]) if len(values) == 1 else None
    key = re.sub(r'\\(["\\])', r"\1", match.group(1)) if match else ""
    return key if 1 <= len(key) <= 255 else None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store = None  # set by main

    def do_POST(self):
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body would be taken for the next request
            status = 411 if not length.isdigit() else 413
            return self.answer(*error(status, f"a Content-Length up to {MAX_BODY_BYTES} bytes"))
        body = self.rfile.read(int(length))
        if self.path != "/orders":
            return self.answer(*error(404, "not found"))
        tenant = BEARER.fullmatch(self.headers.get("Authorization", ""))
        if tenant is None:
            extra = {"WWW-Authenticate": "Bearer"}
            return self.answer(*error(401, "Authorization: Bearer <token> is required"), extra)
        key = parse_key(self.headers.get_all("Idempotency-Key") or [])
        if key is None:
            message = 'Idempotency-Key is required: "..." with 1 to 255 visible ASCII characters'
            return self.answer(*error(400, message))

        scope = self.store.scope(tenant.group(1), key)
        fingerprint = f"{self.command} {self.path} {hashlib.sha256(body).hexdigest()}"
        state, record = self.store.claim(scope, fingerprint)
        if state == "mismatch":
            message = "this key was used with another request; use a new key for this one"
            return self.answer(*error(422, message))
        if state == "in flight":
            message = "a request with this key is in progress; retry later"
            return self.answer(*error(409, message), {"Retry-After": "1"})
        expires = {"Idempotency-Key-Expires": record.expires}
        if state == "replay":
            return self.answer(*record.response, {**expires, "Idempotent-Replayed": "true"})
        try:
            response = create_order(self.store, body)
        except Exception as exc:  # answered and released like any 5xx: the retry runs again
            self.log_error("creating the order failed: %r", exc)
            response = error(500, "internal error")
        self.store.complete(scope, record, response)
        self.answer(*response, expires if 200 <= response[0] < 300 else {})

    def do_GET(self):
        if self.path == "/orders":
            return self.answer(*error(405, "only POST"), {"Allow": "POST"})
        self.answer(*error(404, "not found"))

    def do_HEAD(self):
        self.do_GET()

    def answer(self, status, content_type, body, headers=None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--bug", choices=["no-scope"], help="no-scope: keys shared by tenants")
    args = parser.parse_args()
    Handler.store = Store(scoped=args.bug != "no-scope")
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
