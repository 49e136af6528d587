//! A store chosen at run time: `BoxStore` behind one `IdempotencyLayer<BoxStore>` and one app,
//! whatever the store, with every method forwarded (`prepare` included); and `BoxStore` and
//! `Arc<S>` each pass the whole store contract.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Extension;
use axum::routing::post;
use http::{Request, StatusCode, Uri};
use tower_idempotency::{BoxStore, IdempotencyLayer, MemoryStore, Outcome};
use tower_idempotency_test::{Counting, Faulty, Harness, Prepared, send};

/// The one app, built once for any store: `/v1/slow` takes two leases;
/// `/v1/charges/unavailable` answers 503 (not stored); every answer says whether the store's
/// `prepare` reached the request.
fn app(layer: IdempotencyLayer<BoxStore>, calls: Arc<AtomicUsize>) -> Router {
    let charge = move |uri: Uri, prepared: Option<Extension<Prepared>>| async move {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        if uri.path() == "/v1/slow" {
            tokio::time::sleep(Duration::from_secs(6)).await;
        }
        let status = if uri.path().ends_with("/unavailable") {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::CREATED
        };
        (status, format!("call {n} prepared {}", prepared.is_some()))
    };
    Router::new()
        .route("/v1/slow", post(charge.clone()))
        .route("/v1/charges/{kind}", post(charge))
        .route_layer(layer.lease(Duration::from_secs(3)))
}

/// What a configuration names: a store type known only at run time.
fn chosen(name: &str, counting: &Counting<MemoryStore>) -> BoxStore {
    match name {
        "memory" => BoxStore::new(MemoryStore::new()),
        "counting" => BoxStore::new(counting.clone()),
        "faulty" => BoxStore::new(Faulty::new(counting.clone())),
        "shared" => BoxStore::new(Arc::new(Faulty::new(counting.clone()))),
        other => panic!("no store named {other}"),
    }
}

fn charge(path: &str, key: &str) -> Request<Body> {
    Request::post(path)
        .header("idempotency-key", key)
        .body(Body::from("amount=100"))
        .expect("a request")
}

#[tokio::test(start_paused = true)]
async fn a_store_chosen_at_run_time_serves_one_app() {
    for name in ["memory", "counting", "faulty", "shared"] {
        let counting = Counting::new(MemoryStore::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let store = chosen(name, &counting);
        assert!(format!("{store:?}").contains("MemoryStore"), "{store:?}");
        let app = app(IdempotencyLayer::new(store), calls.clone());

        let first = send(&app, charge("/v1/charges/card", "k1")).await;
        assert_eq!(first.status, StatusCode::CREATED, "{name}");
        let replay = send(&app, charge("/v1/charges/card", "k1")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed), "{name}");
        assert_eq!(replay.body, first.body, "{name}");

        let unavailable = send(&app, charge("/v1/charges/unavailable", "k2")).await;
        assert_eq!(unavailable.outcome, Some(Outcome::NotStored), "{name}");
        let again = send(&app, charge("/v1/charges/unavailable", "k2")).await;
        assert_eq!(again.outcome, Some(Outcome::NotStored), "{name}: released");

        let slow = send(&app, charge("/v1/slow", "k3")).await;
        assert_eq!(slow.outcome, Some(Outcome::Executed), "{name}");
        assert_eq!(calls.load(Ordering::SeqCst), 4, "{name}");

        // `prepare` reaches the boxed store: Faulty's marks the request.
        let prepared = matches!(name, "faulty" | "shared");
        assert_eq!(
            first.text(),
            format!("call 1 prepared {prepared}"),
            "{name}"
        );
        if name != "memory" {
            let calls = counting.calls();
            // Claims: k1 twice, k2 twice, k3; completions: k1, k3; releases: k2 twice; and the
            // slow handler's lease (3 s) renewed every second of its 6 s.
            assert_eq!(
                (calls.claim, calls.complete, calls.release),
                (5, 2, 2),
                "{name}: {calls:?}"
            );
            assert!(calls.renew >= 5, "{name}: {calls:?}");
        }
    }
}

/// A boxed store fails as the store in it does: the layer's 503 and fail-open work through it.
#[tokio::test(start_paused = true)]
async fn a_boxed_store_fails_as_its_store_does() {
    let faulty = Faulty::new(MemoryStore::new());
    let app = app(
        IdempotencyLayer::new(BoxStore::new(faulty.clone())),
        Arc::default(),
    );
    faulty.fail(true);
    let refused = send(&app, charge("/v1/charges/card", "k")).await;
    assert_eq!(refused.outcome, Some(Outcome::StoreUnavailable));
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    faulty.fail(false);
    let served = send(&app, charge("/v1/charges/card", "k")).await;
    assert_eq!(served.outcome, Some(Outcome::Executed));
}

/// The memory store, boxed.
#[derive(Debug, Default)]
struct Boxed {
    store: MemoryStore,
}

impl Harness for Boxed {
    type Store = BoxStore;

    fn store(&self) -> BoxStore {
        BoxStore::new(self.store.clone())
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(24 * 60 * 60)
    }
}

/// The memory store, shared through an `Arc`.
#[derive(Debug, Default)]
struct Shared {
    store: Arc<MemoryStore>,
}

impl Harness for Shared {
    type Store = Arc<MemoryStore>;

    fn store(&self) -> Arc<MemoryStore> {
        self.store.clone()
    }

    fn lease(&self) -> Duration {
        Duration::from_secs(30)
    }

    fn window(&self) -> Duration {
        Duration::from_secs(24 * 60 * 60)
    }
}

mod boxed_contract {
    tower_idempotency_test::store_contract!(super::Boxed::default(), start_paused = true);
    tower_idempotency_test::layer_contract!(super::Boxed::default(), start_paused = true);
}

mod arc_contract {
    tower_idempotency_test::store_contract!(super::Shared::default(), start_paused = true);
    tower_idempotency_test::layer_contract!(super::Shared::default(), start_paused = true);
}
