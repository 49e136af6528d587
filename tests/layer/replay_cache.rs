//! The replay cache (`store::ReplayCache`), on a counting `MemoryStore` and paused
//! time: a replay of a record this process completed makes no store call, answers exactly as the
//! store would (replay, 422), dies with the record, stays within its bounds, and never crosses
//! scopes. PROTOCOL.md §6.7.

use std::time::Duration;

use axum::body::Body;
use http::{Method, StatusCode};
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::store::ReplayCache;
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome, Scope};
use tower_idempotency_test::{
    Counting, Faulty, Handler, StoreCall, created, keyed, post, send, service,
};

type Store = Counting<MemoryStore>;

fn store() -> Store {
    Counting::new(MemoryStore::new())
}

fn echo() -> Handler {
    Handler::ok(|call| created(format!("call {}", call.n)))
}

fn cached(store: &Store) -> IdempotencyLayer<ReplayCache<Store>> {
    IdempotencyLayer::new(ReplayCache::new(store.clone(), 100, 1 << 20))
}

#[tokio::test(start_paused = true)]
async fn a_replay_through_the_cache_makes_no_store_call() {
    let store = store();
    let handler = echo();
    let svc = service(cached(&store), handler.clone());

    let first = send(&svc, post("k", "x")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let after_first = store.calls();

    for _ in 0..3 {
        let replay = send(&svc, post("k", "x")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert!(replay.is_replay());
        assert_eq!(
            (replay.status, &replay.body[..]),
            (first.status, &b"call 1"[..])
        );
        assert_eq!(replay.header_list(), first.header_list());
    }
    assert_eq!(store.calls(), after_first, "no store call for the replays");
    assert_eq!(handler.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn off_by_default_every_replay_asks_the_store() {
    let store = store();
    let svc = service(IdempotencyLayer::new(store.clone()), echo());

    send(&svc, post("k", "x")).await;
    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(store.calls().claim, 2);
}

#[tokio::test(start_paused = true)]
async fn a_different_request_with_the_key_still_gets_422() {
    let store = store();
    let handler = echo();
    let svc = service(cached(&store), handler.clone());

    send(&svc, post("k", "x")).await;
    let calls = store.calls();
    let other = send(&svc, post("k", "another body")).await;
    other.assert_problem(ProblemKind::Mismatch, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(store.calls(), calls, "answered from the cache");
    assert_eq!(handler.calls(), 1);
}

/// The copy's deadline is the window from before the completion was written: at that moment the
/// cache no longer answers, and the request reaches the store (which has forgotten it too).
#[tokio::test(start_paused = true)]
async fn the_entry_dies_with_the_record() {
    let window = Duration::from_secs(10);
    let store = store();
    let handler = echo();
    let svc = service(cached(&store).dedup_window(window), handler.clone());

    send(&svc, post("k", "x")).await;
    let calls = store.calls();
    tokio::time::advance(window - Duration::from_millis(1)).await;
    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(store.calls(), calls);

    tokio::time::advance(Duration::from_millis(1)).await;
    let again = send(&svc, post("k", "x")).await;
    assert_eq!(store.calls().claim, calls.claim + 1, "the cache let it go");
    assert_eq!(again.outcome, Some(Outcome::Executed));
    assert_eq!(&again.body[..], b"call 2");
}

#[tokio::test(start_paused = true)]
async fn the_entry_bound_evicts() {
    let store = store();
    let svc = service(
        IdempotencyLayer::new(ReplayCache::new(store.clone(), 2, 1 << 20)),
        echo(),
    );
    let keys: Vec<String> = (0..6).map(|n| format!("k{n}")).collect();
    for key in &keys {
        send(&svc, post(key, "x")).await;
    }
    let claims = store.calls().claim;
    for key in &keys {
        let replay = send(&svc, post(key, "x")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
    }
    // At most two of the six are cached: the other four ask the store.
    assert!(store.calls().claim - claims >= 4, "{:?}", store.calls());
}

#[tokio::test(start_paused = true)]
async fn a_response_larger_than_the_byte_bound_is_not_cached() {
    let store = store();
    let large = Handler::ok(|_| created(vec![b'x'; 4096]));
    let svc = service(
        IdempotencyLayer::new(ReplayCache::new(store.clone(), 100, 1024)),
        large,
    );
    send(&svc, post("k", "x")).await;
    let replay = send(&svc, post("k", "x")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body.len(), 4096);
    assert_eq!(store.calls().claim, 2);
}

#[tokio::test(start_paused = true)]
async fn scopes_never_share_entries() {
    let store = store();
    let handler = echo();
    let layer = cached(&store).scope(|parts: &http::request::Parts| {
        let account = parts
            .headers
            .get("x-account")
            .map(|v| v.as_bytes().to_vec());
        Ok(Scope::from(account.unwrap_or_default()))
    });
    let svc = service(layer, handler.clone());
    let request = |account: &str| {
        keyed(Method::POST, "/", "k")
            .header("x-account", account)
            .body(Body::from("x"))
            .expect("a request")
    };

    let first = send(&svc, request("acct_1")).await;
    let other = send(&svc, request("acct_2")).await;
    assert_eq!(other.outcome, Some(Outcome::Executed));
    assert_eq!(
        (&first.body[..], &other.body[..]),
        (&b"call 1"[..], &b"call 2"[..])
    );

    let calls = store.calls();
    for (account, body) in [("acct_1", "call 1"), ("acct_2", "call 2")] {
        let replay = send(&svc, request(account)).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert_eq!(replay.text(), body);
    }
    assert_eq!(store.calls(), calls);
    assert_eq!(handler.calls(), 2);
}

/// A completion whose answer comes back late (the store wrote it at once): the copy's window
/// counts from before the write was sent, so it never outlives the store's record, however long
/// the answer took.
#[tokio::test(start_paused = true)]
async fn a_copy_never_outlives_the_record_when_the_answer_is_slow() {
    let window = Duration::from_secs(10);
    let store = Faulty::new(MemoryStore::new());
    store.delay_answer(StoreCall::Complete, Some(Duration::from_secs(1)));
    let handler = echo();
    let layer = IdempotencyLayer::new(ReplayCache::new(store.clone(), 100, 1 << 20));
    let svc = service(layer.dedup_window(window), handler.clone());

    send(&svc, post("k", "x")).await;
    // The record was written at 0 s and the answer came at 1 s: the record is gone at 10 s.
    tokio::time::sleep(window - Duration::from_secs(1) + Duration::from_millis(1)).await;
    store.delay_answer(StoreCall::Complete, None);
    let again = send(&svc, post("k", "x")).await;
    assert_eq!(
        (again.outcome, &again.body[..]),
        (Some(Outcome::Executed), &b"call 2"[..]),
        "§6.7: past the record's window, this process runs the key again, as the store does"
    );
}

/// A completion the store refused (another run's record holds the key: this claim's lease ran
/// out) is not cached: this process replays the record the store holds, as every other does.
#[tokio::test(start_paused = true)]
async fn a_refused_completion_is_not_cached() {
    let lease = Duration::from_secs(3);
    let store = Faulty::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(ReplayCache::new(store.clone(), 100, 1 << 20)).lease(lease);
    let shutdown = layer.shutdown_handle();
    let here = service(layer, Handler::ok(|_| created("here")));
    let elsewhere = service(
        IdempotencyLayer::new(store.inner().clone()).lease(lease),
        Handler::ok(|_| created("elsewhere")),
    );

    // Here, the handler runs, and every write fails past the lease.
    store.fail_writes(true);
    assert_eq!(send(&here, post("k", "x")).await.text(), "here");
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    // Another instance claims the key and stores its run; then this one's write is refused.
    let other = send(&elsewhere, post("k", "x")).await;
    assert_eq!(other.outcome, Some(Outcome::Executed), "{other:?}");
    store.fail_writes(false);
    shutdown.wait().await;

    let replay = send(&here, post("k", "x")).await;
    assert_eq!(
        (replay.outcome, replay.text()),
        (Some(Outcome::Replayed), "elsewhere".into()),
        "§6.7: this process replays the record the store holds"
    );
}

/// A copy replays with the stored trailers, as the store's record does (a gRPC answer's status
/// is a trailer).
#[tokio::test(start_paused = true)]
async fn a_copy_replays_with_its_trailers() {
    let store = store();
    let handler = Handler::ok(|_| {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        let frames = [
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(bytes::Bytes::from_static(
                b"done",
            ))),
            Ok(http_body::Frame::trailers(trailers)),
        ];
        let body = Body::new(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )));
        http::Response::new(body)
    });
    let svc = service(cached(&store), handler.clone());
    for n in 0..3 {
        let response = tower::ServiceExt::oneshot(svc.clone(), post("k", "x"))
            .await
            .expect("an answer");
        let collected = http_body_util::BodyExt::collect(response.into_body())
            .await
            .expect("a body");
        let grpc_status = collected
            .trailers()
            .and_then(|t| t.get("grpc-status").cloned());
        assert_eq!(
            grpc_status.as_ref().map(|v| v.as_bytes()),
            Some(&b"0"[..]),
            "answer {n}"
        );
        assert_eq!(&collected.to_bytes()[..], b"done");
    }
    assert_eq!(handler.calls(), 1);
}
