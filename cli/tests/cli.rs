//! The tool against real servers (a redis-server, a Redis Cluster, a PostgreSQL, each started by
//! `test-servers`): every state of a key as the table and the JSON show it, each exit code, the
//! refusals, the options that say where records live (before or after the command), and a wrong
//! one said as such.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::Value;
use test_servers::postgres_server::PostgresServer;
use test_servers::redis_cluster::RedisCluster;
use test_servers::redis_server::RedisServer;
use tower_idempotency::record::{
    ClaimToken, Completed, Fingerprint, RecordId, StoredResponse, TraceOrigin,
};
use tower_idempotency::store::{Claim, Store};
use tower_idempotency_postgres::PgStore;
use tower_idempotency_redis::RedisStore;

const LEASE: Duration = Duration::from_secs(60);
const WINDOW: Duration = Duration::from_secs(3600);
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The exit codes the README documents.
const FOUND: i32 = 0;
const ABSENT: i32 = 1;
const USAGE: i32 = 2;
const REFUSED: i32 = 3;
const STORE: i32 = 4;
const NOTHING_HERE: i32 = 5;

/// What one run of the tool printed, and its exit code.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|err| panic!("--json prints one JSON object ({err}): {self:?}"))
    }

    /// Each line of stderr as JSON: with `--json`, a log pipeline reads only JSON there.
    fn stderr_json(&self) -> Vec<Value> {
        self.stderr
            .lines()
            .map(|line| {
                serde_json::from_str(line)
                    .unwrap_or_else(|err| panic!("a stderr line is JSON ({err}): {line:?}"))
            })
            .collect()
    }
}

/// Runs the tool with `store` (its store arguments) and `args`, printing what it printed.
async fn tool(store: &[String], args: &[&str]) -> Run {
    tool_with_env(store, args, &[]).await
}

/// [`tool`], with the store arguments after the command's.
async fn tool_after(args: &[&str], store: &[String]) -> Run {
    let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
    let store: Vec<&str> = store.iter().map(String::as_str).collect();
    tool(&args, &store).await
}

/// [`tool`], with `env` set in its environment.
async fn tool_with_env(store: &[String], args: &[&str], env: &[(&str, &str)]) -> Run {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-keys"))
        .args(store)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .await
        .expect("the tool runs");
    let run = Run {
        code: output.status.code().expect("an exit code"),
        stdout: String::from_utf8(output.stdout).expect("UTF-8 output"),
        stderr: String::from_utf8(output.stderr).expect("UTF-8 errors"),
    };
    println!(
        "$ idempotency-keys {} {}\n{}{}[exit {}]\n",
        store.join(" "),
        args.join(" "),
        run.stdout,
        run.stderr,
        run.code
    );
    run
}

fn fingerprint(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

async fn claim<St: Store>(store: &St, id: &RecordId) -> ClaimToken {
    match store.claim(id, &fingerprint(1), LEASE).await {
        Ok(Claim::Claimed(token)) => token,
        other => panic!("a free key is claimed: {other:?}"),
    }
}

/// [`created`], with the trace origin of the run that completed it.
fn created_traced() -> Completed {
    let origin = TraceOrigin::parse(TRACEPARENT)
        .expect("a traceparent")
        .with_tracestate("vendor=1");
    created().with_origin(Some(origin))
}

fn created() -> Completed {
    let mut headers = HeaderMap::new();
    headers.append("content-type", HeaderValue::from_static("application/json"));
    headers.append("location", HeaderValue::from_static("/v1/charges/ch_1"));
    Completed::with_response(
        fingerprint(1),
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"{\"id\":\"ch_1\"}"),
            trailers: None,
        },
    )
}

/// Every state of a key, through the tool, on `store` (named to the tool by `args`): absent, in
/// flight (and a forget refused, then forced), completed (with its body), forgotten, and a
/// tombstone.
async fn every_state<St: Store>(store: &St, args: &[String], keeps_completed_fence: bool) {
    let scope = ["--scope", "acct_1"];
    let lookup = |key: &'static str, extra: &'static [&'static str]| {
        let mut all = vec!["lookup"];
        all.extend(scope);
        all.extend(["--key", key]);
        all.extend(extra);
        all
    };
    let id = RecordId::new(b"acct_1", "order-42");
    // Another tenant's key: the prefix holds records, so an absent key is only absent.
    claim(store, &RecordId::new(b"acct_0", "order-1")).await;

    // Absent.
    let run = tool(args, &lookup("order-42", &[])).await;
    assert_eq!(run.code, ABSENT, "absent: {run:?}");
    assert!(run.stdout.contains("absent"), "{run:?}");
    let json = tool(args, &lookup("order-42", &["--json"])).await.json();
    assert_eq!(json["state"], "absent");
    assert_eq!(json["record_id"], id.to_string());
    assert_eq!(json["scope"], "acct_1");
    assert_eq!(json["scope_hex"], "616363745f31");

    // In flight.
    let token = claim(store, &id).await;
    let run = tool(args, &lookup("order-42", &[])).await;
    assert_eq!(run.code, FOUND, "found: {run:?}");
    assert!(run.stdout.contains("in flight"), "{run:?}");
    for row in ["claimed at", "lease ends", "fence"] {
        assert!(run.stdout.contains(row), "{row}: {run:?}");
    }
    let json = tool(args, &lookup("order-42", &["--json"])).await.json();
    assert_eq!(json["state"], "in_flight");
    assert_eq!(json["fence"], token.fence().get(), "{json}");
    assert_eq!(json["fingerprint"], "01".repeat(32));
    assert!(
        json["lease_ends"]
            .as_str()
            .is_some_and(|at| at.ends_with('Z'))
    );

    // A forget refused while in flight, then forced.
    let forget = |key: &'static str, extra: &'static [&'static str]| {
        let mut all = vec!["forget"];
        all.extend(scope);
        all.extend(["--key", key, "--reason", "charge refunded by hand"]);
        all.extend(extra);
        all
    };
    let run = tool(args, &forget("order-42", &["--json"])).await;
    assert_eq!(run.code, REFUSED, "refused: {run:?}");
    assert_eq!(run.json()["result"], "refused");
    assert_eq!(run.json()["record"]["state"], "in_flight");
    let audit = run.stderr_json();
    assert_eq!(audit.len(), 1, "one audit line: {run:?}");
    assert_eq!(audit[0]["result"], "refused");
    assert!(
        store.renew(&id, &token, LEASE).await.expect("renewed"),
        "a refused forget leaves the claim"
    );
    let run = tool(args, &forget("order-42", &["--force"])).await;
    assert_eq!(run.code, FOUND, "forgotten: {run:?}");
    assert!(run.stdout.contains("forgotten"), "{run:?}");
    assert!(
        run.stderr.contains("record forgotten by an operator")
            && run.stderr.contains("charge refunded by hand")
            && run.stderr.contains(&id.to_string()),
        "the forget is logged at WARN with the reason and the record id: {run:?}"
    );
    assert!(!store.renew(&id, &token, LEASE).await.expect("answered"));

    // Completed, with its body on request, its trace origin and the times the store keeps.
    let token = claim(store, &id).await;
    assert!(
        store
            .complete(&id, &token, &created_traced(), WINDOW)
            .await
            .expect("completed")
    );
    let run = tool(args, &lookup("order-42", &["--body"])).await;
    assert_eq!(run.code, FOUND);
    assert!(run.stdout.contains("201 Created"), "{run:?}");
    assert!(run.stdout.contains("{\"id\":\"ch_1\"}"), "{run:?}");
    assert!(
        run.stdout.contains(&format!("origin       {TRACEPARENT}")),
        "{run:?}"
    );
    assert!(run.stdout.contains("tracestate   vendor=1"), "{run:?}");
    assert!(run.stdout.contains("expires      20"), "{run:?}");
    assert!(run.stdout.contains("completed at not kept"), "{run:?}");
    let json = tool(args, &lookup("\"order-42\"", &["--json"]))
        .await
        .json();
    assert_eq!(json["state"], "completed", "the quoted key is the same key");
    assert_eq!(json["status"], 201);
    assert_eq!(json["body_len"], 13);
    assert!(json.get("body").is_none(), "no body unless asked: {json}");
    assert_eq!(json["origin"]["traceparent"], TRACEPARENT, "{json}");
    assert_eq!(
        json["origin"]["trace_id"],
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(json["origin"]["span_id"], "00f067aa0ba902b7");
    assert_eq!(json["origin"]["tracestate"], "vendor=1");
    assert!(json["expires"].as_str().is_some_and(|at| at.ends_with('Z')));
    if keeps_completed_fence {
        assert_eq!(json["fence"], token.fence().get());
        assert!(
            json["claimed_at"]
                .as_str()
                .is_some_and(|at| at.ends_with('Z'))
        );
    } else {
        assert_eq!(json["fence"], Value::Null);
        assert_eq!(json["claimed_at"], Value::Null);
    }
    let json = tool(args, &lookup("order-42", &["--json", "--body"]))
        .await
        .json();
    assert_eq!(json["body"], "{\"id\":\"ch_1\"}");
    assert_eq!(json["headers"][1]["name"], "location");
    assert_eq!(json["headers"][1]["value"], "/v1/charges/ch_1");

    // Another scope does not see it.
    let run = tool(
        args,
        &["lookup", "--scope", "acct_2", "--key", "order-42", "--json"],
    )
    .await;
    assert_eq!(run.json()["state"], "absent");

    // Forgotten, unforced, with its audit line as one JSON object on stderr; then gone, and a
    // new claim is a new run with a larger fence.
    let run = tool(args, &forget("order-42", &["--json"])).await;
    assert_eq!(run.code, FOUND);
    let json = run.json();
    assert_eq!(json["result"], "forgotten");
    assert_eq!(json["forced"], false);
    assert_eq!(json["record"]["state"], "completed");
    assert_eq!(json["record"]["origin"]["traceparent"], TRACEPARENT);
    let audit = run.stderr_json();
    assert_eq!(audit.len(), 1, "one audit line, no text line: {run:?}");
    let audit = &audit[0];
    assert_eq!(audit["event"], "forget");
    assert_eq!(audit["level"], "WARN");
    assert_eq!(audit["result"], "forgotten");
    assert_eq!(audit["record_id"], id.to_string());
    assert_eq!(
        audit["scope_tag"],
        tower_idempotency::operator::scope_tag(b"acct_1").to_string()
    );
    assert_eq!(audit["state"], "completed");
    assert_eq!(audit["forced"], false);
    assert_eq!(audit["reason"], "charge refunded by hand");
    assert!(audit["time"].as_str().is_some_and(|at| at.ends_with('Z')));
    assert!(
        !run.stderr.contains("acct_1") && !run.stderr.contains("order-42"),
        "no raw scope or key in the audit line: {run:?}"
    );
    assert_eq!(tool(args, &lookup("order-42", &[])).await.code, ABSENT);
    assert_eq!(
        tool(args, &forget("order-42", &[])).await.code,
        ABSENT,
        "nothing to forget"
    );
    let again = claim(store, &id).await;
    assert!(again.fence() > token.fence());

    // A tombstone.
    let id = RecordId::new(b"acct_1", "order-43");
    let token = claim(store, &id).await;
    let tombstone = Completed::tombstone(fingerprint(1));
    assert!(
        store
            .complete(&id, &token, &tombstone, WINDOW)
            .await
            .expect("completed")
    );
    let run = tool(args, &lookup("order-43", &[])).await;
    assert!(run.stdout.contains("tombstone"), "{run:?}");
    let json = tool(args, &lookup("order-43", &["--json"])).await.json();
    assert_eq!(json["state"], "tombstone");
    assert_eq!(json["status"], Value::Null);
}

/// Bad input is a clear error and exit 2, never a panic.
async fn refuses_bad_input(args: &[String]) {
    for (bad, says) in [
        (
            &["lookup", "--scope", "a", "--key", "two, keys"][..],
            "not a valid idempotency key",
        ),
        (
            &["lookup", "--scope-hex", "6x", "--key", "k"],
            "--scope-hex",
        ),
        (&["lookup", "--key", "k"], "--scope"),
        (
            &["lookup", "--scope", "a", "--scope-hex", "61", "--key", "k"],
            "cannot be used with",
        ),
        (
            &["forget", "--scope", "a", "--key", "k", "--reason", " "],
            "a reason is required",
        ),
        (
            &["lookup", "--scope", "a", "--key", "k", "--timeout", "0"],
            "--timeout",
        ),
    ] {
        let run = tool(args, bad).await;
        assert_eq!(run.code, USAGE, "{bad:?}: {run:?}");
        assert!(run.stderr.contains(says), "{bad:?} says {says:?}: {run:?}");
        assert!(!run.stderr.contains("panicked"), "{run:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_single_server() {
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url())
        .expect("a store")
        .with_prefix("app:");
    let args = vec![
        "--redis".to_owned(),
        server.url(),
        "--redis-prefix".to_owned(),
        "app:".to_owned(),
    ];
    every_state(&store, &args, false).await;
    refuses_bad_input(&args).await;

    // Without the application's prefix, the tool looks where nothing is, and says so: not an
    // absent key, but no key under that prefix at all. Lookup and forget alike.
    let id = RecordId::new(b"acct_9", "k");
    claim(&store, &id).await;
    let elsewhere = vec!["--redis".to_owned(), server.url()];
    let run = tool(&elsewhere, &["lookup", "--scope", "acct_9", "--key", "k"]).await;
    assert_eq!(run.code, NOTHING_HERE, "{run:?}");
    assert!(
        run.stderr
            .contains("no key under prefix \"idempotency:\" at all: is the prefix right?"),
        "{run:?}"
    );
    assert!(run.stdout.is_empty(), "nothing said absent: {run:?}");
    let forget = [
        "forget", "--scope", "acct_9", "--key", "k", "--reason", "stuck",
    ];
    let run = tool(&elsewhere, &forget).await;
    assert_eq!(run.code, NOTHING_HERE, "{run:?}");
    let run = tool(&args, &["lookup", "--scope", "acct_9", "--key", "k"]).await;
    assert_eq!(run.code, FOUND, "{run:?}");

    // Options after the command, or some before and some after.
    let lookup = ["lookup", "--scope", "acct_9", "--key", "k", "--json"];
    let run = tool_after(&lookup, &args).await;
    assert_eq!(run.code, FOUND, "{run:?}");
    assert_eq!(run.json()["state"], "in_flight");
    let run = tool(
        &elsewhere,
        &[&lookup[..], &["--redis-prefix", "app:", "--timeout", "2"]].concat(),
    )
    .await;
    assert_eq!(run.code, FOUND, "{run:?}");
    // The URL option under the name one guesses first.
    let url = server.url();
    let guessed = [
        &lookup[..],
        &["--redis-url", &url, "--redis-prefix", "app:"],
    ]
    .concat();
    assert_eq!(tool(&[], &guessed).await.code, FOUND);

    // One store, wherever it is named: none, or two, is a usage error.
    let run = tool(&[], &lookup).await;
    assert_eq!(run.code, USAGE, "{run:?}");
    assert!(run.stderr.contains("one store is required"), "{run:?}");
    let run = tool(
        &elsewhere,
        &[&lookup[..], &["--postgres", "postgres://localhost/x"]].concat(),
    )
    .await;
    assert_eq!(run.code, USAGE, "{run:?}");
    assert!(run.stderr.contains("only one store"), "{run:?}");
}

/// An empty prefix says so (exit 5) until the application writes a record under it; then a key
/// that is not there is absent (exit 1).
#[tokio::test(flavor = "multi_thread")]
async fn an_empty_prefix_is_not_an_absent_key() {
    let server = RedisServer::start();
    let args = vec!["--redis".to_owned(), server.url()];
    let lookup = ["lookup", "--no-scope", "--key", "k"];
    let run = tool(&args, &lookup).await;
    assert_eq!(run.code, NOTHING_HERE, "{run:?}");
    let store = RedisStore::from_url(&server.url()).expect("a store");
    claim(&store, &RecordId::new(b"", "other")).await;
    let run = tool(&args, &lookup).await;
    assert_eq!(run.code, ABSENT, "{run:?}");
    assert!(run.stdout.contains("absent"), "{run:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_cluster() {
    let cluster = RedisCluster::shared();
    let store = RedisStore::cluster(cluster.urls())
        .expect("a store")
        .with_prefix("cli:");
    let args = vec![
        "--redis-cluster".to_owned(),
        cluster.urls().join(","),
        "--redis-prefix".to_owned(),
        "cli:".to_owned(),
    ];
    every_state(&store, &args, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres() {
    let server = PostgresServer::start();
    let store = PgStore::connect(&server.url())
        .expect("a store")
        .try_with_table("ops_records")
        .expect("a table name");
    store.migrate().await.expect("the table is created");
    let args = vec![
        "--postgres".to_owned(),
        server.url(),
        "--postgres-table".to_owned(),
        "ops_records".to_owned(),
    ];
    every_state(&store, &args, true).await;
    refuses_bad_input(&args).await;

    // The table after the command.
    let run = tool_after(&["lookup", "--scope", "acct_1", "--key", "order-43"], &args).await;
    assert_eq!(run.code, FOUND, "{run:?}");

    // The default table does not exist here: said as such, not as the application's advice.
    let elsewhere = vec!["--postgres".to_owned(), server.url()];
    for command in [
        &["lookup", "--scope", "a", "--key", "k"][..],
        &["forget", "--scope", "a", "--key", "k", "--reason", "r"],
    ] {
        let run = tool(&elsewhere, command).await;
        assert_eq!(run.code, NOTHING_HERE, "{run:?}");
        assert!(
            run.stderr
                .contains("no table idempotency_records in this database: is the table right?"),
            "{run:?}"
        );
        assert!(!run.stderr.contains("migrate"), "{run:?}");
    }
    let bad_table = vec![
        "--postgres".to_owned(),
        server.url(),
        "--postgres-table".to_owned(),
        "x; DROP TABLE ops_records".to_owned(),
    ];
    let run = tool(&bad_table, &["lookup", "--scope", "a", "--key", "k"]).await;
    assert_eq!(run.code, USAGE, "{run:?}");
    assert!(run.stderr.contains("invalid table name"), "{run:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_store_is_exit_4() {
    // A port nothing listens on: taken from a server that has stopped.
    let url = {
        let server = RedisServer::start();
        server.url()
    };
    let args = vec![
        "--redis".to_owned(),
        url,
        "--timeout".to_owned(),
        "1".to_owned(),
    ];
    let run = tool(&args, &["lookup", "--scope", "a", "--key", "k"]).await;
    assert_eq!(run.code, STORE, "{run:?}");
    assert!(run.stderr.starts_with("error: "), "{run:?}");
}

/// A PostgreSQL that is down is said to be down, at once, with the reason the connection gave;
/// so is a database that does not exist. Not "did not answer within the timeout".
#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_postgres_says_why_at_once() {
    let server = PostgresServer::start();
    let missing_database = server
        .url()
        .rsplit_once('/')
        .expect("a database")
        .0
        .to_owned();
    let down = {
        let stopped = PostgresServer::start();
        stopped.url()
    };
    for (url, why) in [
        (down, "Connection refused"),
        (
            format!("{missing_database}/no_such_db"),
            "database \"no_such_db\" does not exist",
        ),
    ] {
        let args = vec![
            "--postgres".to_owned(),
            url,
            "--timeout".to_owned(),
            "5".to_owned(),
        ];
        let started = std::time::Instant::now();
        let run = tool(&args, &["lookup", "--scope", "a", "--key", "k"]).await;
        assert_eq!(run.code, STORE, "{run:?}");
        assert!(
            run.stderr
                .starts_with("error: cannot connect to PostgreSQL: ")
                && run.stderr.contains(why),
            "{run:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }
}

/// A sealed response is shown sealed, under its key's id, without the keys; with the
/// application's keys (`--seal-keys-env`), opened; under keys that do not open it, an error.
#[tokio::test(flavor = "multi_thread")]
async fn a_sealed_response_opens_only_with_its_keys() {
    use tower_idempotency::seal::{SealKeys, SealedStore};

    const KEYS: &str = "2026-12:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const OTHER_KEYS: &str = "2026-12:Hx4dHBsaGRgXFhUUExIREA8ODQwLCgkIBwYFBAMCAQA=";
    let server = RedisServer::start();
    let store = RedisStore::from_url(&server.url()).expect("a store");
    let sealed = SealedStore::new(store, SealKeys::parse(KEYS).expect("a key list"));
    let id = RecordId::new(b"acct_1", "order-42");
    let token = claim(&sealed, &id).await;
    sealed
        .complete(&id, &token, &created_traced(), WINDOW)
        .await
        .expect("completed");
    let args = vec!["--redis".to_owned(), server.url()];
    let lookup = [
        "lookup", "--scope", "acct_1", "--key", "order-42", "--body", "--json",
    ];

    let run = tool(&args, &lookup).await;
    assert_eq!(run.code, 0, "{run:?}");
    let json = run.json();
    assert_eq!(json["sealed_under"], "2026-12", "{run:?}");
    assert!(json["body"].is_null(), "no ciphertext as a body: {run:?}");
    assert!(
        json["origin"].is_null(),
        "the origin is sealed too: {run:?}"
    );

    let with_keys = [args.clone(), vec!["--seal-keys-env".into(), "SEAL".into()]].concat();
    let run = tool_with_env(&with_keys, &lookup, &[("SEAL", KEYS)]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let json = run.json();
    assert_eq!(json["status"], 201, "{run:?}");
    assert_eq!(json["body"], "{\"id\":\"ch_1\"}", "{run:?}");
    assert!(json["sealed_under"].is_null(), "{run:?}");
    assert_eq!(json["origin"]["traceparent"], TRACEPARENT, "{run:?}");

    let run = tool_with_env(&with_keys, &lookup, &[("SEAL", OTHER_KEYS)]).await;
    assert_eq!(run.code, STORE, "keys that do not open it: {run:?}");
    assert!(
        run.stdout.is_empty(),
        "nothing printed as the record: {run:?}"
    );
    let run = tool_with_env(&with_keys, &lookup, &[]).await;
    assert_eq!(run.code, USAGE, "{run:?}");
    assert!(run.stderr.contains("SEAL is not set"), "{run:?}");
    let run = tool_with_env(&with_keys, &lookup, &[("SEAL", "not a key list")]).await;
    assert_eq!(run.code, USAGE, "{run:?}");
    assert!(!run.stderr.contains("panicked"), "{run:?}");
}
