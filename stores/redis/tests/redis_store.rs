//! `RedisStore` against a real `redis-server` of its own: round trips, many instances, faults.
//!
//! Each test starts its own server on a free port (`test_servers::RedisServer`), so the tests run
//! in parallel and can stop, kill, restart and pause it. Without `redis-server` on PATH they fail.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use test_servers::redis_server::RedisServer;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::record::{ClaimToken, Completed, Fence, Fingerprint, Record, RecordId};
use tower_idempotency::store::{Claim, Store, StoreError};
use tower_idempotency::{IdempotencyLayer, Outcome};
use tower_idempotency_redis::{RedisStore, RedisStoreError};
use tower_idempotency_test::Counting;

/// A charge handler that counts its runs and can be held until the test releases it.
#[derive(Clone, Default)]
struct Handler {
    runs: Arc<AtomicUsize>,
    started: Arc<Notify>,
    gate: Option<Arc<Notify>>,
}

impl Handler {
    fn gated() -> Self {
        Self {
            gate: Some(Arc::new(Notify::new())),
            ..Self::default()
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn release(&self) {
        if let Some(gate) = &self.gate {
            gate.notify_one();
        }
    }

    fn app<St: Store + Clone>(&self, layer: IdempotencyLayer<St>) -> Router {
        let handler = self.clone();
        Router::new()
            .route(
                "/charges",
                post(move |body: String| {
                    let handler = handler.clone();
                    async move {
                        let n = handler.runs.fetch_add(1, Ordering::SeqCst) + 1;
                        handler.started.notify_one();
                        if let Some(gate) = &handler.gate {
                            gate.notified().await;
                        }
                        (
                            StatusCode::CREATED,
                            [("x-run", n.to_string())],
                            format!("charge {n}: {body}"),
                        )
                    }
                }),
            )
            .layer(layer)
    }
}

fn store(server: &RedisServer) -> RedisStore {
    RedisStore::from_url(&server.url())
        .expect("a valid url")
        .with_timeout(Duration::from_millis(500))
}

fn layer(server: &RedisServer) -> IdempotencyLayer<RedisStore> {
    IdempotencyLayer::new(store(server))
}

fn charge(key: &str, body: &str) -> Request<Body> {
    Request::post("/charges")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, Option<Outcome>, String) {
    let response: Response<_> = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let outcome = response.extensions().get::<Outcome>().copied();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, outcome, String::from_utf8_lossy(&body).into_owned())
}

/// Commands the server ran since the last reset, without the bookkeeping of the test itself.
/// `INFO commandstats` also counts the calls a script makes: the claim script's `GET`, `TIME` and
/// `SET`, and the completion script's `GET` and `SET`, appear beside their `EVALSHA`s, though only
/// an `EVALSHA` is a round trip. Nor the check of a connection quiet for 100 ms (§10.6): a `PING`
/// in the same write as the command, there or not as the test's pace has it (`redis_restart.rs`
/// shows that a connection in use carries none).
fn commands(server: &RedisServer) -> HashMap<String, u64> {
    let mut stats = server.info_commandstats();
    stats.retain(|name, _| !matches!(name.as_str(), "config|resetstat" | "info" | "ping"));
    stats
}

/// The round trips of the commands `commands` saw: every command but those run inside scripts
/// (the store sends no `GET`, `SET`, `TIME` or `DEL` of its own: its calls are scripts).
fn round_trips(stats: &HashMap<String, u64>) -> u64 {
    stats
        .iter()
        .filter(|(name, _)| !matches!(name.as_str(), "get" | "set" | "time" | "del"))
        .map(|(_, calls)| calls)
        .sum()
}

fn assert_every_key_has_a_ttl(server: &RedisServer) {
    assert_eq!(
        server.keys_without_ttl(),
        Vec::<String>::new(),
        "keys without a TTL"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_are_at_the_floor() {
    let server = RedisServer::start();
    let handler = Handler::default();
    let app = handler.app(layer(&server));
    // Warm up: the first use connects and loads the completion script.
    assert_eq!(
        send(&app, charge("warm-up", "x")).await.0,
        StatusCode::CREATED
    );

    server.config_resetstat();
    assert_eq!(
        send(&app, charge("k1", "100")).await.1,
        Some(Outcome::Executed)
    );
    let stats = commands(&server);
    // Two EVALSHAs: the claim (GET, TIME for the fence, SET) and the completion (GET, SET).
    assert_eq!(
        stats,
        HashMap::from([
            ("evalsha".into(), 2),
            ("get".into(), 2),
            ("time".into(), 1),
            ("set".into(), 2)
        ])
    );
    assert_eq!(round_trips(&stats), 2, "new key");

    server.config_resetstat();
    assert_eq!(
        send(&app, charge("k1", "100")).await.1,
        Some(Outcome::Replayed)
    );
    let claim_of_a_live_record = HashMap::from([("evalsha".into(), 1), ("get".into(), 1)]);
    assert_eq!(commands(&server), claim_of_a_live_record, "replay");

    server.config_resetstat();
    assert_eq!(
        send(&app, charge("k1", "200")).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(commands(&server), claim_of_a_live_record, "422");

    let gated = Handler::gated();
    let gated_app = gated.app(layer(&server));
    let first = tokio::spawn({
        let app = gated_app.clone();
        async move { send(&app, charge("k2", "100")).await }
    });
    gated.started.notified().await;
    server.config_resetstat();
    let (status, outcome, _) = send(&gated_app, charge("k2", "100")).await;
    assert_eq!(
        (status, outcome),
        (StatusCode::CONFLICT, Some(Outcome::InFlight))
    );
    assert_eq!(commands(&server), claim_of_a_live_record, "409");
    gated.release();
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(gated.runs(), 1);
    assert_every_key_has_a_ttl(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_one_truth_under_200_concurrent_retries() {
    let server = RedisServer::start();
    let handler = Handler::default();
    // Two instances behind a load balancer: each its own layer, store and pool, on one Redis.
    let apps = [handler.app(layer(&server)), handler.app(layer(&server))];
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let app = apps[i % 2].clone();
            tokio::spawn(async move { send(&app, charge("same-key", "100 EUR")).await })
        })
        .collect();
    let mut by_outcome: HashMap<Option<Outcome>, usize> = HashMap::new();
    let mut bodies = Vec::new();
    for task in tasks {
        let (status, outcome, body) = task.await.unwrap();
        match outcome {
            Some(Outcome::Executed | Outcome::Replayed) => {
                assert_eq!(status, StatusCode::CREATED);
                bodies.push(body);
            }
            Some(Outcome::InFlight) => assert_eq!(status, StatusCode::CONFLICT),
            other => panic!("unexpected outcome {other:?} ({status})"),
        }
        *by_outcome.entry(outcome).or_default() += 1;
    }
    assert_eq!(handler.runs(), 1, "exactly one execution: {by_outcome:?}");
    assert_eq!(
        by_outcome.get(&Some(Outcome::Executed)),
        Some(&1),
        "{by_outcome:?}"
    );
    assert!(
        bodies.iter().all(|b| b == "charge 1: 100 EUR"),
        "every 201 is the one charge"
    );
    assert_every_key_has_a_ttl(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_gives_503_and_the_store_recovers_by_itself() {
    let mut server = RedisServer::start();
    let handler = Handler::default();
    let app = handler.app(layer(&server));
    assert_eq!(
        send(&app, charge("before", "1")).await.1,
        Some(Outcome::Executed)
    );

    server.stop();
    let (status, outcome, body) = send(&app, charge("while-down", "1")).await;
    assert_eq!(
        (status, outcome),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Some(Outcome::StoreUnavailable)
        )
    );
    assert!(body.contains("store-unavailable"), "{body}");
    assert_eq!(handler.runs(), 1, "fail closed: the handler did not run");

    server.restart();
    // The same application, the same store: no restart needed.
    assert_eq!(
        send(&app, charge("while-down", "1")).await.1,
        Some(Outcome::Executed)
    );
    assert_eq!(
        send(&app, charge("while-down", "1")).await.1,
        Some(Outcome::Replayed)
    );
    assert_eq!(handler.runs(), 2);
    assert_every_key_has_a_ttl(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_redis_gives_503_within_the_timeout() {
    let server = RedisServer::start();
    let handler = Handler::default();
    let app = handler.app(layer(&server));
    assert_eq!(
        send(&app, charge("before", "1")).await.1,
        Some(Outcome::Executed)
    );

    server.pause();
    let started = Instant::now();
    let (status, _, _) = send(&app, charge("while-paused", "1")).await;
    let waited = started.elapsed();
    server.resume();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        waited >= Duration::from_millis(450) && waited < Duration::from_millis(1500),
        "{waited:?}"
    );
    assert_eq!(handler.runs(), 1);

    // Once Redis answers again, so does the store. The timed-out claim may have taken the key
    // when Redis resumed, with its release sent behind it on the connection it went on, while a
    // retry goes on a fresh one and may arrive between the two: then it is told the key is in
    // flight, until the release lands, long before the claim's 30 s lease would run out.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match send(&app, charge("while-paused", "1")).await.1 {
            Some(Outcome::Executed) => break,
            Some(Outcome::InFlight) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("a retry once Redis answers: {other:?}"),
        }
    }
    assert_eq!(handler.runs(), 2);
}

/// Captures the layer's log lines (the runtime is single-threaded, so a thread-local subscriber sees
/// the detached handler task too).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn redis_killed_while_the_handler_runs() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let mut server = RedisServer::start();
    let handler = Handler::gated();
    let layer = layer(&server);
    let pending = layer.shutdown_handle();
    let app = handler.app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, charge("k", "100")).await }
    });
    handler.started.notified().await;
    server.kill();
    handler.release();

    // The client still gets the handler's response, though it could not be stored yet.
    let (status, outcome, body) = first.await.unwrap();
    assert_eq!(
        (status, outcome),
        (StatusCode::CREATED, Some(Outcome::Executed))
    );
    assert_eq!(body, "charge 1: 100");
    assert!(
        logs.text().contains("store write failed"),
        "logged: {}",
        logs.text()
    );

    // While Redis is down, a retry is refused and does not run the handler.
    assert_eq!(
        send(&app, charge("k", "100")).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(handler.runs(), 1);

    // A Redis without persistence comes back empty, claim and all. The completion is still being
    // retried, and it lands in the empty key: the handler did run, so a retry must not run it
    // again.
    server.restart();
    tokio::time::timeout(Duration::from_secs(10), pending.wait())
        .await
        .expect("the pending completion lands once Redis is back");
    let (status, outcome, body) = send(&app, charge("k", "100")).await;
    assert_eq!(
        (status, outcome, body.as_str()),
        (
            StatusCode::CREATED,
            Some(Outcome::Replayed),
            "charge 1: 100"
        )
    );
    assert_eq!(handler.runs(), 1);
    assert_every_key_has_a_ttl(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_does_not_break_anything() {
    let server = RedisServer::start();
    let handler = Handler::default();
    let app = handler.app(layer(&server));
    assert_eq!(
        send(&app, charge("a", "1")).await.1,
        Some(Outcome::Executed)
    );
    assert!(server.command(&["SCRIPT", "FLUSH"]).is_ok());
    assert_eq!(
        send(&app, charge("b", "1")).await.1,
        Some(Outcome::Executed)
    );
    assert_eq!(
        send(&app, charge("b", "1")).await.1,
        Some(Outcome::Replayed)
    );
    assert_eq!(
        send(&app, charge("a", "1")).await.1,
        Some(Outcome::Replayed)
    );
    assert_eq!(handler.runs(), 2);
    assert_every_key_has_a_ttl(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_owner_that_lost_its_lease_cannot_overwrite_the_new_owner() {
    let server = RedisServer::start();
    let (old_instance, new_instance) = (store(&server), store(&server));
    let id = RecordId::new(b"acct", "k");
    let fingerprint = Fingerprint::from_bytes([3; 32]);
    let lease = Duration::from_millis(200);

    let Claim::Claimed(old) = old_instance.claim(&id, &fingerprint, lease).await.unwrap() else {
        panic!("a new key is free")
    };
    // The old owner stalls (a GC pause, a SIGSTOP) past its lease; another instance claims.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let Claim::Claimed(new) = new_instance
        .claim(&id, &fingerprint, Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("the expired claim frees the key")
    };

    let stale = Completed::tombstone(fingerprint);
    assert!(
        !old_instance
            .complete(&id, &old, &stale, Duration::from_secs(60))
            .await
            .unwrap()
    );
    assert!(!old_instance.renew(&id, &old, lease).await.unwrap());
    assert!(!old_instance.release(&id, &old).await.unwrap());
    let Claim::Existing(Record::InFlight(record)) =
        new_instance.claim(&id, &fingerprint, lease).await.unwrap()
    else {
        panic!("the new owner's claim is intact")
    };
    assert!(record.lease_remaining > Duration::from_secs(25));

    assert!(
        new_instance
            .complete(&id, &new, &stale, Duration::from_secs(60))
            .await
            .unwrap()
    );
    assert!(matches!(
        old_instance.claim(&id, &fingerprint, lease).await.unwrap(),
        Claim::Existing(Record::Completed(_))
    ));
    assert_every_key_has_a_ttl(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_server_and_an_unreachable_one() {
    let mut server = RedisServer::start();
    store(&server)
        .check()
        .await
        .expect("Redis 7 passes the check");
    server.stop();
    let err = store(&server)
        .check()
        .await
        .expect_err("a stopped server fails the check");
    assert!(!err.to_string().is_empty());
    assert!(RedisStore::from_url("not a url").is_err());
}

/// Two clients leave while their claims wait on a paused server: the first claim went out on its
/// own (nothing else was on its way), the second in a batch behind it. Neither key stays claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_the_claim_does_not_leave_its_key_claimed() {
    let server = RedisServer::start();
    let handler = Handler::default();
    let store = RedisStore::from_url(&server.url())
        .unwrap()
        .with_timeout(Duration::from_secs(10));
    let app = handler.app(IdempotencyLayer::new(store));
    assert_eq!(
        send(&app, charge("warm-up", "1")).await.1,
        Some(Outcome::Executed)
    );

    server.pause();
    let leave = |key: &'static str| {
        let app = app.clone();
        tokio::spawn(async move { send(&app, charge(key, "1")).await })
    };
    let alone = leave("alone");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let batched = leave("batched");
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The clients disconnect: the server drops the requests' futures while their claims wait.
    for request in [alone, batched] {
        request.abort();
        assert!(request.await.unwrap_err().is_cancelled());
    }
    server.resume();

    // Each claim took its key once Redis resumed, and the release sent behind it freed it.
    for key in ["alone", "batched"] {
        assert_eq!(
            send(&app, charge(key, "1")).await.1,
            Some(Outcome::Executed),
            "the key {key} is free again"
        );
    }
    assert_eq!(handler.runs(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_command_fails_only_its_own_claim_in_a_shared_pipeline() {
    let server = RedisServer::start();
    let store = store(&server);
    // A key of the wrong type: `SET ... GET` on it fails with WRONGTYPE.
    let poisoned = RecordId::new(b"", "poisoned");
    assert!(matches!(
        server.command(&[
            "HSET",
            &format!("idempotency:{{{poisoned}}}"),
            "field",
            "value"
        ]),
        test_servers::redis_server::RespValue::Integer(1)
    ));
    let fingerprint = Fingerprint::from_bytes([7; 32]);
    // Claims started together go out in shared pipelines.
    let claims: Vec<_> = (0..64)
        .map(|i| {
            let store = store.clone();
            let id = if i == 32 {
                poisoned
            } else {
                RecordId::new(b"", &format!("key-{i}"))
            };
            tokio::spawn(async move {
                store
                    .claim(&id, &fingerprint, Duration::from_secs(30))
                    .await
            })
        })
        .collect();
    for (i, claim) in claims.into_iter().enumerate() {
        let claim = claim.await.unwrap();
        if i == 32 {
            let Err(err) = claim else {
                panic!("the claim on the poisoned key succeeded")
            };
            assert!(format!("{err:?}").contains("WRONGTYPE"), "{err:?}");
        } else {
            assert!(
                matches!(claim, Ok(Claim::Claimed(_))),
                "claim {i}: {claim:?}"
            );
        }
    }
}

/// Redis numbers each claim from its own clock (§5.3): after the server lost every record and
/// every script (a restart without persistence), the same key's next claim still has a larger
/// fence, and the claim script is loaded again on the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_grows_across_a_server_that_forgot_everything() {
    let server = RedisServer::start();
    let store = store(&server);
    let id = RecordId::new(b"", "fenced");
    let fingerprint = Fingerprint::from_bytes([1; 32]);
    let lease = Duration::from_secs(30);
    let Ok(Claim::Claimed(first)) = store.claim(&id, &fingerprint, lease).await else {
        panic!("§10.1 claim: a new key is claimed");
    };

    server.flushall();
    assert!(server.command(&["SCRIPT", "FLUSH"]).is_ok());
    let Ok(Claim::Claimed(second)) = store.claim(&id, &fingerprint, lease).await else {
        panic!("§10.1 claim: a forgotten key is claimed again, the claim script reloaded");
    };
    assert!(
        second.fence() > first.fence(),
        "§5.3: the fence grows across a server that forgot the key: {:?} after {:?}",
        second.fence(),
        first.fence()
    );
    assert!(
        !store.renew(&id, &first, lease).await.expect("renew"),
        "§5.3: the forgotten claim's token fences nothing of the new one"
    );
    assert!(
        store.release(&id, &second).await.expect("release"),
        "§10.1 release: the claim's own release"
    );
}

/// A claim that finds a record in flight is told the lease its key has left, to the millisecond:
/// the claim script stamps the lease end from Redis's `TIME` as `PX` counts the key's expiry
/// (PROTOCOL.md §10.6). Stamped from whole seconds it would be early by up to one, and a 409's
/// `Retry-After` and a waiting consumer's pauses (§6.3, §11.3) would come while the owner still
/// holds the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_in_flight_reports_the_lease_its_key_has_left_to_the_millisecond() {
    let server = RedisServer::start();
    let store = store(&server);
    let fingerprint = Fingerprint::from_bytes([5; 32]);
    let lease = Duration::from_secs(30);
    for n in 0.. {
        let id = RecordId::new(b"", &format!("lease-{n}"));
        let Ok(Claim::Claimed(token)) = store.claim(&id, &fingerprint, lease).await else {
            panic!("§10.1 claim: a new key is claimed");
        };
        // The fence is Redis's clock at the claim, in microseconds. In the first 20 ms of a
        // second, a lease end stamped from the whole second would be too close to tell: take
        // another key.
        if token.fence().get() / 1000 % 1000 < 20 {
            continue;
        }
        let Ok(Claim::Existing(Record::InFlight(record))) =
            store.claim(&id, &fingerprint, lease).await
        else {
            panic!("§10.1 claim: the key is in flight");
        };
        let key = format!("idempotency:{{{id}}}");
        let pttl = server.command(&["PTTL", &key]).as_integer();
        let key_left =
            Duration::from_millis(pttl.and_then(|ms| ms.try_into().ok()).expect("a TTL"));
        // Read before the key's TTL, the lease left is at least the TTL (1 ms for rounding).
        assert!(
            record.lease_remaining + Duration::from_millis(1) >= key_left,
            "§10.6: the claim reports {:?} of the lease left, the key lives {key_left:?} more",
            record.lease_remaining
        );
        break;
    }
}

/// With the replication wait, a completion that too few replicas acknowledged is not taken as
/// stored (PROTOCOL.md §10.6): the call fails with `NotReplicated`, so that the layer retries the
/// write in the background rather than rest on a record a failover may lose, and a retry after
/// that failover would run the handler again. One server without replicas: the claim comes from
/// a store without the wait, the completion from one that waits for a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_no_replica_acknowledged_fails_with_the_replication_wait() {
    let server = RedisServer::start();
    let plain = store(&server);
    let waiting = store(&server).with_replication_wait(1, Duration::from_millis(20));
    let id = RecordId::new(b"", "unreplicated-completion");
    let fingerprint = Fingerprint::from_bytes([6; 32]);
    let Ok(Claim::Claimed(token)) = plain
        .claim(&id, &fingerprint, Duration::from_secs(30))
        .await
    else {
        panic!("§10.1 claim: a new key is claimed");
    };
    let completed = Completed::tombstone(fingerprint);
    let ttl = Duration::from_secs(60);
    let err = waiting
        .complete(&id, &token, &completed, ttl)
        .await
        .expect_err("§10.6: a completion no replica acknowledged fails");
    assert_eq!(not_replicated(&err), Some((0, 1)), "{err:?}");
    // The master has it: the completion sent again is answered as done (§10.1).
    assert!(
        plain
            .complete(&id, &token, &completed, ttl)
            .await
            .expect("complete")
    );
}

/// The replica counts of `Unavailable(NotReplicated { acked, wanted })`, if `err` is that.
fn not_replicated(err: &StoreError) -> Option<(u32, u32)> {
    let StoreError::Unavailable(source) = err else {
        return None;
    };
    match source.downcast_ref::<RedisStoreError>()? {
        RedisStoreError::NotReplicated { acked, wanted } => Some((*acked, *wanted)),
        _ => None,
    }
}

/// A claim that too few replicas acknowledged is refused and released (PROTOCOL.md §10.6): the
/// master must not keep the key for a claim whose handler never runs, or every retry gets a 409
/// until its lease runs out. One server without replicas: no replica acknowledges anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_no_replica_acknowledged_is_refused_and_its_key_released() {
    let server = RedisServer::start();
    let waiting = store(&server).with_replication_wait(1, Duration::from_millis(20));
    let id = RecordId::new(b"", "unreplicated-claim");
    let fingerprint = Fingerprint::from_bytes([8; 32]);
    let lease = Duration::from_secs(30);
    let err = waiting
        .claim(&id, &fingerprint, lease)
        .await
        .expect_err("§10.6: a claim no replica acknowledged is refused");
    assert_eq!(not_replicated(&err), Some((0, 1)), "{err:?}");
    // The release goes out as the call fails: a retry claims the key once it lands.
    let plain = store(&server);
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match plain.claim(&id, &fingerprint, lease).await {
            Ok(Claim::Claimed(_)) => break,
            Ok(Claim::Existing(Record::InFlight(_))) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => panic!("§10.6: the refused claim's key is released, a retry got {other:?}"),
        }
    }
}

/// With the replication wait, a claim whose caller leaves is released behind it, on the
/// connection its `SET` went out on (PROTOCOL.md §10.6): a release sent on another, idle
/// connection would run before a `SET` still queued behind another claim's `WAIT`, find nothing,
/// and leave the key claimed by nobody for a whole lease. One server without replicas, two
/// connections taken in turn; a first claim's `WAIT` holds one of them for 500 ms. Two rounds,
/// each with a store of its own: the left claim goes on the free connection, then (a renewal
/// between) on the held one, so that whichever other connection a wrong release took, one round
/// finds it idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_left_behind_another_claims_wait_is_released_behind_it() {
    let server = RedisServer::start();
    let fingerprint = Fingerprint::from_bytes([9; 32]);
    let lease = Duration::from_secs(30);
    // The scripts loaded first: a `NOSCRIPT` would send the calls below again, on other lanes.
    let plain = store(&server);
    let warm = RecordId::new(b"", "warm");
    let Ok(Claim::Claimed(token)) = plain.claim(&warm, &fingerprint, lease).await else {
        panic!("a claim")
    };
    assert!(plain.renew(&warm, &token, lease).await.expect("a renewal"));

    for renewal_between in [false, true] {
        let manager = deadpool_redis::Manager::new_with_config(
            server.url(),
            deadpool_redis::redis::AsyncConnectionConfig::new().set_response_timeout(None),
        )
        .expect("a valid url");
        let pool = deadpool_redis::Pool::builder(manager)
            .max_size(2)
            .runtime(deadpool_redis::Runtime::Tokio1)
            .build()
            .expect("a pool");
        let waiting = RedisStore::new(pool)
            .with_timeout(Duration::from_secs(5))
            .with_replication_wait(1, Duration::from_millis(500));
        let first = RecordId::new(b"", &format!("first-{renewal_between}"));
        let left = RecordId::new(b"", &format!("left-{renewal_between}"));

        // The first claim: its `WAIT` holds its connection for 500 ms.
        let holding = tokio::spawn({
            let (waiting, first) = (waiting.clone(), first);
            async move { waiting.claim(&first, &fingerprint, lease).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        if renewal_between {
            // Not waited for: it takes the other connection's turn.
            let _ = waiting
                .renew(&first, &ClaimToken::new(Fence::new(1)), lease)
                .await;
        }
        let gone = tokio::time::timeout(
            Duration::from_millis(100),
            waiting.claim(&left, &fingerprint, lease),
        )
        .await;
        assert!(
            gone.is_err(),
            "the caller left while its claim waited: {gone:?}"
        );
        let _ = holding.await;
        // Every `SET` has run by now; a release behind the left claim's `WAIT` lands within
        // 500 ms more.
        tokio::time::sleep(Duration::from_millis(200)).await;

        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            match plain.claim(&left, &fingerprint, lease).await {
                Ok(Claim::Claimed(_)) => break,
                Ok(Claim::Existing(Record::InFlight(_))) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => panic!(
                    "§10.6: the left claim's key is released behind it (renewal between: \
                     {renewal_between}), got {other:?}"
                ),
            }
        }
    }
}

/// A store given another setting while a clone of it lives (the application keeps the base
/// store, and derives one with a prefix of its own) keeps its replication wait (PROTOCOL.md
/// §10.6): without it, its claims would be answered before any replica has them, and a failover
/// that lost one would let a retry run the handler a second time. On one server without replicas,
/// its claims are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_reconfigured_while_a_clone_lives_keeps_its_replication_wait() {
    let server = RedisServer::start();
    let base = store(&server).with_replication_wait(1, Duration::from_millis(20));
    let _kept = base.clone();
    let derived = base.with_prefix("payments:");
    let id = RecordId::new(b"", "derived");
    let err = derived
        .claim(
            &id,
            &Fingerprint::from_bytes([9; 32]),
            Duration::from_secs(30),
        )
        .await
        .expect_err("§10.6: no replica acknowledged the claim");
    assert_eq!(not_replicated(&err), Some((0, 1)), "{err:?}");
}

/// A record this release cannot decode (a kind a newer release writes, or damage) is not a store
/// failure: fail-open or not, the request is not run over it, and the answer is a 503 (§9.7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_of_an_unknown_kind_is_never_run_over_even_fail_open() {
    let server = RedisServer::start();
    let handler = Handler::default();
    let app = handler.app(layer(&server).fail_open(true));
    let id = RecordId::new(b"", "from-a-newer-release");
    let key = format!("idempotency:{{{id}}}");
    // Version 1, kind 9: no kind this release knows.
    let value = "\u{1}\u{9} written by a release that knows kind 9";
    assert!(server.command(&["SET", &key, value, "PX", "60000"]).is_ok());

    let (status, outcome, _) = send(&app, charge("from-a-newer-release", "1")).await;
    assert_eq!(
        (status, outcome),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Some(Outcome::StoreUnavailable)
        )
    );
    assert_eq!(handler.runs(), 0, "not run over the record");
}

/// A layer with a circuit breaker over a Redis that is stopped: after the failures that open it,
/// requests get their 503 at once (no claim reaches Redis); once Redis is back and the cool-down
/// is over, one probe closes it and requests run again (PROTOCOL.md §9.11).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_circuit_breaker_answers_at_once_while_redis_is_down_and_closes_when_it_is_back() {
    let mut server = RedisServer::start();
    let handler = Handler::default();
    let store = Counting::new(store(&server));
    let breaker = tower_idempotency::store::CircuitBreaker::new(store.clone())
        .with_failure_threshold(3)
        .with_cool_down(Duration::from_secs(2));
    let app = handler.app(IdempotencyLayer::new(breaker));
    assert_eq!(
        send(&app, charge("before", "1")).await.1,
        Some(Outcome::Executed)
    );

    server.stop();
    for n in 0..3 {
        let (status, outcome, _) = send(&app, charge(&format!("down-{n}"), "1")).await;
        assert_eq!(
            (status, outcome),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Some(Outcome::StoreUnavailable)
            )
        );
    }
    assert_eq!(store.calls().claim, 4);
    // Open: each answer comes at once, and none is a store call.
    let opened = Instant::now();
    for n in 0..50 {
        let response = app
            .clone()
            .oneshot(charge(&format!("open-{n}"), "1"))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            response.extensions().get::<Outcome>(),
            Some(&Outcome::CircuitOpen)
        );
        let retry_after = response.headers()["retry-after"].to_str().unwrap();
        assert!(matches!(retry_after, "1" | "2"), "{retry_after}");
    }
    assert!(
        opened.elapsed() < Duration::from_millis(500),
        "{:?}",
        opened.elapsed()
    );
    assert_eq!(handler.runs(), 1);
    assert_eq!(store.calls().claim, 4, "no claim while open");

    server.restart();
    // Redis is back. After the cool-down, the probe runs and closes the breaker; the requests after it run.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match send(&app, charge("after", "1")).await.1 {
            Some(Outcome::Executed) => break,
            Some(Outcome::CircuitOpen | Outcome::StoreUnavailable) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("once Redis is back: {other:?}"),
        }
    }
    assert_eq!(
        send(&app, charge("after", "1")).await.1,
        Some(Outcome::Replayed)
    );
    assert_eq!(
        send(&app, charge("after-2", "1")).await.1,
        Some(Outcome::Executed)
    );
    assert_eq!(handler.runs(), 3);
}

/// What the circuit breaker changes while Redis is away, measured by hand (not a check):
/// `cargo test -p tower-idempotency-redis --test redis_store measure_the_circuit_breaker -- --ignored --nocapture`
/// (`BREAKER_ROUNDS`, default 3). For each of Redis stopped and Redis frozen (`SIGSTOP`, so that
/// each claim waits out the store's 1 s timeout), 32 clients send new keys for 3 s through a
/// layer without a breaker (every claim goes to Redis, as before a breaker opens) and through
/// one behind `CircuitBreaker::new(store)` once it opened; then Redis returns while the clients go
/// on, and the time until the first request runs again is taken, with the breaker and without
/// (the two layers side by side, 32 clients each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand"]
async fn measure_the_circuit_breaker() {
    let rounds: usize = std::env::var("BREAKER_ROUNDS").map_or(3, |r| r.parse().unwrap());
    for round in 1..=rounds {
        for frozen in [false, true] {
            let mut server = RedisServer::start();
            let handler = Handler::default();
            let store = || RedisStore::from_url(&server.url()).expect("a valid url");
            let plain = handler.app(IdempotencyLayer::new(store()));
            let guarded = handler.app(IdempotencyLayer::new(
                tower_idempotency::store::CircuitBreaker::new(store()),
            ));
            for app in [&plain, &guarded] {
                send(app, charge(&format!("warm-{round}"), "1")).await;
            }
            let mut thaw = None;
            if frozen {
                thaw = Some(server.freeze());
            } else {
                server.stop();
            }
            let mode = if frozen { "frozen" } else { "stopped" };
            let before = load(&plain, "plain", Duration::from_secs(3), None).await;
            // Open the breaker: its first failures, as any request would meet them.
            while send(&guarded, charge("opening", "1")).await.1 != Some(Outcome::CircuitOpen) {}
            let open = load(&guarded, "open", Duration::from_secs(3), None).await;
            println!(
                "round {round}, Redis {mode}: without a breaker (or before it opens) {before}"
            );
            println!("round {round}, Redis {mode}: breaker open {open}");

            // Redis returns while the clients go on: the time to the first request that runs.
            let back = Arc::new(Mutex::new(None::<Instant>));
            let returning = {
                let back = back.clone();
                tokio::task::spawn_blocking(move || {
                    std::thread::sleep(Duration::from_millis(500));
                    match thaw.take() {
                        Some(frozen) => drop(frozen),
                        None => server.restart(),
                    }
                    *back.lock().unwrap() = Some(Instant::now());
                    server
                })
            };
            let (recovered, unguarded) = tokio::join!(
                load(&guarded, "recover", Duration::from_secs(15), Some(&back)),
                load(
                    &plain,
                    "recover-plain",
                    Duration::from_secs(15),
                    Some(&back)
                ),
            );
            let _server = returning.await.unwrap();
            println!("round {round}, Redis {mode}, Redis back: breaker: {recovered}");
            println!("round {round}, Redis {mode}, Redis back: without: {unguarded}");
        }
    }
}

/// Latencies and throughput of `clients` sending new keys to `app` for `duration`; with `back`,
/// stops at the first request that runs after the moment it holds, and says how long after it.
async fn load(
    app: &Router,
    name: &str,
    duration: Duration,
    back: Option<&Arc<Mutex<Option<Instant>>>>,
) -> String {
    const CLIENTS: usize = 32;
    let started = Instant::now();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ran_after = Arc::new(Mutex::new(None::<Duration>));
    let outcomes = Arc::new(Mutex::new(
        std::collections::BTreeMap::<String, usize>::new(),
    ));
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (app, done, ran_after) = (app.clone(), done.clone(), ran_after.clone());
            let outcomes = outcomes.clone();
            let (back, name) = (back.cloned(), name.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0;
                while !done.load(Ordering::Relaxed) && started.elapsed() < duration {
                    n += 1;
                    let sent = Instant::now();
                    let key = format!("{name}-{client}-{n}");
                    let outcome = send(&app, charge(&key, "1")).await.1;
                    latencies.push(sent.elapsed());
                    // An answer made at once never returns `Pending`: without a yield, a client
                    // would keep its worker thread, and starve the others (the probe included).
                    tokio::task::yield_now().await;
                    if outcome != Some(Outcome::CircuitOpen) {
                        *outcomes
                            .lock()
                            .unwrap()
                            .entry(format!("{outcome:?}"))
                            .or_insert(0) += 1;
                    }
                    let returned = back.as_ref().and_then(|back| *back.lock().unwrap());
                    if let Some(returned) = returned
                        && outcome == Some(Outcome::Executed)
                    {
                        let mut first = ran_after.lock().unwrap();
                        if first.is_none() {
                            *first = Some(sent.max(returned).duration_since(returned));
                        }
                        done.store(true, Ordering::Relaxed);
                    }
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    let rps = latencies.len() as f64 / elapsed.as_secs_f64();
    let mut report = format!(
        "{} requests, {rps:.0} req/s, p50 {:?}, p99 {:?}",
        latencies.len(),
        at(0.50),
        at(0.99)
    );
    if back.is_some() {
        let first = *ran_after.lock().unwrap();
        report = format!(
            "first request run {first:?} after Redis answered again; answers other than \
             circuit_open: {:?}",
            outcomes.lock().unwrap()
        );
    }
    report
}
