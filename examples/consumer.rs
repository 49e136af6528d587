//! The idempotent consumer: a queue that delivers at least once, a `Deduplicator` that makes the
//! work happen once per message id. The queue here is a channel that sends every message twice,
//! as a queue does when an ack is lost.
//!
//! ```text
//! cargo run --example consumer
//! # evt_1: done (balance 100)
//! # evt_1: duplicate, skipped
//! # evt_2: done (balance 350)
//! # evt_2: duplicate, skipped
//! # evt_3: failed (the ledger database is away); no ack: the queue delivers it again
//! # evt_3: done (balance 400)
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};

use tower_idempotency::MemoryStore;
use tower_idempotency::consumer::{DedupError, Deduplicator, Processed};

/// An event of the ledger: an amount to add to the balance.
#[derive(Debug, Clone)]
struct Event {
    id: &'static str,
    amount: i64,
}

#[tokio::main]
async fn main() {
    // Records in memory; with a RedisStore or PgStore every consumer of the group shares them.
    let dedup = Deduplicator::new(MemoryStore::new(), "ledger-consumer");
    let balance = Arc::new(AtomicI64::new(0));
    let flaky = AtomicU32::new(0);

    let (queue, mut deliveries) = tokio::sync::mpsc::unbounded_channel();
    for (id, amount) in [("evt_1", 100), ("evt_2", 250), ("evt_3", 50)] {
        // At least once: every event arrives twice.
        for _ in 0..2 {
            queue
                .send(Event { id, amount })
                .expect("the receiver is here");
        }
    }
    drop(queue);

    while let Some(event) = deliveries.recv().await {
        let outcome = dedup
            .process(event.id, || async {
                // evt_3's first attempt fails: its claim is released, and the redelivery runs it.
                if event.id == "evt_3" && flaky.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err("the ledger database is away");
                }
                Ok(balance.fetch_add(event.amount, Ordering::SeqCst) + event.amount)
            })
            .await;
        match outcome {
            Ok(Processed::Done(total)) => println!("{}: done (balance {total})", event.id),
            Ok(Processed::Duplicate) => println!("{}: duplicate, skipped", event.id),
            Ok(other) => println!("{}: {other:?}, not acked", event.id),
            Err(DedupError::Failed(err)) => {
                println!(
                    "{}: failed ({err}); no ack: the queue delivers it again",
                    event.id
                );
            }
            Err(err) => println!("{}: {err}; no ack", event.id),
        }
    }
    assert_eq!(
        balance.load(Ordering::SeqCst),
        400,
        "each event applied once"
    );
}
