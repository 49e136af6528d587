//! The store contract on [`MemoryStore`], on paused tokio time, run as any store runs it (the
//! exported suite, `tower_idempotency_test`), plus what only the memory store does (it refuses
//! new claims when full).

use std::time::Duration;

use http::Method;
use tower_idempotency::problem::ProblemKind;
use tower_idempotency::{IdempotencyLayer, MemoryStore, Outcome, Scope};
use tower_idempotency_test::{
    Counting, Handler, Harness, Reply, created, keyed, post, send, service,
};

/// The memory store on paused tokio time: a 30 s lease and a 24 h dedup window.
#[derive(Debug)]
struct MemoryHarness {
    store: MemoryStore,
}

impl MemoryHarness {
    fn new() -> Self {
        Self {
            store: MemoryStore::new(),
        }
    }
}

impl Harness for MemoryHarness {
    type Store = MemoryStore;

    fn store(&self) -> MemoryStore {
        self.store.clone()
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(24 * 60 * 60)
    }

    // `advance` is the default: a sleep, instant on paused time.
}

tower_idempotency_test::store_contract!(MemoryHarness::new(), start_paused = true);
tower_idempotency_test::layer_contract!(MemoryHarness::new(), start_paused = true);

/// A full memory store refuses new claims with 503 rather than evict a live record: earlier keys
/// still replay. Once records expire, new claims work again.
#[tokio::test(start_paused = true)]
async fn full_memory_store_refuses_new_claims_with_503() {
    let store = Counting::new(MemoryStore::with_capacity(2_000));
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let window = Duration::from_secs(60);
    let svc = service(
        IdempotencyLayer::new(store.clone()).dedup_window(window),
        handler.clone(),
    );

    let mut stored = Vec::new();
    let full = loop {
        let key = format!("key-{}", stored.len());
        let reply = send(&svc, post(&key, "x")).await;
        if reply.outcome != Some(Outcome::Executed) {
            break reply;
        }
        stored.push((key, reply));
        assert!(stored.len() < 100, "a 2 000-byte store never filled up");
    };
    full.assert_problem(
        ProblemKind::StoreUnavailable,
        http::StatusCode::SERVICE_UNAVAILABLE,
    );
    assert_eq!(full.outcome, Some(Outcome::StoreUnavailable));
    // Room frees when the first record comes due, a window after it was stored: the client is
    // told so, not to come back in a second.
    assert_eq!(full.header("retry-after"), Some("60"));
    assert!(stored.len() >= 2, "only {} records fitted", stored.len());
    assert_eq!(
        handler.calls(),
        stored.len(),
        "the refused request did not run"
    );
    assert_eq!(store.inner().len(), stored.len(), "nothing was evicted");
    for (key, first) in &stored {
        let replay = send(&svc, post(key, "x")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{key}");
        assert_eq!(replay.body, first.body);
    }

    tokio::time::sleep(window + Duration::from_secs(1)).await;
    let reply = send(&svc, post("after-expiry", "x")).await;
    assert_eq!(reply.outcome, Some(Outcome::Executed));
}

/// With a per-scope limit, one tenant that floods the store with new keys fills only its own
/// share: it is refused with a `Retry-After` that says when its first record comes due, and every
/// other tenant is still served. Without the limit, the flood locks the others out.
#[tokio::test(start_paused = true)]
async fn one_scope_filling_its_share_leaves_other_scopes_served() {
    let window = Duration::from_secs(600);
    let handler = Handler::ok(|call| created(format!("call {}", call.n)));
    let scoped = |store: MemoryStore| {
        let layer = IdempotencyLayer::new(store).dedup_window(window).scope(
            |parts: &http::request::Parts| {
                Ok(Scope::from(parts.uri.path().trim_start_matches('/')))
            },
        );
        service(layer, handler.clone())
    };
    let charge = |tenant: &str, key: &str| {
        keyed(Method::POST, &format!("/{tenant}"), key)
            .body(axum::body::Body::from("x"))
            .expect("a request")
    };
    let capacity = 20_000;

    // Without a limit: the flood takes everything.
    let svc = scoped(MemoryStore::with_capacity(capacity));
    let flood = |svc| async move {
        let mut n = 0;
        loop {
            let reply: Reply = send(&svc, charge("flooder", &format!("key-{n}"))).await;
            if reply.outcome != Some(Outcome::Executed) {
                return (n, reply);
            }
            n += 1;
            assert!(n < 1_000, "the store never filled up");
        }
    };
    let (_, refused) = flood(svc.clone()).await;
    assert_eq!(refused.outcome, Some(Outcome::StoreUnavailable));
    let other = send(&svc, charge("bystander", "key-0")).await;
    assert_eq!(other.outcome, Some(Outcome::StoreUnavailable));

    // With each scope held to a tenth of the store: the flood fills its share, no more.
    let store = MemoryStore::with_capacity(capacity).with_scope_limit(capacity / 10);
    let svc = scoped(store.clone());
    let (stored, refused) = flood(svc.clone()).await;
    assert!(stored >= 2, "only {stored} records fitted in the share");
    assert!(
        store.used_bytes() <= capacity / 10,
        "{} bytes",
        store.used_bytes()
    );
    refused.assert_problem(
        ProblemKind::StoreUnavailable,
        http::StatusCode::SERVICE_UNAVAILABLE,
    );
    assert_eq!(refused.header("retry-after"), Some("600"));
    for tenant in ["bystander", "another"] {
        let reply = send(&svc, charge(tenant, "key-0")).await;
        assert_eq!(reply.outcome, Some(Outcome::Executed), "{tenant}");
    }
    // The flooder's records still replay; a minute on, its refusal says a minute less.
    let replay = send(&svc, charge("flooder", "key-0")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    tokio::time::sleep(Duration::from_secs(60)).await;
    let refused = send(&svc, charge("flooder", "one-more")).await;
    assert_eq!(refused.header("retry-after"), Some("540"));
    // Once its records come due, it is served again.
    tokio::time::sleep(window).await;
    let reply = send(&svc, charge("flooder", "after-the-window")).await;
    assert_eq!(reply.outcome, Some(Outcome::Executed));
}
