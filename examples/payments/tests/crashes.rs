//! The package's binaries as users run them, each test on servers of its own: start-up and
//! SIGTERM with a charge in flight, start-up errors that name their variable, two instances and a
//! provider process on one PostgreSQL, a restart, the memory ledger's guard on a shared Redis,
//! records in Redis beside a PostgreSQL ledger, and the client through answers cut off.

#![cfg(unix)]

mod support;

use std::net::TcpStream;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::Connection;
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_server::RedisServer;

use support::PATIENCE;
use support::cut_proxy::{Cut, CutProxy};
use support::process::{
    Answer, Server, assert_charges, assert_replay_in_redis, charge_id, create_charge, get, key_of,
    line_starting, post_form, request, run_example_to_exit, run_to_exit, the_one_error_line,
    wait_for_balance,
};

#[test]
fn start_up_prints_the_address_and_sigterm_exits_0() {
    let provider = Server::start_example("provider", &[]);
    assert_eq!(
        provider.banner,
        format!("provider listening on {}", provider.url())
    );
    let server = Server::start(&[("PROVIDER_URL", &provider.url())]);
    assert_eq!(
        server.banner,
        format!("listening on {} (store: memory)", server.url())
    );
    assert_ne!(server.addr.port(), 0);

    let list = get(server.addr, "/v1/charges");
    assert_eq!(list.status, 200, "{list:?}");
    let anonymous = request(server.addr, "GET", "/v1/charges", &[], "");
    assert_eq!(anonymous.status, 401, "{anonymous:?}");
    let charge = create_charge(server.addr, "started-1");
    assert_eq!(charge.status, 201, "{charge:?}");

    server.stop();
    provider.stop();
}

/// The provider's program, taking `latency_ms` per call, behind a proxy that reports each
/// connection made to it: a charge has reached the provider when one arrives.
fn provider_behind_a_tap(latency_ms: &str) -> (Server, CutProxy, mpsc::Receiver<usize>) {
    let provider = Server::start_example("provider", &[("PSP_LATENCY_MS", latency_ms)]);
    let (reached, calls) = mpsc::channel();
    let tap = CutProxy::start(provider.addr, move |n| {
        let _ = reached.send(n);
        Cut::Pass
    });
    (provider, tap, calls)
}

#[test]
fn sigterm_lets_an_in_flight_charge_finish() {
    let (provider, tap, reached) = provider_behind_a_tap("1000");
    let server = Server::start(&[("PROVIDER_URL", &tap.url())]);
    let addr = server.addr;
    let in_flight = thread::spawn(move || (create_charge(addr, "slow-1"), Instant::now()));
    reached
        .recv_timeout(PATIENCE)
        .expect("the charge reaches the provider");
    server.terminate();
    let terminated = Instant::now();

    let (answer, answered) = in_flight.join().expect("the request's thread");
    assert_eq!(answer.status, 201, "{answer:?}");
    assert_eq!(answer.json()["status"], "captured", "{answer:?}");
    assert!(answered > terminated, "answered after SIGTERM");
    let (status, stderr) = server.wait();
    assert!(status.success(), "exit {status:?}; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(TcpStream::connect(addr).is_err(), "the port is closed");
    provider.stop();
}

/// A charge, and its duplicate sent while the first is at the (slow) provider, on a server
/// started with `env`: their answers.
fn a_duplicate_while_running(env: &[(&str, &str)]) -> (Answer, Answer) {
    let (provider, tap, reached) = provider_behind_a_tap("1000");
    let mut env = env.to_vec();
    let url = tap.url();
    env.push(("PROVIDER_URL", &url));
    let server = Server::start(&env);
    let addr = server.addr;
    let first = thread::spawn(move || (create_charge(addr, "waited-1"), Instant::now()));
    reached
        .recv_timeout(PATIENCE)
        .expect("the charge reaches the provider");
    let sent = Instant::now();
    let duplicate = create_charge(addr, "waited-1");
    let (first, answered) = first.join().expect("the first request's thread");
    assert!(
        sent < answered,
        "the duplicate was sent while the first ran"
    );
    server.stop();
    provider.stop();
    (first, duplicate)
}

#[test]
fn idempotency_wait_ms_turns_a_409_into_the_replay() {
    let (first, duplicate) = a_duplicate_while_running(&[]);
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(duplicate.status, 409, "{duplicate:?}");

    let (first, duplicate) = a_duplicate_while_running(&[("IDEMPOTENCY_WAIT_MS", "5000")]);
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!((duplicate.status, &duplicate.body), (201, &first.body));
    assert!(duplicate.replayed(), "{duplicate:?}");
}

/// Each wrong setting stops start-up fast, before it listens, with one line that names it.
#[test]
fn start_up_errors_are_one_line_that_names_the_variable() {
    let cases: [(&[(&str, &str)], &str); 6] = [
        (&[("REDIS_URL", "notaurl")], "bad REDIS_URL"),
        (
            &[("REDIS_URL", "redis://127.0.0.1:1")],
            "cannot use Redis at REDIS_URL",
        ),
        (
            &[
                ("REDIS_URL", "redis://127.0.0.1:1"),
                ("REDIS_CLUSTER_URLS", "redis://127.0.0.1:2"),
            ],
            "set REDIS_URL or REDIS_CLUSTER_URLS, not both",
        ),
        (
            &[("DATABASE_URL", "postgres://postgres@127.0.0.1:1/payments")],
            "cannot use PostgreSQL at DATABASE_URL",
        ),
        (&[("PROVIDER_URL", "not a url")], "is not a URL"),
        // The scheme left out, as one writes an address.
        (
            &[("PROVIDER_URL", "127.0.0.1:12111")],
            "PROVIDER_URL 127.0.0.1:12111 must be an http:// URL with a host",
        ),
    ];
    for (env, expected) in cases {
        let started = Instant::now();
        let (status, stdout, stderr) = run_to_exit(env);
        let line = the_one_error_line(status, &stdout, &stderr);
        assert!(line.contains(expected), "{env:?}: {line}");
        let (variable, _) = env[0];
        assert!(line.contains(variable), "{env:?} names {variable}: {line}");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(10), "{env:?}: {took:?}");
    }
}

/// The README's walk-through: a provider process and two instances on one PostgreSQL. A charge
/// made on one replays on the other and is captured and refunded there; a second full refund,
/// sent to the first, is refused; the provider holds one payment, and both show one balance.
#[test]
fn two_instances_and_a_provider_process_share_one_postgres() {
    let database = PostgresServer::start();
    let provider = Server::start_example("provider", &[]);
    let (url, provider_url) = (database.url(), provider.url());
    let env = [
        ("DATABASE_URL", url.as_str()),
        ("PROVIDER_URL", &provider_url),
    ];
    let (a, b) = (Server::start(&env), Server::start(&env));
    assert!(a.banner.ends_with("(store: postgres)"), "{}", a.banner);

    let charge = "amount=2500&currency=eur&source=tok_visa&capture=false";
    let created = post_form(a.addr, "/v1/charges", "order-1", charge);
    assert_eq!(created.status, 201, "{created:?}");
    assert!(!created.replayed(), "{created:?}");
    assert_eq!(created.json()["status"], "authorized", "{created:?}");
    let replay = post_form(b.addr, "/v1/charges", "order-1", charge);
    assert_eq!((replay.status, &replay.body), (201, &created.body));
    assert!(replay.replayed(), "{replay:?}");

    let id = created.json()["id"].as_str().expect("an id").to_owned();
    let captured = post_form(
        b.addr,
        &format!("/v1/charges/{id}/capture"),
        "capture-1",
        "",
    );
    assert_eq!(captured.json()["status"], "captured", "{captured:?}");
    for server in [&a, &b] {
        wait_for_balance(server.addr, r#"{"amount":2500,"currency":"eur"}"#);
    }
    let refunds = format!("/v1/charges/{id}/refunds");
    let refund = post_form(b.addr, &refunds, "refund-1", "");
    assert_eq!(refund.status, 201, "{refund:?}");
    assert_eq!(refund.json()["amount"], 2500, "{refund:?}");
    let again = post_form(a.addr, &refunds, "refund-2", "");
    assert_eq!(again.status, 400, "{again:?}");
    assert_eq!(again.json()["error"]["code"], "invalid_state", "{again:?}");

    let shown = get(a.addr, &format!("/v1/charges/{id}")).json();
    let refunded = (&shown["status"], &shown["amount_refunded"]);
    assert_eq!(refunded, (&json!("refunded"), &json!(2500)), "{shown}");
    let payments = request(
        provider.addr,
        "GET",
        "/v1/payments?created_gte=0&limit=10",
        &[],
        "",
    );
    let payments = payments.json()["data"].clone();
    assert_eq!(payments.as_array().map(Vec::len), Some(1), "{payments}");
    assert_eq!(
        (&payments[0]["amount"], &payments[0]["refunded"]),
        (&json!(2500), &json!(2500))
    );
    for server in [&a, &b] {
        assert_charges(server.addr, &[&id]);
        wait_for_balance(server.addr, r#"{"amount":0,"currency":"eur"}"#);
    }
    a.stop();
    b.stop();
    provider.stop();
}

/// `DATABASE_URL=... cargo run -p example-payments`: the schema is created at start-up, and a
/// restarted server replays and lists what the first one did.
#[test]
fn a_restart_on_postgres_keeps_and_replays_the_charges() {
    let database = PostgresServer::start();
    let url = database.url();
    let env = [("DATABASE_URL", url.as_str())];
    let charge = "amount=1500&currency=eur&source=tok_visa";

    let first = Server::start(&env);
    assert!(
        first.banner.ends_with("(store: postgres)"),
        "{}",
        first.banner
    );
    let created = post_form(first.addr, "/v1/charges", "order-9", charge);
    assert_eq!(created.status, 201, "{created:?}");
    assert!(!created.replayed(), "{created:?}");
    first.stop();

    let second = Server::start(&env);
    let retry = post_form(second.addr, "/v1/charges", "order-9", charge);
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, created.body, "byte for byte");
    assert_charges(
        second.addr,
        &[created.json()["id"].as_str().expect("an id")],
    );
    wait_for_balance(second.addr, r#"{"amount":1500,"currency":"eur"}"#);
    second.stop();
}

/// Two instances whose money is in memory beside one Redis would each move the same money: the
/// second refuses to start and says what to do, and once the first has stopped another starts.
#[test]
fn a_second_memory_ledger_on_one_redis_refuses_to_start() {
    let redis = RedisServer::start();
    let url = redis.url();
    let env = [("REDIS_URL", url.as_str())];
    let first = Server::start(&env);
    assert!(
        first.banner.ends_with("(store: memory, records in redis)"),
        "{}",
        first.banner
    );

    let (status, stdout, stderr) = run_to_exit(&env);
    let line = the_one_error_line(status, &stdout, &stderr);
    assert!(
        line.contains("another instance keeps its charges in memory"),
        "{line}"
    );
    assert!(line.contains("Set DATABASE_URL"), "{line}");

    let charge = create_charge(first.addr, "guarded-1");
    assert_eq!(charge.status, 201, "the first runs on: {charge:?}");
    first.stop();
    let next = Server::start(&env);
    assert_eq!(create_charge(next.addr, "guarded-2").status, 201);
    next.stop();
}

/// The number `sql` counts in the database at `url`.
fn count(url: &str, sql: &str) -> i64 {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut db = sqlx::PgConnection::connect(url).await.expect("postgres");
        sqlx::query_scalar(sql).fetch_one(&mut db).await.expect(sql)
    })
}

/// `REDIS_URL` beside `DATABASE_URL`: the records in Redis, the charge in PostgreSQL; and no
/// guard, since the money is shared: a second instance replays the first's charge.
#[test]
fn records_in_redis_beside_a_postgres_ledger() {
    let (database, redis) = (PostgresServer::start(), RedisServer::start());
    let (url, redis_url) = (database.url(), redis.url());
    let env = [("DATABASE_URL", url.as_str()), ("REDIS_URL", &redis_url)];
    let a = Server::start(&env);
    assert!(
        a.banner.ends_with("(store: postgres, records in redis)"),
        "{}",
        a.banner
    );
    let first = create_charge(a.addr, "redis-1");
    let b = Server::start(&env);
    let retry = create_charge(b.addr, "redis-1");
    assert_replay_in_redis(&first, &retry, &redis);
    assert_eq!(count(&url, "SELECT count(*) FROM charges"), 1);
    wait_for_balance(b.addr, r#"{"amount":1000,"currency":"eur"}"#);
    // One row in PostgreSQL's records table: the consumer's mark of the charge's event, which
    // commits with the balance. The request's record is not there.
    assert_eq!(count(&url, "SELECT count(*) FROM idempotency_records"), 1);
    a.stop();
    b.stop();
}

/// The client (`src/bin/client.rs`) through a link that loses its first answer and a proxy that
/// cuts the next off (a reset, then a body that ends short): the layer retries the first, the
/// client sends the charge again with the same key after the second, and the server makes it once.
#[test]
fn the_client_example_pays_once_through_a_flaky_link() {
    let server = Server::start(&[]);
    let script = [Cut::Reset, Cut::Truncate];
    let proxy = CutProxy::start(server.addr, move |n| {
        script.get(n).copied().unwrap_or(Cut::Pass)
    });
    let (status, stdout, stderr) = run_example_to_exit("client", &[("SERVER", &proxy.url())]);
    assert!(
        status.success(),
        "exit {status:?}; stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(proxy.cuts(), 2, "{stdout}");

    let lost = line_starting(&stdout, "attempt 1: POST /v1/charges");
    assert!(
        lost.ends_with("the server answered 201 Created, the link lost it"),
        "{lost}"
    );
    let cut = line_starting(&stdout, "the answer was cut off");
    let last = line_starting(&stdout, "attempt 3: POST /v1/charges");
    assert!(
        last.ends_with("201 Created (idempotent-replayed: true)"),
        "{last}"
    );
    for line in [&cut, &last] {
        assert_eq!(key_of(line), key_of(&lost), "one key on every send: {line}");
    }
    assert!(!stdout.contains("attempt 4"), "{stdout}");
    let done = line_starting(&stdout, "charge ");
    assert!(
        done.ends_with(", after 3 attempts, replayed: true"),
        "{done}"
    );

    assert_charges(server.addr, &[charge_id(&done)]);
    wait_for_balance(server.addr, r#"{"amount":2500,"currency":"eur"}"#);
    server.stop();
}

/// Every answer cut off after its head: the client gives up at its deadline with an error that
/// names the charge's key. The charge was made once, and the same request sent again by hand
/// with that key gets its replay.
#[test]
fn the_client_example_names_the_key_when_every_answer_is_cut_off() {
    let server = Server::start(&[]);
    let proxy = CutProxy::start(server.addr, |n| [Cut::Reset, Cut::Truncate][n % 2]);
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
    let again = post_form(
        server.addr,
        "/v1/charges",
        &key,
        "amount=2500&currency=eur&source=tok_visa",
    );
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed(), "{again:?}");
    assert_charges(server.addr, &[again.json()["id"].as_str().expect("an id")]);
    server.stop();
}
