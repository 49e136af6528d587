//! A memory ledger belongs to one process. With the layer's records in a store that other
//! processes share (Redis), an instance whose charges are in memory holds a lease on a record of
//! its own there for as long as it runs; a second such instance on the same store finds it held
//! and refuses to start, rather than keep a second ledger that would refund one charge twice.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower_idempotency::BoxStore;
use tower_idempotency::record::{Fingerprint, RecordId};
use tower_idempotency::store::{Claim, Store};

/// How long the hold outlives a process that stopped without letting it go.
pub(crate) const LEASE: Duration = Duration::from_secs(10);

/// Holds the store's one memory-ledger lease until `stop`, then lets it go; refuses, with what to
/// do, when another instance holds it.
pub(crate) async fn hold(
    store: BoxStore,
    stop: CancellationToken,
) -> Result<JoinHandle<()>, String> {
    // The record every memory-ledger instance on one store claims.
    let id = RecordId::new(b"example-payments", "memory-ledger");
    let fingerprint = Fingerprint::from_bytes([0; 32]);
    let mut token = match store.claim(&id, &fingerprint, LEASE).await {
        Ok(Claim::Claimed(token)) => token,
        Ok(Claim::Existing(_)) => {
            return Err(format!(
                "another instance keeps its charges in memory beside these idempotency records: a \
                 memory ledger belongs to one process, and two would each move the same money. \
                 Set DATABASE_URL to share one PostgreSQL ledger between instances, or give this \
                 instance a Redis of its own; if the other instance has stopped, its hold runs \
                 out within {LEASE:?}"
            ));
        }
        Err(err) => {
            let why = crate::report(&err);
            return Err(format!("cannot use the idempotency store: {why}"));
        }
    };
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep(LEASE / 3) => {}
            }
            match store.renew(&id, &token, LEASE).await {
                Ok(true) => {}
                // Lost (the store restarted empty, say): taken again, unless another instance
                // started meanwhile, which an operator must stop.
                Ok(false) => match store.claim(&id, &fingerprint, LEASE).await {
                    Ok(Claim::Claimed(again)) => token = again,
                    _ => tracing::error!(
                        "the memory ledger's hold on the idempotency store was lost, and another \
                         instance may hold it now: stop one of them"
                    ),
                },
                Err(err) => {
                    tracing::warn!(error = %crate::report(&err), "cannot renew the memory ledger's hold")
                }
            }
        }
        let _ = store.release(&id, &token).await;
    }))
}
