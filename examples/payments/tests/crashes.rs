//! Crashes, restarts, shutdowns and failovers: the server as users run it (SIGTERM with
//! requests in flight, start-up that fails clearly, a restart on PostgreSQL that replays and lists
//! its charges), instances on one database, and a Redis Cluster whose master freezes.

#![cfg(unix)]

mod support;

use std::net::TcpStream;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use serde_json::{Value, json};
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tokio_util::sync::CancellationToken;
use tower_idempotency::{BoxStore, IdempotencyLayer, Outcome, RecordId};
use tower_idempotency_redis::RedisStore;

use example_payments::app;
use example_payments::balance::BALANCES_PREFIX;
use example_payments::config::STREAM;
use example_payments::consumer;
use example_payments::ledger::LEDGER_PREFIX;
use example_payments::pg;
use example_payments::provider::WINDOW;
use example_payments::provider::keys::PROVIDER_PREFIX;
use example_payments::queue::ConsumerConfig;
use support::api::{ALICE, Call, Reply, account, authorize, create_charge as create, visa};
use support::instance::{AUTHORIZING, Instance, NEVER, admin, count, provider_payments};
use support::process::{
    API_KEY, Server, assert_replay_in_redis, create_charge, redis_contents, request, run_to_exit,
    the_one_error_line, wait_for_balance,
};
use support::stack::Parts;

#[test]
fn start_up_prints_the_address_and_sigterm_exits_0() {
    let server = Server::start(&[]);
    assert_eq!(
        server.banner,
        format!("listening on http://{} (store: memory)", server.addr)
    );
    assert_ne!(server.addr.port(), 0);

    let list = request(
        server.addr,
        "GET",
        "/v1/charges",
        &[("Authorization", "Bearer sk_test_alice")],
        "",
    );
    assert_eq!(list.status, 200, "{list:?}");
    let anonymous = request(server.addr, "GET", "/v1/charges", &[], "");
    assert_eq!(anonymous.status, 401, "{anonymous:?}");

    server.stop();
}

#[test]
fn sigterm_lets_an_in_flight_charge_finish() {
    let server = Server::start(&[
        ("PSP_LATENCY_MS", "500"),
        ("RUST_LOG", "info,example_payments=debug"),
    ]);
    let addr = server.addr;
    let started = Instant::now();
    let in_flight = thread::spawn(move || create_charge(addr, "slow-1"));
    // Once the request is at the (slow) provider, ask the server to stop.
    server.wait_for_log("provider: create payment");
    server.terminate();

    let answer = in_flight.join().expect("the request thread");
    assert_eq!(answer.status, 201, "{answer:?}");
    assert!(
        answer.body.contains("\"status\":\"captured\""),
        "{answer:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "the provider's latency was not simulated"
    );
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(TcpStream::connect(addr).is_err(), "the port is closed");
}

/// With `IDEMPOTENCY_WAIT_MS`, a duplicate of a charge still at the (slow) provider waits for it
/// and gets its replay, not a `409`.
#[test]
fn idempotency_wait_ms_turns_a_409_into_the_replay() {
    let server = Server::start(&[
        ("PSP_LATENCY_MS", "800"),
        ("IDEMPOTENCY_WAIT_MS", "5000"),
        ("RUST_LOG", "info,example_payments=debug"),
    ]);
    let addr = server.addr;
    let first = thread::spawn(move || create_charge(addr, "waited-1"));
    server.wait_for_log("provider: create payment");
    let duplicate = create_charge(addr, "waited-1");
    let first = first.join().expect("the first request's thread");
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!((duplicate.status, &duplicate.body), (201, &first.body));
    assert!(
        duplicate.head.contains("idempotent-replayed: true"),
        "{duplicate:?}"
    );
    server.stop();
}

#[test]
fn a_bad_redis_url_fails_clearly() {
    let (status, stdout, stderr) = run_to_exit(&[("REDIS_URL", "notaurl")]);
    let line = the_one_error_line(status, &stdout, &stderr);
    assert!(line.contains("bad REDIS_URL"), "{line}");
    assert!(!line.contains("LEDGER_REDIS_URL"), "{line}");
}

#[test]
fn an_unreachable_redis_fails_clearly() {
    let started = Instant::now();
    let (status, stdout, stderr) = run_to_exit(&[("REDIS_URL", "redis://127.0.0.1:1")]);
    let line = the_one_error_line(status, &stdout, &stderr);
    // It names the variable that was set: the ledger's Redis defaults to REDIS_URL's.
    assert!(line.contains("cannot use Redis at REDIS_URL"), "{line}");
    assert!(!line.contains("LEDGER_REDIS_URL"), "{line}");
    assert!(started.elapsed() < Duration::from_secs(10), "it fails fast");
}

#[test]
fn an_unreachable_ledger_redis_names_ledger_redis_url() {
    let redis = RedisServer::start();
    let (status, stdout, stderr) = run_to_exit(&[
        ("REDIS_URL", &redis.url()),
        ("LEDGER_REDIS_URL", "redis://127.0.0.1:1"),
    ]);
    let line = the_one_error_line(status, &stdout, &stderr);
    assert!(
        line.contains("cannot use Redis at LEDGER_REDIS_URL"),
        "{line}"
    );
}

/// Both `REDIS_URL` and `REDIS_CLUSTER_URLS`: which one is meant is unclear, so the example
/// refuses to start and says why.
#[test]
fn redis_url_and_cluster_urls_together_are_refused() {
    let (status, stdout, stderr) = run_to_exit(&[
        ("REDIS_URL", "redis://127.0.0.1:1"),
        ("REDIS_CLUSTER_URLS", "redis://127.0.0.1:2"),
    ]);
    assert!(!status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("set REDIS_URL or REDIS_CLUSTER_URLS, not both"),
        "{stderr}"
    );
}

#[test]
fn redis_end_to_end() {
    let redis = RedisServer::start();
    let url = redis.url();
    let server = Server::start(&[("REDIS_URL", &url)]);
    assert!(
        server.banner.ends_with("(store: redis)"),
        "{}",
        server.banner
    );

    let first = create_charge(server.addr, "redis-1");
    assert!(!first.head.contains("idempotent-replayed"), "{first:?}");
    let retry = create_charge(server.addr, "redis-1");
    assert_replay_in_redis(&first, &retry, &redis);
    wait_for_balance(server.addr, r#"{"amount":1000,"currency":"eur"}"#);

    // Every key and record is there now: the layer's, the provider's, the event stream, the
    // consumer's and the balances. None holds the credential, in its name or in its contents.
    let contents = redis_contents(&redis);
    assert!(contents.len() >= 5, "the records of a charge: {contents:?}");
    for (key, stored) in &contents {
        assert!(!key.contains(API_KEY), "{key}");
        assert!(!stored.contains(API_KEY), "{key} holds {stored}");
    }
    assert!(
        contents
            .iter()
            .any(|(key, _)| key.starts_with("payments:balance:{acct_")),
        "balances under the account's id: {contents:?}"
    );
    // Only the durable ledger data lives without a TTL: the event stream, the balances, the
    // charges (with their lists and indexes) and the provider's payments.
    for key in redis.keys_without_ttl() {
        let charges = key.starts_with("payments:{ledger}:") && !key.contains(":op:");
        assert!(
            key == "payments:{events}"
                || key.starts_with("payments:balance:") && key.ends_with(":available")
                || charges
                || key.starts_with("payments:{provider}:payment"),
            "{key} has no TTL"
        );
    }

    server.stop();
}

/// The payments example on a Redis Cluster (`REDIS_CLUSTER_URLS`): a charge runs once and
/// replays, its event goes through the stream and its consumer to the balance, and the records,
/// the stream and the balances spread over the masters.
#[test]
fn redis_cluster_end_to_end() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls().join(",");
    let server = Server::start(&[("REDIS_CLUSTER_URLS", &urls)]);
    assert!(
        server.banner.ends_with("(store: redis cluster)"),
        "{}",
        server.banner
    );

    let first = create_charge(server.addr, "cluster-1");
    let retry = create_charge(server.addr, "cluster-1");
    assert_eq!(
        (first.status, retry.status),
        (201, 201),
        "{first:?} {retry:?}"
    );
    assert!(
        retry.head.contains("idempotent-replayed: true"),
        "{retry:?}"
    );
    assert_eq!(retry.body, first.body);
    wait_for_balance(server.addr, r#"{"amount":1000,"currency":"eur"}"#);
    let second = create_charge(server.addr, "cluster-2");
    assert_ne!(second.body, first.body, "another key, another charge");
    wait_for_balance(server.addr, r#"{"amount":2000,"currency":"eur"}"#);

    let keys = cluster.keys();
    let records: Vec<&String> = keys
        .iter()
        .filter(|k| k.starts_with("idempotency:"))
        .collect();
    assert_eq!(records.len(), 2, "one record per key: {keys:?}");
    assert!(keys.iter().any(|k| k == "payments:{events}"), "{keys:?}");

    server.stop();
}

/// `DATABASE_URL=... cargo run -p example-payments`: the schema is created at start-up, and a
/// restarted server replays and lists what the first one did.
#[test]
fn the_server_keeps_its_charges_in_postgres_across_a_restart() {
    let database = PostgresServer::start();
    let url = database.url();
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("SHUTDOWN_TIMEOUT_MS", "2000"),
    ];
    let charge = r#"{"amount": 1500, "currency": "eur", "source": "tok_visa"}"#;
    let auth = format!("Bearer {API_KEY}");
    let create = |addr| {
        let headers = [
            ("Authorization", auth.as_str()),
            ("Idempotency-Key", "order-9"),
        ];
        request(addr, "POST", "/v1/charges", &headers, charge)
    };

    let first = Server::start(&env);
    assert!(
        first.banner.ends_with("(store: postgres)"),
        "{}",
        first.banner
    );
    let created = create(first.addr);
    assert_eq!(created.status, 201, "{created:?}");
    assert!(!created.head.contains("idempotent-replayed"), "{created:?}");
    first.terminate();
    let (status, stderr) = first.wait();
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let second = Server::start(&env);
    let retry = create(second.addr);
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(
        retry.head.contains("idempotent-replayed: true"),
        "{retry:?}"
    );
    assert_eq!(retry.body, created.body, "byte for byte");
    let list = request(
        second.addr,
        "GET",
        "/v1/charges",
        &[("Authorization", &auth)],
        "",
    );
    assert_eq!(list.status, 200);
    let list: Value = serde_json::from_str(&list.body).expect("JSON");
    let created: Value = serde_json::from_str(&created.body).expect("JSON");
    assert_eq!(list["data"][0]["id"], created["id"], "{list}");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(1));
    wait_for_balance(second.addr, r#"{"amount":1500,"currency":"eur"}"#);
    second.terminate();
    let (status, stderr) = second.wait();
    assert!(status.success(), "{status:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// An unreachable `DATABASE_URL`: one line that names it, a non-zero exit, before listening.
#[test]
fn an_unreachable_database_url_exits_naming_it() {
    let url = "postgres://postgres@127.0.0.1:1/payments";
    let (status, stdout, stderr) = run_to_exit(&[("DATABASE_URL", url)]);
    let line = the_one_error_line(status, &stdout, &stderr);
    assert!(
        line.contains("cannot use PostgreSQL at DATABASE_URL"),
        "{line}"
    );
}

/// A restarted server finds its charges: the retry replays the first answer, the list and the
/// balance are still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_replays_and_lists_its_charges() {
    let server = PostgresServer::start();
    let first = Instance::start(&server.url(), NEVER).await;
    let created = first.charge("order-1", &visa(2500)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    assert_eq!(created.json["status"], "captured");
    first.wait_for_balance(2500).await;
    drop(first);

    let second = Instance::start(&server.url(), NEVER).await;
    let retry = second.charge("order-1", &visa(2500)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.text(), created.text(), "byte for byte");
    let id = created.json["id"].as_str().expect("an id").to_owned();
    assert_eq!(second.charges().await, [(id.clone(), "captured".into())]);
    let one = second.get(&format!("/v1/charges/{id}")).await;
    assert_eq!(one.json["amount"], 2500, "{}", one.text());
    second.wait_for_balance(2500).await;
    assert_eq!(
        second.parts.outage.calls(),
        0,
        "the retry never reached the provider"
    );
    assert_eq!(provider_payments(&server).await, 1);
}

/// Two instances on one database: a charge made on one replays on the other; 50 concurrent
/// requests with one key, spread over both, make one charge; a capture on one and its retry on the
/// other capture once; a declined card is recorded and replayed on either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_truth() {
    let server = PostgresServer::start();
    let a = Instance::start(&server.url(), NEVER).await;
    let b = Instance::start(&server.url(), NEVER).await;

    let created = a.charge("first", &visa(1000)).await;
    assert_eq!(created.status, StatusCode::CREATED, "{}", created.text());
    let replay = b.charge("first", &visa(1000)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.text(), created.text());

    let body = visa(700);
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let instance = if i % 2 == 0 { &a } else { &b };
            instance.spawn(instance.charge_call("burst", &body))
        })
        .collect();
    let mut executed = Vec::new();
    for task in tasks {
        let reply = task.await.expect("an answer");
        match reply.outcome {
            Some(Outcome::Executed) => executed.push(reply),
            // Never ran the handler (a 503 when a pool stayed busy past the store's timeout).
            Some(Outcome::InFlight | Outcome::Replayed | Outcome::StoreUnavailable) => {}
            other => panic!("{other:?}: {}", reply.text()),
        }
    }
    assert_eq!(executed.len(), 1, "one request ran the handler");
    assert_eq!(
        executed[0].status,
        StatusCode::CREATED,
        "{}",
        executed[0].text()
    );
    let burst = b.charge("burst", &body).await;
    assert!(burst.replayed());
    assert_eq!(burst.json["id"], executed[0].json["id"]);
    assert_eq!(a.charges().await.len(), 2);
    assert_eq!(provider_payments(&server).await, 2);

    // Authorize on one, capture on the other, retry the capture on the first.
    let authorized = a.charge("authorize", &authorize(300)).await;
    assert_eq!(
        authorized.json["status"],
        "authorized",
        "{}",
        authorized.text()
    );
    let id = authorized.json["id"].as_str().expect("an id");
    let capture = format!("/v1/charges/{id}/capture");
    let captured = b.post_empty(&capture, "capture-1").await;
    assert_eq!(captured.status, StatusCode::OK, "{}", captured.text());
    assert_eq!(captured.json["status"], "captured");
    let again = a.post_empty(&capture, "capture-1").await;
    assert!(again.replayed(), "{again:?}");
    a.wait_for_balance(1000 + 700 + 300).await;

    let declined = json!({ "amount": 50, "currency": "eur", "source": "tok_chargeDeclined" });
    let refused = b.charge("declined", &declined).await;
    assert_eq!(
        refused.status,
        StatusCode::PAYMENT_REQUIRED,
        "{}",
        refused.text()
    );
    let refused_again = a.charge("declined", &declined).await;
    assert!(refused_again.replayed());
    assert_eq!(refused_again.text(), refused.text());
    let charges = b.charges().await;
    assert_eq!(charges.len(), 4, "{charges:?}");
    assert_eq!(charges[0].1, "failed");
    assert_eq!(
        a.parts.keys.effects() + b.parts.keys.effects(),
        5,
        "four payments and one capture"
    );
    assert_eq!(count(&server, AUTHORIZING).await, 0);
}

/// Captures, refunds and cancellations on PostgreSQL: each step's state commits with its record
/// and its event, a provider outage rolls a capture back, and the balance follows. A retry whose
/// record was deleted finds its charge by its key, without calling the provider again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captures_refunds_and_cancellations_on_postgres() {
    let server = PostgresServer::start();
    let h = Instance::start(&server.url(), NEVER).await;
    let id_of = |reply: &Reply| reply.json["id"].as_str().expect("an id").to_owned();

    let first = h.charge("auth-1", &authorize(1000)).await;
    assert_eq!(first.json["status"], "authorized", "{}", first.text());
    let first_id = id_of(&first);
    h.parts.outage.set_down(true);
    let down = h
        .post_empty(&format!("/v1/charges/{first_id}/capture"), "capture-1")
        .await;
    assert_eq!(
        down.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        down.text()
    );
    let after = h.get(&format!("/v1/charges/{first_id}")).await;
    assert_eq!(after.json["status"], "authorized", "rolled back");
    h.parts.outage.set_down(false);
    let captured = h
        .post_empty(&format!("/v1/charges/{first_id}/capture"), "capture-1")
        .await;
    assert_eq!(captured.json["status"], "captured", "{}", captured.text());

    let refunds = format!("/v1/charges/{first_id}/refunds");
    let part = h
        .send(
            Call::post(&h.router, &refunds)
                .auth(ALICE)
                .key("refund-1")
                .raw(r#"{"amount": 300}"#),
        )
        .await;
    assert_eq!(part.status, StatusCode::CREATED, "{}", part.text());
    let charge = h.get(&format!("/v1/charges/{first_id}")).await;
    assert_eq!(
        (&charge.json["status"], &charge.json["amount_refunded"]),
        (&json!("captured"), &json!(300))
    );
    let rest = h.post_empty(&refunds, "refund-2").await;
    assert_eq!(rest.json["amount"], 700, "{}", rest.text());
    let again = h.post_empty(&refunds, "refund-2").await;
    assert!(again.replayed());
    let charge = h.get(&format!("/v1/charges/{first_id}")).await;
    assert_eq!(charge.json["status"], "refunded");

    let second = h.charge("auth-2", &authorize(500)).await;
    let canceled = h
        .post_empty(
            &format!("/v1/charges/{}/cancel", id_of(&second)),
            "cancel-1",
        )
        .await;
    assert_eq!(canceled.json["status"], "canceled", "{}", canceled.text());

    let third = h.charge("visa-3", &visa(2000)).await;
    assert_eq!(third.json["status"], "captured");
    h.wait_for_balance(2000).await;

    // The layer's records gone, the retry finds its charge, and the provider is not called.
    let calls = h.parts.outage.calls();
    let forget =
        "WITH gone AS (DELETE FROM idempotency_records RETURNING 1) SELECT count(*) FROM gone";
    assert!(count(&server, forget).await > 0);
    let retry = h.charge("visa-3", &visa(2000)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(retry.json["id"], third.json["id"]);
    // Another request under that key, the layer's record gone again: the charge's own refusal,
    // in Stripe's form (400 `idempotency_error`, which its SDKs raise as IdempotencyError).
    assert!(count(&server, forget).await > 0);
    let reused = h.charge("visa-3", &visa(2100)).await;
    assert_eq!(reused.status, StatusCode::BAD_REQUEST, "{}", reused.text());
    assert_eq!(reused.json["error"]["code"], "idempotency_key_reused");
    assert_eq!(h.parts.outage.calls(), calls);
    assert_eq!(h.charges().await.len(), 3);
    h.wait_for_balance(2000).await;
    assert_eq!(
        count(&server, "SELECT count(*) FROM payment_events").await,
        0
    );
}

/// A database made before charges held their operation gets the column and the unique index at
/// start-up, each charge holding its own; one that already holds two charges for one operation
/// (as a stalled run taken over could leave) stops start-up with an error that says so, rather
/// than run without the constraint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_database_gets_the_unique_operation_or_a_clear_error() {
    let server = PostgresServer::start();
    drop(pg::connect(&server.url()).await.expect("the database"));
    let mut admin = admin(&server).await;
    let insert = |id: &str, key: &str| {
        format!(
            "INSERT INTO charges (id, account, provider_key, amount, currency, source, capture,
                                  status, created)
             VALUES ('{id}', 'acct_1', '{key}', 100, 'eur', 'tok_visa', true, 'captured', 0)"
        )
    };
    for sql in [
        "ALTER TABLE charges DROP COLUMN operation".to_owned(),
        insert("ch_1", "op-1"),
        insert("ch_2", "op-2"),
    ] {
        sqlx::raw_sql(&sql).execute(&mut admin).await.expect(&sql);
    }
    drop(pg::connect(&server.url()).await.expect("migrated"));
    let held = count(
        &server,
        "SELECT count(*) FROM charges WHERE operation = provider_key",
    )
    .await;
    assert_eq!(held, 2, "each charge holds its operation");

    for sql in [
        "ALTER TABLE charges DROP COLUMN operation".to_owned(),
        insert("ch_3", "op-1"),
    ] {
        sqlx::raw_sql(&sql).execute(&mut admin).await.expect(&sql);
    }
    let err = pg::connect(&server.url())
        .await
        .expect_err("two charges for one operation");
    assert!(err.contains("two charges for one operation"), "{err}");
}

// A Redis Cluster whose master freezes (SIGSTOP: a hung machine or a partition, its connections
// open and silent) until its replica is elected, and stays frozen. Every Redis path of a charge
// follows the failover within 10 s of the promoted replica's `cluster_state:ok`: the idempotency
// record, the ledger, the provider's keys, the event stream, the ledger consumer's blocking reads
// and the balance. The keys the test writes are chosen so that the frozen master holds the
// charge's record and the account's balance besides the hash tag it is frozen for.

/// How long a master may not answer before its replica is elected: short, so that the failover
/// takes about a second.
const NODE_TIMEOUT: Duration = Duration::from_millis(500);

/// How long after the promoted replica's `cluster_state:ok` a charge and its balance may take.
const FOLLOWED_WITHIN: Duration = Duration::from_secs(10);

/// How often a client sends its request again after a `409`, a `503` or a `504`.
const FAILOVER_RETRY_EVERY: Duration = Duration::from_millis(100);

/// The idempotency records' prefix: the store's default.
const RECORDS_PREFIX: &str = "idempotency:";

/// The example on `cluster`, as `REDIS_CLUSTER_URLS` sets it up: the records, the charges, the
/// provider's keys, the events, the balances and the consumer's records in the cluster, and the
/// ledger consumer and the outbox relay running until `stop`.
async fn app_on_cluster(cluster: &RedisCluster, stop: &CancellationToken) -> Router {
    let records = RedisStore::cluster(cluster.urls()).expect("valid URLs");
    records.check().await.expect("the cluster answers");
    let parts = Parts::redis(&records.shared_connection(), WINDOW).await;
    let dedup = records.clone().with_prefix(consumer::RECORDS_PREFIX);
    let config = ConsumerConfig::default()
        .min_idle(Duration::from_millis(500))
        .block(Duration::from_millis(100));
    drop(parts.consume("ledger-failover", dedup, config, stop).await);
    // Events the stream refused wait in the outbox, which the relay sends on.
    let events = parts.events.clone().expect("a publisher");
    tokio::spawn(events.relay(stop.clone()));
    app(parts.state(), IdempotencyLayer::new(BoxStore::new(records)))
}

/// `count` of the names `make(0)`, `make(1)`, ... whose Redis key (`redis_key` of the name) the
/// master `master` holds.
fn on_master(
    cluster: &RedisCluster,
    master: usize,
    count: usize,
    make: impl Fn(usize) -> String,
    redis_key: impl Fn(&str) -> String,
) -> Vec<String> {
    let found: Vec<String> = (0..count * 50)
        .map(make)
        .filter(|name| cluster.master_of_key(&redis_key(name)) == master)
        .take(count)
        .collect();
    assert_eq!(found.len(), count, "names on master {master}");
    found
}

/// The Redis key of the idempotency record of `key`, sent with `api_key`.
fn record_key(api_key: &str, key: &str) -> String {
    let id = RecordId::new(account(api_key).as_bytes(), key);
    format!("{RECORDS_PREFIX}{{{id}}}")
}

/// The Redis key of the euro balance of the account of `api_key`.
fn balance_key(api_key: &str) -> String {
    format!("{}{{{}}}:available", BALANCES_PREFIX, account(api_key))
}

/// The account's euro balance, as `GET /v1/balance` shows it; `None` when it fails.
async fn eur_balance(router: &Router, api_key: &str) -> Option<i64> {
    let reply = Call::get(router, "/v1/balance").auth(api_key).send().await;
    (reply.status == StatusCode::OK).then(|| {
        reply.json["available"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|available| available["currency"] == "eur")
            .filter_map(|available| available["amount"].as_i64())
            .sum()
    })
}

/// Whether a client sends its request again after `reply`.
fn failover_retries_after(reply: &Reply) -> bool {
    matches!(
        reply.status,
        StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT
    )
}

/// Freezes the master that holds `frozen_key`'s slot (and the slots of `with`, which the test
/// checks) until its replica is elected, and leaves it frozen: a new charge, whose record and
/// balance that master held too, is created and credited within [`FOLLOWED_WITHIN`] of the
/// promoted replica's `cluster_state:ok`.
async fn a_frozen_master_is_followed(frozen_key: &str, with: &[&str]) {
    let cluster = Arc::new(RedisCluster::start_with_node_timeout(NODE_TIMEOUT));
    let master = cluster.master_of_key(frozen_key);
    for key in with {
        assert_eq!(
            cluster.master_of_key(key),
            master,
            "{key} and {frozen_key} are on one master with redis-cli's slot layout"
        );
    }
    let replica = cluster.replica_of(master);
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let router = app_on_cluster(&cluster, &stop).await;

    // The account whose balance, and the keys whose records, the frozen master holds.
    let api_key = on_master(
        &cluster,
        master,
        1,
        |n| format!("sk_test_frozen_{n}"),
        balance_key,
    )
    .remove(0);
    let keys = on_master(
        &cluster,
        master,
        2,
        |n| format!("frozen-{n}"),
        |key| record_key(&api_key, key),
    );
    // Charges sent while the master is frozen, on another account: their fate is not asserted.
    let during_key = "sk_test_during_the_freeze";
    let mut during_keys = on_master(
        &cluster,
        master,
        30,
        |n| format!("during-{n}"),
        |key| record_key(during_key, key),
    )
    .into_iter();

    // A charge before the freeze, as a running service has made: connected to every node.
    let before = create(&router, &api_key, &keys[0], &visa(1000))
        .send()
        .await;
    assert_eq!(before.status, StatusCode::CREATED, "{}", before.text());
    assert!(
        cluster.keys().contains(&record_key(&api_key, &keys[0])),
        "the record is where the test looks for it"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while eur_balance(&router, &api_key).await != Some(1000) {
        assert!(
            Instant::now() < deadline,
            "the first charge is never credited"
        );
        tokio::time::sleep(FAILOVER_RETRY_EVERY).await;
    }

    let frozen = cluster.node(master).freeze();
    let frozen_at = Instant::now();
    let promotion = {
        let cluster = cluster.clone();
        tokio::task::spawn_blocking(move || cluster.wait_promoted(replica))
    };
    // Charges meet the frozen master while the cluster elects its replica.
    let mut failed = 0;
    while !promotion.is_finished() {
        let key = during_keys
            .next()
            .expect("a key for a charge during the freeze");
        let reply = create(&router, during_key, &key, &visa(700)).send().await;
        failed += usize::from(reply.status != StatusCode::CREATED);
        tokio::time::sleep(FAILOVER_RETRY_EVERY).await;
    }
    let promoted_at = promotion.await.expect("the promotion");
    eprintln!(
        "replica promoted {:?} after the freeze; {failed} charges failed meanwhile",
        promoted_at - frozen_at
    );
    assert!(failed > 0, "the charges met the frozen master");

    // A client's charge, sent again with its key until it is answered.
    let mut reply = create(&router, &api_key, &keys[1], &visa(2500))
        .send()
        .await;
    while failover_retries_after(&reply) {
        assert!(
            promoted_at.elapsed() < FOLLOWED_WITHIN,
            "charges still fail {:?} after the promotion: {} {}",
            promoted_at.elapsed(),
            reply.status,
            reply.text()
        );
        tokio::time::sleep(FAILOVER_RETRY_EVERY).await;
        reply = create(&router, &api_key, &keys[1], &visa(2500))
            .send()
            .await;
    }
    assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
    let charged = promoted_at.elapsed();
    let mut shown = eur_balance(&router, &api_key).await;
    while shown != Some(3500) {
        assert!(
            promoted_at.elapsed() < FOLLOWED_WITHIN,
            "the balance is {shown:?}, not 3500, {:?} after the promotion",
            promoted_at.elapsed()
        );
        tokio::time::sleep(FAILOVER_RETRY_EVERY).await;
        shown = eur_balance(&router, &api_key).await;
    }
    eprintln!(
        "charged {charged:?} and credited {:?} after the promoted replica's cluster_state:ok",
        promoted_at.elapsed()
    );
    assert!(
        cluster
            .node(master)
            .try_command(&["PING"], Duration::from_millis(300))
            .is_err(),
        "the old master is still frozen"
    );
    drop(frozen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_redis_path_follows_a_frozen_master_of_the_ledger() {
    let ledger = format!("{}seq", LEDGER_PREFIX);
    a_frozen_master_is_followed(&ledger, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_redis_path_follows_a_frozen_master_of_the_provider_and_the_stream() {
    let provider = format!("{}payments", PROVIDER_PREFIX);
    a_frozen_master_is_followed(&provider, &[STREAM]).await;
}
