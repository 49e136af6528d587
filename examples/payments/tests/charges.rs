//! Exactly-once charges, captures, refunds and cancellations through the API, driven in-process
//! with `oneshot`: every scenario runs on the in-memory store and on Redis (a private
//! `redis-server` per test), with the provider's calls and effects counted; then the provider's
//! keys, fences and refund bound on every key table, the state machine, the form parser, and the
//! client binary through a link that loses answers.

mod support;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Value, json};
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tower_idempotency_redis::RedisStore;

use example_payments::pg;
use example_payments::provider::{
    KeyTable, MemoryKeys, Outcome, PgKeys, Provider, ProviderClient, ProviderError, RedisKeys,
    Request, Source, WINDOW,
};
use support::api::{ALICE, BOB, Call, authorize, visa};
use support::cut_proxy::{Cut, CutProxy};
use support::harness::{Harness, SHORT_WINDOW, ids, on_both_stores};
use support::instruments::{Gate, Hang, Outage, ProbedKeys};
use support::process::{
    API_KEY, Server, assert_charges, charge_id, key_of, line_starting, request,
    run_example_to_exit, wait_for_balance,
};
use support::wait_until;

// ---------------------------------------------------------------------------------------------
// Scenarios: each runs on both stores.

async fn create_is_201_with_the_charge(h: &mut Harness) {
    let reply = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("order-1")
        .json(json!({
            "amount": 1999,
            "currency": "EUR",
            "source": "tok_visa",
            "description": "a red bicycle",
        }))
        .send()
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    assert!(!reply.replayed());
    let charge = &reply.json;
    let id = charge["id"].as_str().expect("an id");
    assert!(id.starts_with("ch_"), "{id}");
    assert_eq!(charge["object"], "charge");
    assert_eq!(charge["amount"], 1999);
    assert_eq!(charge["currency"], "eur");
    assert_eq!(charge["description"], "a red bicycle");
    assert_eq!(charge["status"], "captured");
    assert_eq!(charge["captured"], true);
    assert_eq!(charge["amount_refunded"], 0);
    assert!(
        charge["created"]
            .as_u64()
            .is_some_and(|t| t > 1_600_000_000)
    );
    assert_eq!(h.provider_counts(), (1, 1));

    assert_eq!(&h.charge_status(ALICE, id).await, charge);
}

async fn a_retry_replays_the_charge(h: &mut Harness) {
    let create = || {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("order-2")
            .json(visa(500))
    };
    let first = create().send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let retry = create().send().await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(retry.bytes, first.bytes, "the same body, byte for byte");
    assert_eq!(h.provider_counts(), (1, 1), "the provider was called once");
    let list = h.get("/v1/charges").auth(ALICE).send().await;
    assert_eq!(ids(&list.json), [first.json["id"].as_str().unwrap()]);
}

/// The layer's refusal of a reused key, as Stripe answers it: 400 `idempotency_error` (which a
/// Stripe SDK raises as its `IdempotencyError`), in a problem+json document that carries the
/// `error` member, and `Stripe-Should-Retry: false`.
async fn the_same_key_with_another_amount_is_400_idempotency_error(h: &mut Harness) {
    h.post("/v1/charges")
        .auth(ALICE)
        .key("order-3")
        .json(visa(500))
        .send()
        .await;
    let reply = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("order-3")
        .json(visa(600))
        .send()
        .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text());
    assert_eq!(reply.content_type(), "application/problem+json");
    assert_eq!(reply.json["error"]["type"], "idempotency_error");
    assert_eq!(reply.error_code(), "idempotency_key_reused");
    assert_eq!(reply.json["error"]["message"], reply.json["detail"]);
    assert!(
        reply.json["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("#mismatch")),
        "{}",
        reply.text()
    );
    assert_eq!(reply.json["status"], 400);
    assert_eq!(reply.header("stripe-should-retry"), Some("false"));
    assert_eq!(h.provider_counts(), (1, 1));
}

/// Form bodies, as Stripe's SDKs send them: a charge with Stripe's nested metadata, replayed for
/// the same bytes. The layer fingerprints the raw bytes, so the same charge written another way
/// (its parameters in another order, or as JSON) under the same key is another request: 400.
async fn form_bodies_charge_and_replay_by_their_bytes(h: &mut Harness) {
    let body = "amount=2000&currency=usd&source=tok_visa&description=a+red+bicycle\
                &metadata[order_id]=6735&metadata%5Bgift%5D=yes";
    let create = |body: &str| h.post("/v1/charges").auth(ALICE).key("form-1").form(body);
    let first = create(body).send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    assert_eq!(first.json["object"], "charge");
    assert_eq!(first.json["amount"], 2000);
    assert_eq!(first.json["currency"], "usd");
    assert_eq!(first.json["description"], "a red bicycle");
    assert_eq!(
        first.json["metadata"],
        json!({ "order_id": "6735", "gift": "yes" })
    );
    let retry = create(body).send().await;
    assert!(retry.replayed());
    assert_eq!(retry.bytes, first.bytes);

    let reordered = "currency=usd&amount=2000&source=tok_visa&description=a+red+bicycle\
                     &metadata[order_id]=6735&metadata%5Bgift%5D=yes";
    let as_json = json!({
        "amount": 2000, "currency": "usd", "source": "tok_visa", "description": "a red bicycle",
        "metadata": { "order_id": "6735", "gift": "yes" },
    });
    for other in [
        create(reordered).send().await,
        h.post("/v1/charges")
            .auth(ALICE)
            .key("form-1")
            .json(as_json.clone())
            .send()
            .await,
    ] {
        assert_eq!(other.status, StatusCode::BAD_REQUEST, "{}", other.text());
        assert_eq!(other.json["error"]["type"], "idempotency_error");
    }
    assert_eq!(h.provider_counts(), (1, 1), "charged once");

    // JSON, with a key of its own, makes the same charge.
    let json_charge = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("json-1")
        .json(as_json)
        .send()
        .await;
    assert_eq!(json_charge.status, StatusCode::CREATED);
    assert_eq!(json_charge.json["metadata"], first.json["metadata"]);

    // `capture=false` authorizes; a form refund takes part of a captured charge.
    let authorized = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("form-2")
        .form("amount=500&currency=eur&source=tok_visa&capture=false")
        .send()
        .await;
    assert_eq!(
        authorized.json["status"],
        "authorized",
        "{}",
        authorized.text()
    );
    let id = first.json["id"].as_str().expect("an id");
    let refund = h
        .post(&format!("/v1/charges/{id}/refunds"))
        .auth(ALICE)
        .key("form-refund")
        .form("amount=500")
        .send()
        .await;
    assert_eq!(refund.status, StatusCode::CREATED, "{}", refund.text());
    assert_eq!(refund.json["amount"], 500);
}

async fn a_decline_is_402_and_replayed(h: &mut Harness) {
    let body = json!({ "amount": 700, "currency": "usd", "source": "tok_chargeDeclined" });
    let decline = || {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("order-4")
            .json(body.clone())
    };
    let first = decline().send().await;
    first.assert_error(StatusCode::PAYMENT_REQUIRED, "card_error", "card_declined");
    assert!(!first.replayed());
    let retry = decline().send().await;
    assert_eq!(retry.status, StatusCode::PAYMENT_REQUIRED);
    assert!(retry.replayed());
    assert_eq!(retry.bytes, first.bytes);
    assert_eq!(h.provider_counts(), (1, 1), "the provider was called once");

    let id = first.json["error"]["charge"]
        .as_str()
        .expect("the failed charge");
    let charge = h.charge_status(ALICE, id).await;
    assert_eq!(charge["status"], "failed");
    assert_eq!(charge["captured"], false);
}

async fn provider_unavailable_is_503_and_a_retry_runs_again(h: &mut Harness) {
    let body = json!({ "amount": 700, "currency": "usd", "source": "tok_pspUnavailable" });
    let create = || {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("order-5")
            .json(body.clone())
    };
    let first = create().send().await;
    first.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "api_error",
        "provider_unavailable",
    );
    let retry = create().send().await;
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!retry.replayed(), "a 503 is not stored");
    // Each request's provider call is retried by the client layer (3 attempts, the provider's
    // 503 is worth another try) before the charge gives up: two requests, six calls.
    assert_eq!(
        h.provider_counts(),
        (6, 0),
        "three provider calls per request"
    );
    let list = h.get("/v1/charges").auth(ALICE).send().await;
    assert!(ids(&list.json).is_empty(), "nothing was recorded");
}

async fn two_accounts_with_one_key_get_two_charges(h: &mut Harness) {
    let create = |api_key| {
        h.post("/v1/charges")
            .auth(api_key)
            .key("shared-key")
            .json(visa(100))
    };
    let alice = create(ALICE).send().await;
    let bob = create(BOB).send().await;
    assert_eq!(alice.status, StatusCode::CREATED);
    assert_eq!(bob.status, StatusCode::CREATED);
    assert!(!bob.replayed(), "Bob never sees Alice's record");
    assert_ne!(alice.json["id"], bob.json["id"]);
    assert_eq!(h.provider_counts(), (2, 2));

    let alice_list = h.get("/v1/charges").auth(ALICE).send().await;
    let bob_list = h.get("/v1/charges").auth(BOB).send().await;
    assert_eq!(ids(&alice_list.json), [alice.json["id"].as_str().unwrap()]);
    assert_eq!(ids(&bob_list.json), [bob.json["id"].as_str().unwrap()]);
}

async fn the_list_is_newest_first_and_per_account(h: &mut Harness) {
    let mut created = Vec::new();
    for amount in [100, 200, 300] {
        created.push(h.charge(ALICE, visa(amount)).await["id"].clone());
    }
    let bob = h.charge(BOB, visa(400)).await;

    let reply = h.get("/v1/charges").auth(ALICE).send().await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json["object"], "list");
    let newest_first: Vec<&str> = created
        .iter()
        .rev()
        .map(|id| id.as_str().unwrap())
        .collect();
    assert_eq!(ids(&reply.json), newest_first);
    let amounts: Vec<&Value> = reply.json["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["amount"])
        .collect();
    assert_eq!(amounts, [&json!(300), &json!(200), &json!(100)]);

    let reply = h.get("/v1/charges").auth(BOB).send().await;
    assert_eq!(ids(&reply.json), [bob["id"].as_str().unwrap()]);
}

async fn another_accounts_charge_is_404(h: &mut Harness) {
    let id = &h.authorized(ALICE, 100).await;

    let reply = h.get(&format!("/v1/charges/{id}")).auth(BOB).send().await;
    reply.assert_error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "resource_missing",
    );
    let reply = h.get("/v1/charges/ch_nope").auth(ALICE).send().await;
    reply.assert_error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "resource_missing",
    );
    // Nor can Bob act on it.
    for action in ["capture", "refunds", "cancel"] {
        let reply = h
            .post(&format!("/v1/charges/{id}/{action}"))
            .auth(BOB)
            .key(&format!("bob-{action}"))
            .send()
            .await;
        assert_eq!(
            reply.status,
            StatusCode::NOT_FOUND,
            "{action}: {}",
            reply.text()
        );
    }
    assert_eq!(h.charge_status(ALICE, id).await["status"], "authorized");
}

async fn capture_an_authorized_charge(h: &mut Harness) {
    let charge = h.charge(ALICE, authorize(1500)).await;
    assert_eq!(charge["status"], "authorized");
    assert_eq!(charge["captured"], false);
    let id = charge["id"].as_str().unwrap();
    let path = format!("/v1/charges/{id}/capture");

    let reply = h.post(&path).auth(ALICE).send().await;
    assert_eq!(
        reply.status,
        StatusCode::BAD_REQUEST,
        "capture needs a key too"
    );

    let capture = || h.post(&path).auth(ALICE).key("capture-1");
    let captured = capture().send().await;
    assert_eq!(captured.status, StatusCode::OK, "{}", captured.text());
    assert_eq!(captured.json["status"], "captured");
    assert_eq!(captured.json["captured"], true);
    assert_eq!(captured.json["id"], id);
    assert_eq!(h.provider_counts(), (2, 2));

    let retry = capture().send().await;
    assert!(retry.replayed());
    assert_eq!(retry.bytes, captured.bytes);

    let again = h.post(&path).auth(ALICE).key("capture-2").send().await;
    again.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_state",
    );
    assert_eq!(
        h.provider_counts(),
        (2, 2),
        "no provider call for a refused capture"
    );
    assert_eq!(h.charge_status(ALICE, id).await["status"], "captured");
}

async fn partial_refunds_then_the_rest(h: &mut Harness) {
    let charge = h.charge(ALICE, visa(1000)).await;
    let id = charge["id"].as_str().unwrap();
    let path = format!("/v1/charges/{id}/refunds");

    let partial = h
        .post(&path)
        .auth(ALICE)
        .key("refund-1")
        .json(json!({ "amount": 300 }))
        .send()
        .await;
    assert_eq!(partial.status, StatusCode::CREATED, "{}", partial.text());
    assert_eq!(partial.json["object"], "refund");
    assert_eq!(partial.json["amount"], 300);
    assert_eq!(partial.json["charge"], id);
    assert!(partial.json["id"].as_str().unwrap().starts_with("re_"));
    let after = h.charge_status(ALICE, id).await;
    assert_eq!(after["status"], "captured");
    assert_eq!(after["amount_refunded"], 300);

    let over = h
        .post(&path)
        .auth(ALICE)
        .key("refund-2")
        .json(json!({ "amount": 701 }))
        .send()
        .await;
    over.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "amount_too_large",
    );
    assert_eq!(h.charge_status(ALICE, id).await["amount_refunded"], 300);

    // No amount: the rest.
    let rest = h.post(&path).auth(ALICE).key("refund-3").send().await;
    assert_eq!(rest.status, StatusCode::CREATED, "{}", rest.text());
    assert_eq!(rest.json["amount"], 700);
    let after = h.charge_status(ALICE, id).await;
    assert_eq!(after["status"], "refunded");
    assert_eq!(after["amount_refunded"], 1000);
    assert_eq!(after["captured"], true);

    let again = h
        .post(&path)
        .auth(ALICE)
        .key("refund-4")
        .json(json!({ "amount": 1 }))
        .send()
        .await;
    again.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_state",
    );
    // The charge, a refund, a refund.
    assert_eq!(h.provider_counts(), (3, 3));

    let bad = h
        .post(&path)
        .auth(ALICE)
        .key("refund-5")
        .json(json!({ "amount": 0 }))
        .send()
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

async fn a_refund_needs_a_captured_charge(h: &mut Harness) {
    let id = &h.authorized(ALICE, 1000).await;
    let reply = h
        .post(&format!("/v1/charges/{id}/refunds"))
        .auth(ALICE)
        .key("refund-authorized")
        .send()
        .await;
    reply.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_state",
    );
}

async fn cancel_an_authorized_charge(h: &mut Harness) {
    let id = &h.authorized(ALICE, 1000).await;

    let canceled = h
        .post(&format!("/v1/charges/{id}/cancel"))
        .auth(ALICE)
        .key("cancel-1")
        .send()
        .await;
    assert_eq!(canceled.status, StatusCode::OK, "{}", canceled.text());
    assert_eq!(canceled.json["status"], "canceled");
    assert_eq!(canceled.json["captured"], false);
    assert_eq!(h.charge_status(ALICE, id).await["status"], "canceled");

    let capture = h
        .post(&format!("/v1/charges/{id}/capture"))
        .auth(ALICE)
        .key("capture-canceled")
        .send()
        .await;
    capture.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_state",
    );

    // A captured charge cannot be canceled (refund it instead).
    let captured = h.charge(ALICE, visa(1000)).await;
    let id = captured["id"].as_str().unwrap();
    let reply = h
        .post(&format!("/v1/charges/{id}/cancel"))
        .auth(ALICE)
        .key("cancel-captured")
        .send()
        .await;
    reply.assert_error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "invalid_state",
    );
    assert_eq!(h.charge_status(ALICE, id).await["status"], "captured");
}

async fn reads_need_no_key_and_are_never_stored(h: &mut Harness) {
    let list = || h.get("/v1/charges").auth(ALICE).key("read-key");
    let empty = list().send().await;
    assert_eq!(empty.status, StatusCode::OK);
    assert!(ids(&empty.json).is_empty());
    let charge = h.charge(ALICE, visa(100)).await;
    let after = list().send().await;
    assert!(!after.replayed());
    assert_eq!(ids(&after.json), [charge["id"].as_str().unwrap()]);
}

async fn a_lost_record_is_caught_by_the_provider(h: &mut Harness) {
    fn create(h: &Harness) -> Call {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("order-6")
            .json(visa(900))
    }
    let first = create(h).send().await;
    assert_eq!(first.status, StatusCode::CREATED);

    h.lose_idempotency_records();
    let retry = create(h).send().await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!retry.replayed(), "the layer had forgotten the key");
    assert_eq!(retry.json["id"], first.json["id"], "the same charge");
    assert_eq!(
        h.provider_counts(),
        (1, 1),
        "the ledger found the operation's charge: no second provider call"
    );
    let list = h.get("/v1/charges").auth(ALICE).send().await;
    assert_eq!(ids(&list.json).len(), 1);
}

async fn a_provider_outage_rolls_a_capture_back(h: &mut Harness) {
    let id = &h.authorized(ALICE, 1000).await;
    let capture = || {
        h.post(&format!("/v1/charges/{id}/capture"))
            .auth(ALICE)
            .key("capture-outage")
    };

    h.parts.outage.set_down(true);
    let down = capture().send().await;
    down.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "api_error",
        "provider_unavailable",
    );
    assert_eq!(h.charge_status(ALICE, id).await["status"], "authorized");

    h.parts.outage.set_down(false);
    let retry = capture().send().await;
    assert_eq!(retry.status, StatusCode::OK, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(retry.json["status"], "captured");
    // The authorization, the capture in the outage (three attempts of the client layer, each a
    // 503), and the capture after it.
    assert_eq!(h.provider_counts(), (5, 2));
}

/// A provider down for a moment (two calls) is retried by the client layer within the request:
/// the charge and a capture each succeed at the first request, with one payment and one capture.
async fn a_provider_down_for_a_moment_is_retried_within_the_request(h: &mut Harness) {
    h.parts.outage.set_down_for(2);
    let created = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("order-blip")
        .json(authorize(900))
        .send()
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(created.json["status"], "authorized");
    assert_eq!(h.provider_counts(), (3, 1), "two 503s, then the payment");

    let id = created.json["id"].as_str().expect("an id").to_owned();
    h.parts.outage.set_down_for(1);
    let captured = h
        .post(&format!("/v1/charges/{id}/capture"))
        .auth(ALICE)
        .key("capture-blip")
        .send()
        .await;
    assert_eq!(captured.status, StatusCode::OK, "{}", captured.text());
    assert_eq!(captured.json["status"], "captured");
    assert_eq!(h.provider_counts(), (5, 2), "one 503, then the capture");
}

/// The key of a refund, reused for a charge once both windows ran out: a new charge, not the
/// refund's (nor a 500).
async fn a_key_reused_after_the_window_for_another_operation_is_a_new_charge(h: &mut Harness) {
    h.provider_window(SHORT_WINDOW).await;
    let charge = h.charge(ALICE, visa(1000)).await;
    let id = charge["id"].as_str().unwrap();
    let refund = h
        .post(&format!("/v1/charges/{id}/refunds"))
        .auth(ALICE)
        .key("reused-1")
        .send()
        .await;
    assert_eq!(refund.status, StatusCode::CREATED, "{}", refund.text());

    h.pass_the_windows().await;
    let reused = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("reused-1")
        .json(visa(700))
        .send()
        .await;
    assert_eq!(reused.status, StatusCode::CREATED, "{}", reused.text());
    assert!(!reused.replayed());
    assert_ne!(reused.json["id"], charge["id"]);
    assert_eq!(reused.json["amount"], 700);
    assert_eq!(reused.json["status"], "captured");
    assert_eq!(h.charge_status(ALICE, id).await["status"], "refunded");
    let list = h.get("/v1/charges").auth(ALICE).send().await;
    assert_eq!(ids(&list.json).len(), 2);
}

/// A key reused for another amount once both windows ran out: a new charge of that amount.
async fn a_key_reused_after_the_window_for_another_amount_is_a_new_charge(h: &mut Harness) {
    h.provider_window(SHORT_WINDOW).await;
    fn create(h: &Harness, amount: i64) -> Call {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("reused-2")
            .json(visa(amount))
    }
    let first = create(h, 900).send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.text());
    let id = first.json["id"].as_str().unwrap();
    let refund = h
        .post(&format!("/v1/charges/{id}/refunds"))
        .auth(ALICE)
        .key("refund-reused-2")
        .send()
        .await;
    assert_eq!(refund.status, StatusCode::CREATED, "{}", refund.text());

    h.pass_the_windows().await;
    let reused = create(h, 1200).send().await;
    assert_eq!(reused.status, StatusCode::CREATED, "{}", reused.text());
    assert!(!reused.replayed());
    assert_ne!(reused.json["id"], first.json["id"]);
    assert_eq!(reused.json["amount"], 1200);
    assert_eq!(reused.json["status"], "captured");
    assert_eq!(reused.json["amount_refunded"], 0);
}

/// A key the layer forgot but the ledger and the provider still hold, reused for another amount:
/// refused (by the ledger's operation, before the provider), and nothing charged.
async fn a_key_reused_within_the_providers_window_for_another_amount_is_refused(h: &mut Harness) {
    reused_within_the_providers_window(h, "reused-3", visa(900), visa(1200)).await;
}

/// Metadata is part of the request a key names, as Stripe compares every parameter.
async fn a_key_reused_within_the_providers_window_for_other_metadata_is_refused(h: &mut Harness) {
    let with_order = |order: &str| {
        let mut body = visa(900);
        body["metadata"] = json!({ "order_id": order });
        body
    };
    reused_within_the_providers_window(h, "reused-5", with_order("1"), with_order("2")).await;
}

/// `first` under `key`, then, once the layer forgot the key, `other` under it: refused by the
/// ledger's operation before the provider; and `first` again is still the first charge.
async fn reused_within_the_providers_window(
    h: &mut Harness,
    key: &str,
    first: Value,
    other: Value,
) {
    let create = |h: &Harness, body: &Value| {
        h.post("/v1/charges")
            .auth(ALICE)
            .key(key)
            .json(body.clone())
    };
    let charged = create(h, &first).send().await;
    assert_eq!(charged.status, StatusCode::CREATED, "{}", charged.text());

    h.lose_idempotency_records();
    let reused = create(h, &other).send().await;
    reused.assert_error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        "idempotency_key_reused",
    );
    assert_eq!(
        h.provider_counts(),
        (1, 1),
        "the ledger's operation refused it before the provider"
    );
    let list = h.get("/v1/charges").auth(ALICE).send().await;
    assert_eq!(ids(&list.json), [charged.json["id"].as_str().unwrap()]);

    // The same request as the first, once the layer forgot the refusal too, is still the
    // first charge.
    h.lose_idempotency_records();
    let same = create(h, &first).send().await;
    assert_eq!(same.status, StatusCode::CREATED, "{}", same.text());
    assert_eq!(same.json["id"], charged.json["id"]);
}

/// A key the layer forgot but the provider still holds, reused for another operation: refused
/// too, and the charge it was aimed at is left as it was.
async fn a_key_reused_within_the_providers_window_for_another_operation_is_refused(
    h: &mut Harness,
) {
    let id = &h.authorized(ALICE, 1000).await;
    let capture = h
        .post(&format!("/v1/charges/{id}/capture"))
        .auth(ALICE)
        .key("reused-4")
        .send()
        .await;
    assert_eq!(capture.status, StatusCode::OK, "{}", capture.text());

    h.lose_idempotency_records();
    let refund = h
        .post(&format!("/v1/charges/{id}/refunds"))
        .auth(ALICE)
        .key("reused-4")
        .send()
        .await;
    refund.assert_error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        "idempotency_key_reused",
    );
    let after = h.charge_status(ALICE, id).await;
    assert_eq!(after["status"], "captured", "rolled back");
    assert_eq!(after["amount_refunded"], 0);
    h.lose_idempotency_records();
    let create = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("reused-4")
        .json(visa(1000))
        .send()
        .await;
    create.assert_error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        "idempotency_key_reused",
    );
    assert_eq!(h.provider_counts(), (4, 2));
}

/// A capture whose answer was lost (`504`, not stored), then the same client key sent to cancel
/// the charge: another request under the capture's key, refused (`idempotency_key_reused`)
/// without a provider call; it neither resumes the capture nor rolls it back. The reconciler
/// then learns that the capture was made.
async fn a_key_sent_again_for_another_operation_leaves_the_unknown_call_alone(h: &mut Harness) {
    let id = h.authorized(ALICE, 800).await;
    let capture = h.post(&format!("/v1/charges/{id}/capture")).auth(ALICE);
    h.send_losing_the_answer(capture.key("op-7")).await;
    let calls = h.parts.outage.calls();
    let cancel = h
        .post(&format!("/v1/charges/{id}/cancel"))
        .auth(ALICE)
        .key("op-7")
        .send()
        .await;
    cancel.assert_error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        "idempotency_key_reused",
    );
    assert_eq!(
        h.parts.outage.calls(),
        calls,
        "no provider call for the cancel"
    );
    assert_eq!(h.charge_status(ALICE, &id).await["status"], "capturing");

    h.reconcile_now().await;
    assert_eq!(h.charge_status(ALICE, &id).await["status"], "captured");
    assert_eq!(h.parts.keys.effects(), 2, "one payment, one capture");
}

/// A capture held up at the provider's key table (as behind a lock) while the reconciler settles
/// its charge: the reconciler sends the capture again under its key with the largest fence, so
/// the provider makes it once, whichever lands first, and the charge ends captured, as the money
/// is; never rolled back while the held-up call can still land.
async fn a_capture_held_up_at_the_provider_is_made_once_by_the_reconciler(h: &mut Harness) {
    let id = h.authorized(ALICE, 700).await;
    let held = h.parts.keys.stall().await;
    let call = h.post(&format!("/v1/charges/{id}/capture")).auth(ALICE);
    let capture = tokio::spawn(call.key("held-capture").send());
    wait_until("the capture at the provider", || {
        h.parts.keys.stalled() == 1
    })
    .await;
    let reconciler = h.parts.reconciler(Duration::ZERO);
    let round = tokio::spawn(async move { reconciler.round().await });
    let both = || h.parts.keys.stalled() == 2;
    wait_until("the reconciler's capture at the provider", both).await;

    drop(held);
    let round = round.await.expect("the round");
    assert!(round.is_ok(), "{round:?}");
    let capture = capture.await.expect("the capture");
    // Its own call first: captured; the reconciler's first: this run was superseded.
    assert!(
        [StatusCode::OK, StatusCode::CONFLICT].contains(&capture.status),
        "{}",
        capture.text()
    );
    assert_eq!(h.charge_status(ALICE, &id).await["status"], "captured");
    assert_eq!(h.parts.keys.effects(), 2, "one payment, one capture");
}

/// A capture whose answer was lost, which the reconciler then settled (sending it again under its
/// key, with the largest fence): the client's retry gets the captured charge, not a refusal of
/// its smaller fence.
async fn a_capture_the_reconciler_settled_is_answered_to_its_retry(h: &mut Harness) {
    let id = h.authorized(ALICE, 900).await;
    let capture = || {
        h.post(&format!("/v1/charges/{id}/capture"))
            .auth(ALICE)
            .key("cap-r")
    };
    h.send_losing_the_answer(capture()).await;
    h.reconcile_now().await;
    let retried = capture().send().await;
    assert_eq!(retried.status, StatusCode::OK, "{}", retried.text());
    assert_eq!(retried.json["status"], "captured");
    assert_eq!(h.parts.keys.effects(), 2, "one payment, one capture");
}

/// A refund whose call was lost on its way (`504`, never seen by the provider), which the
/// reconciler takes over and sends again, while the client's retry finds the provider down: the
/// retry leaves the charge to the reconciler (the outcome unknown, not rolled back with "nothing
/// was done"), and the refund the reconciler makes ends in the ledger as at the provider.
async fn a_call_the_reconciler_took_over_is_not_rolled_back_by_a_retry(h: &mut Harness) {
    let charge = h.charge(ALICE, visa(1000)).await;
    let id = charge["id"].as_str().expect("an id").to_owned();
    let refunds = format!("/v1/charges/{id}/refunds");
    let refund = || {
        h.post(&refunds)
            .auth(ALICE)
            .key("refund-t")
            .form("amount=400")
    };
    h.parts.outage.set_dropping_calls(true);
    refund().send().await.assert_error(
        StatusCode::GATEWAY_TIMEOUT,
        "api_error",
        "provider_outcome_unknown",
    );
    h.parts.outage.set_dropping_calls(false);
    // The reconciler takes the call over; its call waits at the provider.
    let held = h.parts.keys.stall().await;
    let reconciler = h.parts.reconciler(Duration::ZERO);
    let round = tokio::spawn(async move { reconciler.round().await });
    let stalled = || h.parts.keys.stalled() == 1;
    wait_until("the reconciler's refund at the provider", stalled).await;

    h.parts.outage.set_down(true);
    let calls = h.parts.outage.calls();
    refund().send().await.assert_error(
        StatusCode::GATEWAY_TIMEOUT,
        "api_error",
        "provider_outcome_unknown",
    );
    assert_eq!(
        h.parts.outage.calls(),
        calls,
        "the reconciler's call: the retry waits for it, and sends none"
    );
    h.parts.outage.set_down(false);
    drop(held);
    let round = round.await.expect("the round");
    assert!(round.is_ok(), "{round:?}");
    // The retry's touch may have kept that round's write out: the next one settles it.
    h.reconcile_now().await;
    h.assert_refunded(&id, "captured", 400).await;
    assert_eq!(h.provider_refunded().await, [400]);
}

/// A capture sent again after a refund moved its charge on (its answer lost to the client, the
/// layer's record gone): the charge as it is now, with no provider call, not `invalid_state` for
/// a capture that was made.
async fn a_capture_retried_after_a_refund_gets_the_charge(h: &mut Harness) {
    let id = h.authorized(ALICE, 1000).await;
    let path = format!("/v1/charges/{id}/capture");
    let capture = |h: &Harness| h.post(&path).auth(ALICE).key("cap-then-refund");
    let captured = capture(h).send().await;
    assert_eq!(captured.status, StatusCode::OK, "{}", captured.text());
    let refund = h.post(&format!("/v1/charges/{id}/refunds")).auth(ALICE);
    let refund = refund.key("refund-after").form("amount=300").send().await;
    assert_eq!(refund.status, StatusCode::CREATED, "{}", refund.text());

    h.lose_idempotency_records();
    let calls = h.parts.outage.calls();
    let again = capture(h).send().await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.text());
    assert_eq!(
        (&again.json["status"], &again.json["amount_refunded"]),
        (&json!("captured"), &json!(300))
    );
    assert_eq!(h.parts.outage.calls(), calls, "no provider call");
}

/// A refund whose answer was lost, which the reconciler then learned was made, another refund,
/// and then the first one's retry: answered with its refund, and counted once, in the ledger as
/// at the provider.
async fn a_refund_retried_after_another_refund_is_counted_once(h: &mut Harness) {
    let charge = h.charge(ALICE, visa(1000)).await;
    let id = charge["id"].as_str().expect("an id").to_owned();
    let refunds = format!("/v1/charges/{id}/refunds");
    let first = |h: &Harness| {
        h.post(&refunds)
            .auth(ALICE)
            .key("refund-a")
            .form("amount=300")
    };
    h.send_losing_the_answer(first(h)).await;
    h.reconcile_now().await;
    assert_eq!(h.charge_status(ALICE, &id).await["amount_refunded"], 300);
    let second = h
        .post(&refunds)
        .auth(ALICE)
        .key("refund-b")
        .form("amount=200");
    let second = second.send().await;
    assert_eq!(second.status, StatusCode::CREATED, "{}", second.text());

    let queue = h.parts.queue.clone().expect("the events' queue");
    let published = queue.published();
    let retried = first(h).send().await;
    assert_eq!(retried.status, StatusCode::CREATED, "{}", retried.text());
    assert_eq!(retried.json["amount"], 300);
    assert_ne!(retried.json["id"], second.json["id"]);
    assert_eq!(
        queue.published(),
        published + 1,
        "its event again, in case a process died before it was published"
    );
    h.assert_refunded(&id, "captured", 500).await;
    // The same key for another amount, once the layer forgot it, is another request.
    h.lose_idempotency_records();
    let other = h
        .post(&refunds)
        .auth(ALICE)
        .key("refund-a")
        .form("amount=250");
    other.send().await.assert_error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        "idempotency_key_reused",
    );
    assert_eq!(h.provider_refunded().await, [500]);
    assert_eq!(h.parts.keys.effects(), 3, "one payment, two refunds");
}

/// A refund whose provider call failed, held up before its rollback while the reconciler settled
/// its charge and a second refund reached the provider: the first request's rollback leaves the
/// second's call alone, and the second settles the charge refunded, as the provider did.
async fn a_late_rollback_leaves_another_requests_call_alone(h: &mut Harness) {
    let charge = h.charge(ALICE, visa(1000)).await;
    let id = charge["id"].as_str().expect("an id").to_owned();
    let refunds = format!("/v1/charges/{id}/refunds");
    // The first refund begins, its provider call fails (the provider is down), and its rollback
    // waits at the ledger.
    h.parts.outage.set_down(true);
    let rollback = Arc::new(Gate::default());
    let rollback_held = rollback.shut().await;
    h.parts.ledger.hold_update(1, rollback.clone());
    let call = h
        .post(&refunds)
        .auth(ALICE)
        .key("refund-1")
        .form("amount=400");
    let first = tokio::spawn(call.send());
    wait_until("the rollback at the ledger", || rollback.waiting() == 1).await;
    // The provider is back; the reconciler finds the charge refunding and sends the refund again
    // under its key: made, and the charge captured again, 400 refunded.
    h.parts.outage.set_down(false);
    h.reconcile_now().await;
    h.assert_refunded(&id, "captured", 400).await;
    // The second refund, of the rest, reaches the provider and waits there.
    let provider_held = h.parts.keys.stall().await;
    let call = h.post(&refunds).auth(ALICE).key("refund-2");
    let second = tokio::spawn(call.send());
    wait_until("the refund at the provider", || h.parts.keys.stalled() == 1).await;

    drop(rollback_held);
    // Its call was made meanwhile, by the reconciler: not "nothing was done", but unknown to this
    // run; the retry with its key learns it.
    let first = first.await.expect("the first refund");
    first.assert_error(
        StatusCode::GATEWAY_TIMEOUT,
        "api_error",
        "provider_outcome_unknown",
    );
    drop(provider_held);
    let second = second.await.expect("the second refund");
    assert_eq!(second.status, StatusCode::CREATED, "{}", second.text());
    assert_eq!(second.json["amount"], 600);
    let retried = h
        .post(&refunds)
        .auth(ALICE)
        .key("refund-1")
        .form("amount=400");
    let retried = retried.send().await;
    assert_eq!(retried.status, StatusCode::CREATED, "{}", retried.text());
    assert_eq!(retried.json["amount"], 400);
    h.assert_refunded(&id, "refunded", 1000).await;
}

on_both_stores!(
    create_is_201_with_the_charge,
    a_retry_replays_the_charge,
    the_same_key_with_another_amount_is_400_idempotency_error,
    form_bodies_charge_and_replay_by_their_bytes,
    a_decline_is_402_and_replayed,
    provider_unavailable_is_503_and_a_retry_runs_again,
    two_accounts_with_one_key_get_two_charges,
    the_list_is_newest_first_and_per_account,
    another_accounts_charge_is_404,
    capture_an_authorized_charge,
    partial_refunds_then_the_rest,
    a_refund_needs_a_captured_charge,
    cancel_an_authorized_charge,
    reads_need_no_key_and_are_never_stored,
    a_lost_record_is_caught_by_the_provider,
    a_provider_outage_rolls_a_capture_back,
    a_provider_down_for_a_moment_is_retried_within_the_request,
    a_key_reused_after_the_window_for_another_operation_is_a_new_charge,
    a_key_reused_after_the_window_for_another_amount_is_a_new_charge,
    a_key_reused_within_the_providers_window_for_another_amount_is_refused,
    a_key_reused_within_the_providers_window_for_other_metadata_is_refused,
    a_key_reused_within_the_providers_window_for_another_operation_is_refused,
    a_late_rollback_leaves_another_requests_call_alone,
    a_key_sent_again_for_another_operation_leaves_the_unknown_call_alone,
    a_refund_retried_after_another_refund_is_counted_once,
    a_capture_held_up_at_the_provider_is_made_once_by_the_reconciler,
    a_capture_the_reconciler_settled_is_answered_to_its_retry,
    a_call_the_reconciler_took_over_is_not_rolled_back_by_a_retry,
    a_capture_retried_after_a_refund_gets_the_charge,
);

/// The provider charges, then its answer never comes (it hangs once the payment is made): the
/// client layer's attempt times out and its retry, with the same key, gets the provider's first
/// reply from its key table. One request, one payment. On paused time, the attempt timeout costs
/// no real time.
#[tokio::test(start_paused = true)]
async fn a_provider_answer_lost_to_the_attempt_timeout_is_retried_and_charged_once() {
    let h = Harness::memory();
    h.parts.keys.hang(Hang::AfterEffect);
    let started = tokio::time::Instant::now();
    let created = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("order-lost")
        .json(visa(1200))
        .send()
        .await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(created.json["status"], "captured");
    assert_eq!(
        h.provider_counts(),
        (2, 1),
        "the retry was answered from the provider's keys"
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(3) && waited < Duration::from_secs(4),
        "one attempt timeout (3 s) and a short backoff: {waited:?}"
    );
    h.finish();
}

/// Two instances on one Redis: the charges and the provider's keys are shared, so a retry that
/// reaches the other instance after the layer forgot the key finds the first charge, or the
/// refusal.
#[tokio::test]
async fn two_instances_on_one_redis_share_the_charges_and_the_providers_keys() {
    let mut first = Harness::redis().await;
    let second = first.second_instance().await;
    fn create(h: &Harness, amount: i64) -> Call {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("shared")
            .json(visa(amount))
    }
    let charged = create(&first, 900).send().await;
    assert_eq!(charged.status, StatusCode::CREATED, "{}", charged.text());

    first.lose_idempotency_records();
    let retry = create(&second, 900).send().await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(retry.json["id"], charged.json["id"], "the same charge");
    assert_eq!(second.provider_counts(), (0, 0), "nothing charged again");

    first.lose_idempotency_records();
    let other = create(&second, 1200).send().await;
    other.assert_error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        "idempotency_key_reused",
    );
    assert_eq!(second.provider_counts(), (0, 0));
    first.finish();
}

/// `GET /metrics`: the layer's counters and store latencies in Prometheus' text format, with no
/// API key, and nothing of a request (key, account) in a label.
#[tokio::test]
async fn metrics_are_served_in_prometheus_text() {
    let (recorder, handle) = example_payments::prometheus::recorder();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let mut h = Harness::memory();
    h.state.metrics = Some(handle);
    h.router = Harness::app(&h.state, &h.records);
    let create = || {
        h.post("/v1/charges")
            .auth(ALICE)
            .key("order-metrics")
            .json(visa(500))
    };
    assert_eq!(create().send().await.status, StatusCode::CREATED);
    assert!(create().send().await.replayed());
    let other = h
        .post("/v1/charges")
        .auth(ALICE)
        .key("order-metrics")
        .json(visa(600))
        .send()
        .await;
    assert_eq!(other.status, StatusCode::BAD_REQUEST);

    let reply = h.get("/metrics").send().await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert!(reply.content_type().starts_with("text/plain"));
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
    assert!(
        text.contains("idempotency_store_call_duration_seconds_bucket{operation=\"claim\",result=\"ok\",le=\"0.001\"}"),
        "{text}"
    );
    assert!(
        !text.contains("order-metrics") && !text.contains("acct_"),
        "{text}"
    );
    h.finish();
}

// ---------------------------------------------------------------------------------------------
// The provider alone: its keys, its fences and its refund bound, on every key table.

/// A provider whose keys are in memory for `window`, and its probe.
fn memory_provider(window: Duration) -> (Provider, Arc<ProbedKeys>) {
    probed(MemoryKeys::new(window))
}

/// A provider on `keys`, and their probe.
fn probed(keys: impl KeyTable + 'static) -> (Provider, Arc<ProbedKeys>) {
    let keys = ProbedKeys::new(Arc::new(keys));
    (Provider::new(keys.clone(), Duration::ZERO), keys)
}

/// The key table a provider scenario runs on, and the server it needs, kept running while the
/// scenario does.
enum KeyTableOn {
    Memory,
    Redis(RedisServer),
    RedisCluster(RedisCluster),
    Postgres(PostgresServer),
}

impl KeyTableOn {
    /// A provider whose keys are on this table for the provider's window, and its probe.
    async fn provider(&self) -> (Provider, Arc<ProbedKeys>) {
        let redis = |store: Result<RedisStore, _>| {
            let conn = store.expect("valid URLs").shared_connection();
            probed(RedisKeys::new(conn, WINDOW))
        };
        match self {
            KeyTableOn::Memory => memory_provider(WINDOW),
            KeyTableOn::Redis(server) => redis(RedisStore::from_url(&server.url())),
            KeyTableOn::RedisCluster(cluster) => redis(RedisStore::cluster(cluster.urls())),
            KeyTableOn::Postgres(server) => {
                let db = pg::connect(&server.url()).await.expect("the database");
                probed(PgKeys::new(db.pool().clone(), WINDOW))
            }
        }
    }
}

/// Runs each provider scenario on every key table: memory, Redis, a Redis Cluster, PostgreSQL.
macro_rules! on_every_key_table {
    ($scenario:ident) => {
        mod $scenario {
            use super::*;

            #[tokio::test]
            async fn in_memory() {
                $scenario(KeyTableOn::Memory.provider().await).await;
            }

            #[tokio::test]
            async fn on_redis() {
                let table = KeyTableOn::Redis(RedisServer::start());
                $scenario(table.provider().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_a_redis_cluster() {
                let table = KeyTableOn::RedisCluster(RedisCluster::start());
                $scenario(table.provider().await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_postgres() {
                let table = KeyTableOn::Postgres(PostgresServer::start());
                $scenario(table.provider().await).await;
            }
        }
    };
}

#[tokio::test]
async fn a_repeated_key_gets_the_first_reply_without_a_second_effect() {
    let (provider, keys) = memory_provider(WINDOW);
    let first = provider
        .create_payment("k1", 0, Source::Visa, 100, true, "")
        .await
        .unwrap();
    let again = provider
        .create_payment("k1", 0, Source::Visa, 100, true, "")
        .await
        .unwrap();
    assert_eq!(first, again);
    assert_eq!(first.outcome, Outcome::Captured);
    assert_eq!(keys.effects(), 1);

    let other = provider
        .create_payment("k2", 0, Source::Visa, 100, false, "")
        .await
        .unwrap();
    assert_ne!(other.id, first.id);
    assert_eq!(other.outcome, Outcome::Authorized);
    assert_eq!(keys.effects(), 2);
}

#[tokio::test]
async fn a_smaller_fence_is_refused_and_an_equal_or_larger_one_resends() {
    let (provider, keys) = memory_provider(WINDOW);
    let payment = provider
        .create_payment("k", 20, Source::Visa, 100, true, "")
        .await
        .unwrap();
    assert_eq!(
        provider
            .create_payment("k", 10, Source::Visa, 100, true, "")
            .await,
        Err(ProviderError::Superseded),
        "a run taken over acts no more"
    );
    assert_eq!(
        provider
            .create_payment("k", 20, Source::Visa, 100, true, "")
            .await,
        Ok(payment.clone()),
        "the same claim's resend"
    );
    assert_eq!(
        provider
            .create_payment("k", 30, Source::Visa, 100, true, "")
            .await,
        Ok(payment.clone()),
        "a later claim of the same request gets the same payment"
    );
    assert_eq!(
        provider
            .create_payment("k", 20, Source::Visa, 100, true, "")
            .await,
        Err(ProviderError::Superseded),
        "the key keeps the largest fence"
    );
    assert_eq!(
        provider
            .create_payment("k", 40, Source::Visa, 101, true, "")
            .await,
        Err(ProviderError::KeyReused),
        "another request is refused whatever its fence"
    );
    assert_eq!(provider.capture("c", 5, &payment.id).await, Ok(()));
    assert_eq!(
        provider.capture("c", 4, &payment.id).await,
        Err(ProviderError::Superseded)
    );
    assert_eq!(keys.effects(), 2, "one payment, one capture");
}

#[tokio::test]
async fn a_decline_is_a_decided_outcome() {
    let (provider, keys) = memory_provider(WINDOW);
    for _ in 0..2 {
        let reply = provider
            .create_payment("k", 0, Source::ChargeDeclined, 100, true, "")
            .await
            .unwrap();
        assert_eq!(reply.outcome, Outcome::Declined);
    }
    assert_eq!(keys.effects(), 1);
}

#[tokio::test]
async fn an_unavailable_call_does_nothing_and_is_not_remembered() {
    let (provider, keys) = memory_provider(WINDOW);
    for _ in 0..2 {
        let reply = provider
            .create_payment("k", 0, Source::ProviderUnavailable, 100, true, "")
            .await;
        assert_eq!(reply, Err(ProviderError::Unavailable));
    }
    assert_eq!(keys.effects(), 0);

    // Down for every call, through the API as the handlers call it.
    let outage = Arc::new(Outage::default());
    let client = ProviderClient::new(outage.router(&provider));
    outage.set_down(true);
    assert_eq!(
        client.capture("c", 0, "py_1").await,
        Err(ProviderError::Unavailable)
    );
    outage.set_down(false);
    assert_eq!(client.capture("c", 0, "py_1").await, Ok(()));
    assert_eq!(keys.effects(), 1);
}

#[tokio::test]
async fn a_key_is_bound_to_its_operation_and_parameters() {
    let (provider, keys) = memory_provider(WINDOW);
    let payment = provider
        .create_payment("k", 0, Source::Visa, 100, true, "")
        .await
        .unwrap();
    let reused = [
        provider
            .create_payment("k", 0, Source::Visa, 101, true, "")
            .await,
        provider
            .create_payment("k", 0, Source::Visa, 100, false, "")
            .await,
        provider
            .create_payment("k", 0, Source::ChargeDeclined, 100, true, "")
            .await,
    ];
    for reply in reused {
        assert_eq!(reply, Err(ProviderError::KeyReused));
    }
    assert_eq!(
        provider.refund("k", 0, &payment.id, 100).await,
        Err(ProviderError::KeyReused)
    );
    assert_eq!(
        provider.capture("k", 0, &payment.id).await,
        Err(ProviderError::KeyReused)
    );
    assert_eq!(
        provider.cancel("k", 0, &payment.id).await,
        Err(ProviderError::KeyReused)
    );

    let refund = provider.refund("r", 0, &payment.id, 40).await.unwrap();
    assert_eq!(provider.refund("r", 0, &payment.id, 40).await, Ok(refund));
    assert_eq!(
        provider.refund("r", 0, &payment.id, 60).await,
        Err(ProviderError::KeyReused)
    );
    assert_eq!(
        provider.refund("r", 0, "py_other", 40).await,
        Err(ProviderError::KeyReused)
    );
    assert_eq!(keys.effects(), 2);
}

#[tokio::test]
async fn a_payment_is_found_by_its_key_and_request_only() {
    let (provider, keys) = memory_provider(WINDOW);
    let find = |amount, capture| {
        let request = Request::CreatePayment {
            source: Source::Visa,
            amount,
            capture,
        }
        .describe();
        let provider = provider.clone();
        async move { provider.find_call("k", &request).await }
    };
    assert_eq!(find(100, false).await, Ok(None));
    let payment = provider
        .create_payment("k", 0, Source::Visa, 100, false, "")
        .await
        .unwrap();
    let payment_id = payment.id.clone();
    assert_eq!(find(100, false).await, Ok(Some(payment.id)));
    assert_eq!(Outcome::of(Source::Visa, false), payment.outcome);
    assert_eq!(
        find(101, false).await,
        Ok(None),
        "the key was used for another request"
    );
    provider.refund("r", 0, &payment_id, 100).await.unwrap();
    let create = Request::CreatePayment {
        source: Source::Visa,
        amount: 100,
        capture: true,
    };
    assert_eq!(provider.find_call("r", &create.describe()).await, Ok(None));
    assert_eq!(keys.effects(), 2, "a lookup moves no money");
}

#[tokio::test(start_paused = true)]
async fn a_key_is_new_again_after_the_window() {
    let window = Duration::from_secs(60);
    let (provider, keys) = memory_provider(window);
    let paid = provider
        .create_payment("paid", 0, Source::Visa, 100, true, "")
        .await
        .unwrap();
    let refund = provider.refund("k", 0, &paid.id, 100).await.unwrap();

    tokio::time::advance(window - Duration::from_millis(1)).await;
    assert_eq!(
        provider
            .create_payment("k", 0, Source::Visa, 100, true, "")
            .await,
        Err(ProviderError::KeyReused)
    );

    tokio::time::advance(Duration::from_millis(1)).await;
    let payment = provider
        .create_payment("k", 0, Source::Visa, 100, true, "")
        .await
        .unwrap();
    assert_ne!(payment.id, refund);
    assert_eq!(payment.outcome, Outcome::Captured);
    assert_eq!(
        provider
            .create_payment("k", 0, Source::Visa, 100, true, "")
            .await,
        Ok(payment)
    );
    assert_eq!(keys.effects(), 3);
}

#[tokio::test]
async fn a_refund_beyond_what_is_left_of_its_payment_is_refused() {
    let (provider, keys) = memory_provider(WINDOW);
    let payment = provider
        .create_payment("pay", 0, Source::Visa, 1000, true, "")
        .await
        .unwrap();
    provider.refund("r1", 0, &payment.id, 600).await.unwrap();
    assert_eq!(
        provider.refund("r2", 0, &payment.id, 600).await,
        Err(ProviderError::AmountTooLarge {
            amount: 600,
            refundable: 400
        })
    );
    provider.refund("r3", 0, &payment.id, 400).await.unwrap();
    assert_eq!(
        provider.refund("r1", 0, &payment.id, 600).await.map(drop),
        Ok(()),
        "a resend gets its first reply"
    );
    assert_eq!(
        provider.refund("r4", 0, "py_none", 1).await,
        Err(ProviderError::NoSuchPayment)
    );
    assert_eq!(keys.effects(), 3, "one payment, two refunds");
    let listed = provider.payments_since(0, 10).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].id.as_str(), listed[0].refunded),
        (payment.id.as_str(), 1000)
    );
}

/// The provider refuses a call whose fence is smaller than one its key has seen, and takes an
/// equal or larger one as the same request sent again, on the key table under test.
async fn the_provider_refuses_a_smaller_fence((provider, keys): (Provider, Arc<ProbedKeys>)) {
    let payment = provider
        .create_payment("fenced", 20, Source::Visa, 700, true, "")
        .await
        .expect("a payment");
    assert_eq!(
        provider
            .create_payment("fenced", 19, Source::Visa, 700, true, "")
            .await,
        Err(ProviderError::Superseded)
    );
    for fence in [20, 21] {
        assert_eq!(
            provider
                .create_payment("fenced", fence, Source::Visa, 700, true, "")
                .await,
            Ok(payment.clone())
        );
    }
    assert_eq!(
        provider
            .create_payment("fenced", 20, Source::Visa, 700, true, "")
            .await,
        Err(ProviderError::Superseded),
        "the key keeps its largest fence"
    );
    assert_eq!(
        provider
            .create_payment("fenced", 99, Source::Visa, 701, true, "")
            .await,
        Err(ProviderError::KeyReused)
    );
    let refund = provider
        .refund("fenced-refund", u64::MAX, &payment.id, 100)
        .await
        .expect("a refund");
    assert_eq!(
        provider
            .refund("fenced-refund", u64::MAX - 1, &payment.id, 100)
            .await,
        Err(ProviderError::Superseded),
        "fences compare exactly, up to the largest"
    );
    assert_eq!(
        provider
            .refund("fenced-refund", u64::MAX, &payment.id, 100)
            .await,
        Ok(refund)
    );
    assert_eq!(keys.effects(), 2, "one payment, one refund");
}

on_every_key_table!(the_provider_refuses_a_smaller_fence);

/// The keys whose window ended are swept from PostgreSQL's table (Redis expires its own, memory
/// drops them as it goes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_sweeps_the_expired_keys() {
    let server = PostgresServer::start();
    let db = pg::connect(&server.url()).await.expect("the database");
    let short = Arc::new(PgKeys::new(db.pool().clone(), Duration::from_millis(50)));
    Provider::new(short.clone(), Duration::ZERO)
        .capture("short-lived", 1, "py_1")
        .await
        .expect("captured");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(short.sweep().await.expect("a sweep"), 1);
    assert_eq!(short.sweep().await.expect("a sweep"), 0);
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM provider_keys WHERE key = 'short-lived'")
            .fetch_one(db.pool())
            .await
            .expect("a count");
    assert_eq!(left, 0);
}

/// The provider alone refuses a refund beyond what is left of its payment, whatever key it comes
/// under, atomically with its keys: the last line of defence, on the key table under test.
async fn the_provider_refuses_an_over_refund((provider, _): (Provider, Arc<ProbedKeys>)) {
    let payment = provider
        .create_payment("over", 1, Source::Visa, 1000, true, "")
        .await
        .expect("a payment");
    let refunds = [("over-1", 700), ("over-2", 700), ("over-3", 300)];
    let mut answers = Vec::new();
    for (key, amount) in refunds {
        answers.push(provider.refund(key, 1, &payment.id, amount).await.map(drop));
    }
    assert_eq!(
        answers,
        [
            Ok(()),
            Err(ProviderError::AmountTooLarge {
                amount: 700,
                refundable: 300
            }),
            Ok(())
        ]
    );
    assert_eq!(
        provider.refund("over-4", 1, &payment.id, 1).await,
        Err(ProviderError::AmountTooLarge {
            amount: 1,
            refundable: 0
        })
    );
    let listed = provider.payments_since(0, 10).await.expect("a listing");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].refunded, 1000);
}

on_every_key_table!(the_provider_refuses_an_over_refund);

// ---------------------------------------------------------------------------------------------
// The client's half (`src/bin/client.rs`) against the server as users run it: answers lost or cut
// off on the way, and each charge made once.

/// The client (`src/bin/client.rs`) against the payments example: the flaky link loses the first
/// answer, the client layer retries with the same key, the server replays its stored answer, and
/// the charge is applied once (one charge in the list, its amount once in the balance).
#[cfg(unix)]
#[test]
fn the_client_example_pays_once_through_a_flaky_link() {
    let server = Server::start(&[]);
    let url = format!("http://{}", server.addr);
    let (status, stdout, stderr) = run_example_to_exit("client", &[("SERVER", &url)]);
    assert!(
        status.success(),
        "exit {status:?}; stdout:\n{stdout}\nstderr:\n{stderr}"
    );

    let line = |prefix: &str| line_starting(&stdout, prefix);
    let lost = line("attempt 1: POST /v1/charges");
    assert!(
        lost.ends_with("the server answered 201 Created, the link lost it"),
        "{lost}"
    );
    let replayed = line("attempt 2: POST /v1/charges");
    assert!(
        replayed.ends_with("201 Created (idempotent-replayed: true)"),
        "{replayed}"
    );
    assert_eq!(key_of(&lost), key_of(&replayed), "one key on both attempts");
    assert!(
        !stdout.contains("attempt 3"),
        "two attempts only:\n{stdout}"
    );
    let done = line("charge ");
    assert!(
        done.ends_with(", after 2 attempts, replayed: true"),
        "{done}"
    );
    let id = charge_id(&done);

    // The server applied the charge once.
    assert_charges(server.addr, &[id]);
    wait_for_balance(server.addr, r#"{"amount":2500,"currency":"eur"}"#);

    server.stop();
}

/// The client (`src/bin/client.rs`) through a proxy that cuts answers off after their head (a
/// reset, or a body that ends short): the layer's retries end at the head, so the example sends
/// the charge again with the same key until an answer arrives whole, and the server makes each
/// charge once.
#[cfg(unix)]
#[test]
fn the_client_example_sends_the_charge_again_when_its_answer_is_cut_off() {
    use Cut::{Pass, Reset, Truncate};
    let server = Server::start(&[]);
    // A connection per attempt until one passes: a cut connection is closed. The first carries
    // the attempt the example's own link loses, which the layer retries; each later cut is one
    // more send of the charge.
    let scripts: [&'static [Cut]; 3] = [
        &[Reset, Reset],
        &[Truncate, Truncate],
        &[Truncate, Reset, Truncate, Reset],
    ];
    let mut ids = Vec::new();
    for script in scripts {
        let proxy = CutProxy::start(server.addr, |n| script.get(n).copied().unwrap_or(Pass));
        let (status, stdout, stderr) = run_example_to_exit("client", &[("SERVER", &proxy.url())]);
        assert!(
            status.success(),
            "{script:?}: exit {status:?}; stdout:\n{stdout}\nstderr:\n{stderr}"
        );
        assert_eq!(proxy.cuts(), script.len(), "{script:?}:\n{stdout}");

        let attempts: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("attempt "))
            .collect();
        assert_eq!(attempts.len(), script.len() + 1, "{script:?}:\n{stdout}");
        let key = key_of(attempts[0]);
        let sent_again: Vec<&str> = stdout
            .lines()
            .filter(|l| l.starts_with("the answer was cut off"))
            .collect();
        assert_eq!(sent_again.len(), script.len() - 1, "{script:?}:\n{stdout}");
        for line in attempts.iter().chain(&sent_again) {
            assert_eq!(key_of(line), key, "one key on every send: {line}");
        }
        let last = attempts.last().expect("attempts");
        assert!(
            last.ends_with("201 Created (idempotent-replayed: true)"),
            "{script:?}: {last}"
        );
        let done = line_starting(&stdout, "charge ");
        let count = script.len() + 1;
        assert!(
            done.ends_with(&format!(", after {count} attempts, replayed: true")),
            "{script:?}: {done}"
        );
        ids.push(charge_id(&done).to_owned());
    }

    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    assert_charges(server.addr, &ids);
    wait_for_balance(server.addr, r#"{"amount":7500,"currency":"eur"}"#);
    server.stop();
}

/// Every answer cut off after its head: the example gives up at its deadline with an error that
/// names the charge's key. The charge was made once, and the same request sent again by hand
/// with that key gets its replay.
#[cfg(unix)]
#[test]
fn the_client_example_names_the_key_when_every_answer_is_cut_off() {
    let server = Server::start(&[]);
    let proxy = CutProxy::start(server.addr, |n| {
        if n % 2 == 0 {
            Cut::Reset
        } else {
            Cut::Truncate
        }
    });
    let url = proxy.url();
    let env = [("SERVER", url.as_str()), ("DEADLINE_MS", "3000")];
    let (status, stdout, stderr) = run_example_to_exit("client", &env);

    assert!(!status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let key = key_of(&line_starting(&stdout, "attempt 1: "));
    assert!(proxy.cuts() >= 3, "the charge was sent again:\n{stdout}");
    assert!(!stdout.contains("\ncharge "), "{stdout}");
    let error = stderr.lines().last().unwrap_or_default();
    assert!(
        error.contains(&format!("charge with key {key} failed")),
        "the error names the key {key}: {stderr}"
    );

    // By hand, as an operator would: the same request with the key is the charge's replay.
    let auth = format!("Bearer {API_KEY}");
    let again = request(
        server.addr,
        "POST",
        "/v1/charges",
        &[
            ("Authorization", &auth),
            ("Idempotency-Key", &key),
            ("Content-Type", "application/x-www-form-urlencoded"),
        ],
        "amount=2500&currency=eur&source=tok_visa",
    );
    assert_eq!(again.status, 201, "{again:?}");
    assert!(
        again.head.contains("idempotent-replayed: true"),
        "{again:?}"
    );
    let json: serde_json::Value = serde_json::from_str(&again.body).expect("a charge");
    assert_charges(server.addr, &[json["id"].as_str().expect("an id")]);
    server.stop();
}

// ---------------------------------------------------------------------------------------------
// The charges' state machine, one table of transitions.

mod state_machine {
    use Event as E;
    use Status as S;
    use example_payments::state_machine::{Event, STATUSES, Status, TRANSITIONS, next};

    const EVENTS: [Event; 11] = [
        E::Authorize,
        E::Approved,
        E::Declined,
        E::Capture,
        E::Captured,
        E::Refund,
        E::PartiallyRefunded,
        E::Refunded,
        E::Cancel,
        E::Canceled,
        E::ProviderDidNothing,
    ];

    #[test]
    fn every_listed_transition_is_allowed() {
        let expected = [
            (S::Created, E::Authorize, S::Authorizing),
            (S::Authorizing, E::Approved, S::Authorized),
            (S::Authorizing, E::Declined, S::Failed),
            (S::Authorizing, E::ProviderDidNothing, S::Created),
            (S::Authorized, E::Capture, S::Capturing),
            (S::Capturing, E::Captured, S::Captured),
            (S::Capturing, E::ProviderDidNothing, S::Authorized),
            (S::Authorized, E::Cancel, S::Canceling),
            (S::Canceling, E::Canceled, S::Canceled),
            (S::Canceling, E::ProviderDidNothing, S::Authorized),
            (S::Captured, E::Refund, S::Refunding),
            (S::Refunding, E::PartiallyRefunded, S::Captured),
            (S::Refunding, E::Refunded, S::Refunded),
            (S::Refunding, E::ProviderDidNothing, S::Captured),
        ];
        for (from, event, to) in expected {
            assert_eq!(next(from, event), Some(to), "{from:?} --{event:?}-->");
        }
        assert_eq!(
            TRANSITIONS.len(),
            expected.len(),
            "the table has unlisted rows"
        );
    }

    #[test]
    fn the_table_is_a_function() {
        for (i, (from, event, _)) in TRANSITIONS.iter().enumerate() {
            for (other_from, other_event, _) in &TRANSITIONS[i + 1..] {
                assert!(
                    (from, event) != (other_from, other_event),
                    "{from:?} --{event:?}--> is listed twice"
                );
            }
        }
    }

    #[test]
    fn disallowed_transitions_are_refused() {
        let refused = [
            (S::Created, E::Capture),
            (S::Created, E::Refund),
            (S::Authorizing, E::Capture),
            (S::Authorized, E::Refund),
            (S::Authorized, E::Authorize),
            (S::Capturing, E::Capture),
            (S::Capturing, E::Cancel),
            (S::Captured, E::Capture),
            (S::Captured, E::Cancel),
            (S::Refunding, E::Refund),
            (S::Refunded, E::Refund),
            (S::Refunded, E::Capture),
            (S::Canceling, E::Cancel),
            (S::Canceled, E::Capture),
            (S::Canceled, E::Cancel),
            (S::Failed, E::Capture),
            (S::Failed, E::Authorize),
        ];
        for (from, event) in refused {
            assert_eq!(
                next(from, event),
                None,
                "{from:?} --{event:?}--> must be refused"
            );
        }
    }

    #[test]
    fn every_status_reads_back() {
        for status in STATUSES {
            assert_eq!(Status::parse(status.as_str()), Some(status));
        }
        assert_eq!(Status::parse("paid"), None);
    }

    #[test]
    fn final_states_have_no_way_out() {
        for status in [S::Refunded, S::Canceled, S::Failed] {
            for event in EVENTS {
                assert_eq!(next(status, event), None, "{status:?} --{event:?}-->");
            }
        }
    }

    #[test]
    fn every_state_is_reachable_from_created() {
        let mut reached = vec![S::Created];
        let mut i = 0;
        while let Some(&status) = reached.get(i) {
            for event in EVENTS {
                if let Some(to) = next(status, event).filter(|to| !reached.contains(to)) {
                    reached.push(to);
                }
            }
            i += 1;
        }
        for status in STATUSES {
            assert!(reached.contains(&status), "{status:?} is unreachable");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parameters as Stripe's SDKs send them.

mod params {
    use axum::http::HeaderMap;
    use axum::http::header::CONTENT_TYPE;
    use example_payments::params::{Form, is_form};

    #[test]
    fn a_stripe_python_body_parses() {
        let body = b"amount=2000&currency=usd&source=tok_visa&capture=false\
                     &description=a+red+bicycle&metadata[order_id]=6735&metadata%5Bnote%5D=caf%C3%A9";
        let mut form = Form::parse(body);
        assert_eq!(form.integer("amount").unwrap(), Some(2000));
        assert_eq!(form.text("currency").as_deref(), Some("usd"));
        assert_eq!(form.text("source").as_deref(), Some("tok_visa"));
        assert_eq!(form.boolean("capture").unwrap(), Some(false));
        assert_eq!(form.text("description").as_deref(), Some("a red bicycle"));
        let metadata = form.metadata().unwrap();
        assert_eq!(metadata["order_id"], "6735");
        assert_eq!(metadata["note"], "café");
        form.finish().unwrap();
    }

    #[test]
    fn unknown_and_invalid_parameters_are_refused() {
        let mut form = Form::parse(b"amount=ten&customer=cus_1");
        assert!(form.integer("amount").is_err());
        assert!(form.finish().is_err());
        let mut form = Form::parse(b"capture=yes");
        assert!(form.boolean("capture").is_err());
    }

    #[test]
    fn the_content_type_chooses_the_encoding() {
        let mut headers = HeaderMap::new();
        assert!(!is_form(&headers));
        headers.insert(
            CONTENT_TYPE,
            "application/x-www-form-urlencoded; charset=utf-8"
                .parse()
                .unwrap(),
        );
        assert!(is_form(&headers));
        headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
        assert!(!is_form(&headers));
    }
}
