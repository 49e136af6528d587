//! Store wrappers pass `Store::prepare` through to the store they wrap, alone and stacked: a
//! transactional store's transaction (`PgTx`) reaches the handler behind any of them, or its
//! writes would commit apart from the record (PROTOCOL.md §9.9).

use http::StatusCode;
use tower_idempotency::seal::{SealKey, SealKeys, SealedStore};
use tower_idempotency::store::{CircuitBreaker, ReplayCache, ScopeQuota, Store};
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore};
use tower_idempotency_test::{Faulty, Handler, Prepared, created, post, send, service};

/// Sends one claimed request through a layer over `store` and asserts that the handler found what
/// the innermost store's `prepare` put in the request.
async fn assert_prepare_reaches_the_handler<St>(name: &str, store: St)
where
    St: Store + Clone + std::fmt::Debug,
{
    let handler = Handler::ok(|call| {
        let prepared = call.parts.extensions.get::<Prepared>().is_some();
        created(format!("prepared {prepared}"))
    });
    let svc = service(IdempotencyLayer::new(store), handler);
    let reply = send(&svc, post("k", "x")).await;
    assert_eq!(
        (reply.status, reply.text()),
        (StatusCode::CREATED, "prepared true".into()),
        "§9.9: {name} passes prepare through to the store it wraps"
    );
}

fn inner() -> Faulty<MemoryStore> {
    Faulty::new(MemoryStore::new())
}

fn keys() -> SealKeys {
    SealKeys::new([SealKey::new("k1", [7; 32]).expect("a key")]).expect("keys")
}

#[tokio::test(start_paused = true)]
async fn every_wrapper_passes_prepare_through() {
    assert_prepare_reaches_the_handler("CircuitBreaker", CircuitBreaker::new(inner())).await;
    assert_prepare_reaches_the_handler("ScopeQuota", ScopeQuota::new(inner(), 1 << 20)).await;
    assert_prepare_reaches_the_handler("ReplayCache", ReplayCache::new(inner(), 10, 1 << 20)).await;
    assert_prepare_reaches_the_handler("SealedStore", SealedStore::new(inner(), keys())).await;
    assert_prepare_reaches_the_handler("BoxStore", BoxStore::new(inner())).await;
    let stacked = ReplayCache::new(
        CircuitBreaker::new(ScopeQuota::new(SealedStore::new(inner(), keys()), 1 << 20)),
        10,
        1 << 20,
    );
    assert_prepare_reaches_the_handler("a stack of every wrapper", stacked).await;
}
