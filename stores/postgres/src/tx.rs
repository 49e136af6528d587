//! Transactional completion: a claimed request's handler writes its rows in a transaction that
//! the store owns, and the store writes the completed record into that same transaction before
//! it commits. Committed: the effect and its record together. Rolled back, failed or crashed:
//! neither, and a retry runs cleanly.

use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::Extensions;
use sqlx::{PgConnection, Postgres, Transaction};
use tokio::sync::{Mutex as AsyncMutex, OwnedMappedMutexGuard, OwnedMutexGuard};

use super::{PgStore, PgStoreError, is_connection_failure, rejects_the_work};
use tower_idempotency::record::{ClaimToken, Fingerprint, RecordId};
use tower_idempotency::store::StoreError;

/// A claimed request's transaction: begun when the handler first asks for it.
pub(super) enum Lazy {
    Unbegun,
    Begun(Transaction<'static, Postgres>),
    /// Committed or rolled back by the store: the request's work is over.
    Ended,
}

type Shared = Arc<AsyncMutex<Lazy>>;

/// The transactions of this process's claimed requests whose work has not ended, by claim
/// token: `complete` and `release` find the request's transaction here.
#[derive(Default)]
pub(super) struct Open(Mutex<HashMap<ClaimToken, Shared>>);

impl Open {
    fn insert(&self, token: ClaimToken, lazy: Shared) {
        self.lock().insert(token, lazy);
    }

    /// The claim's transaction, taken out of the table: begun, or `None` when the handler never
    /// asked for one (the store then writes the record on its own).
    pub(super) fn take(&self, token: &ClaimToken) -> Option<Taken> {
        let lazy = self.lock().remove(token)?;
        let Ok(mut guard) = lazy.try_lock_owned() else {
            return Some(Taken::StillHeld);
        };
        match std::mem::replace(&mut *guard, Lazy::Ended) {
            Lazy::Begun(tx) => Some(Taken::Begun(tx)),
            Lazy::Unbegun | Lazy::Ended => None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ClaimToken, Shared>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A claim's transaction as `complete` or `release` finds it.
pub(super) enum Taken {
    Begun(Transaction<'static, Postgres>),
    /// The handler (or a task it started) still holds its [`PgTx`]: the transaction can only be
    /// rolled back, when that is dropped.
    StillHeld,
}

/// What [`PgStore`]'s `prepare` puts into a claimed request's extensions.
#[derive(Clone)]
struct Slot {
    store: PgStore,
    lazy: Shared,
}

impl PgStore {
    /// Begins a transaction for a handler, within the store's timeout.
    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        let timeout = self.inner.timeout;
        match tokio::time::timeout(timeout, self.inner.pool.begin()).await {
            Ok(Ok(tx)) => Ok(tx),
            Ok(Err(err)) => Err(StoreError::Unavailable(Box::new(PgStoreError::Database(
                err,
            )))),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }

    /// Writes the completed record in the handler's transaction and commits both, within the
    /// store's timeout. Whatever fails, the handler's writes are not reported as done: a
    /// transaction refused for a reason that sending it again cannot fix (see
    /// `rejects_the_work`) is [`StoreError::Rejected`], and any other that did not commit
    /// [`StoreError::Aborted`]; either way its claim is released, so that a retry runs at once.
    /// One whose commit may have landed (the connection failed while it was sent) keeps its claim,
    /// for the lease to settle: committed, a retry finds the record; not, the claim runs out and a
    /// retry runs again.
    pub(super) async fn commit_with(
        &self,
        mut tx: Transaction<'static, Postgres>,
        id: &RecordId,
        token: &ClaimToken,
        fingerprint: &Fingerprint,
        bytes: &[u8],
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let committing = AtomicBool::new(false);
        let resolve = async {
            if !self
                .complete_on(&mut tx, id, token, fingerprint, bytes, ttl)
                .await?
            {
                tx.rollback().await?;
                return Ok(false);
            }
            committing.store(true, Ordering::Relaxed);
            tx.commit().await.map(|()| true)
        };
        let timeout = self.inner.timeout;
        let (err, maybe_committed): (PgStoreError, bool) =
            match tokio::time::timeout(timeout, resolve).await {
                Ok(Ok(true)) => return Ok(true),
                Ok(Ok(false)) => {
                    return Err(StoreError::Aborted(
                        "the claim was lost before the commit (the key was claimed again, after \
                         its lease ran out or an operator forgot it): the handler's writes were \
                         rolled back"
                            .into(),
                    ));
                }
                Ok(Err(err)) => {
                    let at_commit = committing.load(Ordering::Relaxed);
                    if rejects_the_work(&err, at_commit) {
                        let _ = self.release_call(id, token).await;
                        return Err(StoreError::Rejected(Box::new(err)));
                    }
                    let unknown = at_commit && is_connection_failure(&err);
                    (self.statement_failed(err), unknown)
                }
                Err(_) => (
                    PgStoreError::Timeout(timeout),
                    committing.load(Ordering::Relaxed),
                ),
            };
        if !maybe_committed {
            let _ = self.release_call(id, token).await;
        }
        Err(StoreError::Aborted(Box::new(err)))
    }

    /// Offers a claimed request a transaction ([`PgTx`]) whose commit carries its record.
    pub(super) fn prepare_call(&self, token: &ClaimToken, extensions: &mut Extensions) {
        let lazy = Arc::new(AsyncMutex::new(Lazy::Unbegun));
        self.inner.open.insert(*token, lazy.clone());
        extensions.insert(Slot {
            store: self.clone(),
            lazy,
        });
    }
}

/// The handler's end of a claimed request's transaction, for a layer over a [`PgStore`]: what the
/// handler writes through it commits together with the request's idempotency record, or not at
/// all.
///
/// The transaction begins when the handler first takes it, on a connection of the store's pool.
/// The layer resolves it after the handler returned:
///
/// - a response the layer stores (by default 2xx, 3xx and the 4xx a handler decides, such as
///   402, but not a request refused as it was sent, such as 400 or 422; see
///   [`IdempotencyLayer::store_policy`](tower_idempotency::IdempotencyLayer::store_policy)): the
///   record is written in the transaction, and it commits. If it does not commit, nothing of it stays, the
///   claim is released, and the client never gets the response:
///   - when PostgreSQL refuses the handler's writes at the commit (SQLSTATE class 23: a deferred
///     foreign key, unique or exclusion constraint; 22: invalid data; 42: an object that does not
///     exist), or the transaction had already failed (a statement of the handler's failed and
///     the handler answered all the same), the client gets a 422 `commit-rejected`
///     ([`StoreError::Rejected`]), without `Retry-After`: sent again as it is, the request would
///     be refused again. Map it with the layer's `render_problems` or `problem_status`
///     ([`ProblemKind::CommitRejected`](tower_idempotency::problem::ProblemKind::CommitRejected)).
///     To answer a stored 4xx of the handler's own (a 402) after a statement failed, roll back to a
///     savepoint (`tx.begin()` on the `PgTx`'s connection) so that the transaction can still
///     commit;
///   - otherwise (a lost connection, a serialization failure or a deadlock, the claim lost
///     meanwhile), a 503 `store-unavailable` with `Retry-After` ([`StoreError::Aborted`]): its
///     retry runs the request again.
/// - any other response, an error or a panic: the transaction rolls back, and the claim is
///   released.
///
/// Drop it before the handler returns (take it by value in the handler's arguments): a
/// transaction still held when the layer resolves it is rolled back, and the client gets a 503.
///
/// # Writes outside the transaction
/// Only what the handler writes through the `PgTx` is undone with it. A write made another way
/// (through the pool, [`PgStore::pool`] or the application's own, another connection, another
/// service) commits on its own. When the run then fails (the handler errors, panics or answers a
/// status that is not stored, or the commit does not happen), that write stays, the claim is
/// released, and the retry runs the handler again, which makes the write a second time. Write
/// through the `PgTx`; where a write must go elsewhere, make it idempotent by the operation: a
/// unique constraint on a column keyed by the request (say
/// [`IdempotencyKey::derive`](tower_idempotency::IdempotencyKey::derive)), written with
/// `ON CONFLICT DO NOTHING`, so that the retry's write finds the first one.
/// With the `axum` feature it is an extractor; without, take it with
/// [`PgTx::from_extensions`].
///
/// ```no_run
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::IdempotencyLayer;
/// use tower_idempotency_postgres::{PgStore, PgTx};
///
/// async fn create_charge(mut tx: PgTx, body: String) -> Result<(StatusCode, String), StatusCode> {
///     sqlx::query("INSERT INTO charges (description) VALUES ($1)")
///         .bind(&body)
///         .execute(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     // Committed by the layer, with the record of this request's Idempotency-Key.
///     Ok((StatusCode::CREATED, body))
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PgStore::connect("postgres://app@127.0.0.1/payments")?;
/// store.migrate().await?;
/// let app: Router = Router::new()
///     .route("/v1/charges", post(create_charge).route_layer(IdempotencyLayer::new(store)));
/// # Ok(())
/// # }
/// ```
pub struct PgTx(OwnedMappedMutexGuard<Lazy, PgConnection>);

impl PgTx {
    /// The transaction of the claimed request whose extensions these are, begun now if the
    /// handler had not taken it yet.
    ///
    /// # Errors
    /// [`PgTxError`] when the request was not claimed through a [`PgStore`], when the
    /// transaction is taken already, or when it could not begin.
    pub async fn from_extensions(extensions: &Extensions) -> Result<Self, PgTxError> {
        let slot = extensions.get::<Slot>().ok_or(PgTxError::NotClaimed)?;
        let mut guard = slot
            .lazy
            .clone()
            .try_lock_owned()
            .map_err(|_| PgTxError::Taken)?;
        if matches!(*guard, Lazy::Unbegun) {
            *guard = Lazy::Begun(slot.store.begin().await?);
        }
        OwnedMutexGuard::try_map(guard, |lazy| match lazy {
            Lazy::Begun(tx) => Some(&mut **tx),
            Lazy::Unbegun | Lazy::Ended => None,
        })
        .map(Self)
        .map_err(|_| PgTxError::Ended)
    }
}

impl Deref for PgTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.0
    }
}

impl DerefMut for PgTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

impl AsMut<PgConnection> for PgTx {
    fn as_mut(&mut self) -> &mut PgConnection {
        &mut self.0
    }
}

impl fmt::Debug for PgTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgTx").finish_non_exhaustive()
    }
}

/// [`PgTx`] could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgTxError {
    /// The request was not claimed through a layer over a [`PgStore`]: the route is not behind
    /// the layer, the request has no key (and keys are optional), or the store failed at claim
    /// time and the layer fails open.
    #[error("this request was not claimed through a PgStore: no transaction to join")]
    NotClaimed,
    /// Another `PgTx` of this request is still alive.
    #[error("the request's transaction is taken already")]
    Taken,
    /// The request's work has ended: its transaction was resolved.
    #[error("the request's transaction has ended")]
    Ended,
    /// The transaction could not begin.
    #[error("the request's transaction could not begin")]
    Begin(#[source] StoreError),
}

impl From<StoreError> for PgTxError {
    fn from(err: StoreError) -> Self {
        Self::Begin(err)
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum_core::extract::FromRequestParts;
    use axum_core::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    use super::{PgTx, PgTxError};

    impl<S: Send + Sync> FromRequestParts<S> for PgTx {
        type Rejection = PgTxError;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, PgTxError> {
            PgTx::from_extensions(&parts.extensions).await
        }
    }

    /// A 500 (a 503 when the transaction could not begin): a handler that asks for a
    /// transaction cannot run without one.
    impl IntoResponse for PgTxError {
        fn into_response(self) -> Response {
            let status = match self {
                PgTxError::Begin(_) => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            tracing::error!(target: "tower_idempotency", error = %self, "no transaction for the handler");
            (status, self.to_string()).into_response()
        }
    }
}
