//! When the memory store's records come due: one FIFO lane per duration.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use crate::record::RecordId;

/// How many distinct durations get an expiry lane of their own in each shard; items with any other
/// duration share a heap.
pub(super) const LANES: usize = 8;

/// Expiry times, each taken out once it is due.
///
/// A store is used with a few fixed durations (a layer's lease and dedup window), and items queued
/// with one duration under the shard's lock come due in the order they were queued. So each
/// duration gets a FIFO lane: pushing and popping are O(1) and touch memory in order. A binary
/// heap of all the items would take a cache miss per level to pop, once per request, from a queue
/// of millions. Durations beyond the first [`LANES`] share such a heap.
///
/// An item in a lane is cancelled in place when its entry's expiry changes (a claim completes) or
/// the entry goes, so that collecting it later needs no lookup in a map far larger than the
/// caches: every new key's lease item would otherwise cost one.
#[derive(Debug, Default)]
pub(super) struct Expiry {
    pub(super) lanes: Vec<Lane>,
    pub(super) heap: BinaryHeap<Reverse<(Instant, RecordId)>>,
}

#[derive(Debug)]
pub(super) struct Lane {
    after: Duration,
    /// The sequence number of the item at the front of `queue`.
    front: u64,
    pub(super) queue: VecDeque<Due>,
}

/// A queued expiry; `id` is `None` once cancelled.
#[derive(Debug)]
pub(super) struct Due {
    at: Instant,
    id: Option<RecordId>,
}

/// Where an item sits in the lanes: its lane and sequence number.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ticket {
    lane: usize,
    seq: u64,
}

impl Expiry {
    /// Queues `id` to come due at `at`, which is `after` from now. Returns where it sits, unless
    /// it went to the shared heap (which cannot cancel).
    pub(super) fn push(&mut self, after: Duration, at: Instant, id: RecordId) -> Option<Ticket> {
        let index = match self.lanes.iter().position(|lane| lane.after == after) {
            Some(index) => index,
            None if self.lanes.len() < LANES => {
                self.lanes.push(Lane {
                    after,
                    front: 0,
                    queue: VecDeque::new(),
                });
                self.lanes.len() - 1
            }
            None => {
                self.heap.push(Reverse((at, id)));
                return None;
            }
        };
        let lane = &mut self.lanes[index];
        // Times are read under the shard's lock, so they arrive in order; should the clock ever
        // step back, the item comes due with the one before it, and the entry's own time still
        // decides whether it is live.
        let at = lane.queue.back().map_or(at, |last| at.max(last.at));
        lane.queue.push_back(Due { at, id: Some(id) });
        Some(Ticket {
            lane: index,
            seq: lane.front + (lane.queue.len() as u64 - 1),
        })
    }

    /// Cancels the item at `ticket`, if it is still queued.
    pub(super) fn cancel(&mut self, ticket: Option<Ticket>) {
        let Some(Ticket { lane, seq }) = ticket else {
            return;
        };
        let lane = &mut self.lanes[lane];
        if let Some(index) = seq.checked_sub(lane.front)
            && let Some(due) = usize::try_from(index)
                .ok()
                .and_then(|index| lane.queue.get_mut(index))
        {
            due.id = None;
        }
    }

    /// When the next item comes due, dropping the cancelled items at the lanes' fronts.
    pub(super) fn next_due(&mut self) -> Option<Instant> {
        let lanes = self.lanes.iter_mut().filter_map(|lane| {
            while lane.queue.front().is_some_and(|due| due.id.is_none()) {
                lane.queue.pop_front();
                lane.front += 1;
            }
            lane.queue.front().map(|due| due.at)
        });
        let heap = self.heap.peek().map(|Reverse((at, _))| *at);
        lanes.chain(heap).min()
    }

    /// Takes out one item that is due by `now`, dropping the cancelled items ahead of it.
    pub(super) fn pop_due(&mut self, now: Instant) -> Option<RecordId> {
        for lane in &mut self.lanes {
            while let Some(due) = lane.queue.front() {
                let (at, id) = (due.at, due.id);
                if id.is_some() && at > now {
                    break;
                }
                lane.queue.pop_front();
                lane.front += 1;
                if id.is_some() {
                    return id;
                }
            }
        }
        if self.heap.peek().is_some_and(|Reverse((at, _))| *at <= now) {
            return self.heap.pop().map(|Reverse((_, id))| id);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn durations_beyond_the_lanes_share_the_heap() {
        let mut expiry = Expiry::default();
        let now = Instant::now();
        let id = RecordId::new(b"", "k");
        for seconds in 1..=LANES as u64 * 2 {
            let after = Duration::from_secs(seconds);
            let ticket = expiry.push(after, now + after, id);
            assert_eq!(ticket.is_some(), seconds <= LANES as u64, "{seconds} s");
        }
        assert_eq!(expiry.lanes.len(), LANES);
        assert_eq!(expiry.heap.len(), LANES);
        // Each item comes due at its own time, in a lane or in the heap.
        for seconds in 1..=LANES as u64 * 2 {
            assert_eq!(expiry.pop_due(now + Duration::from_secs(seconds)), Some(id));
            assert_eq!(expiry.pop_due(now + Duration::from_secs(seconds)), None);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lane_stays_in_order_when_a_time_arrives_late() {
        let mut expiry = Expiry::default();
        let now = Instant::now();
        let lease = Duration::from_secs(10);
        let (a, b) = (RecordId::new(b"", "a"), RecordId::new(b"", "b"));
        expiry.push(lease, now + lease, a);
        // An earlier time behind a later one comes due with the later one, not before.
        expiry.push(lease, now + Duration::from_secs(5), b);
        assert_eq!(expiry.pop_due(now + Duration::from_secs(5)), None);
        assert_eq!(expiry.pop_due(now + lease), Some(a));
        assert_eq!(expiry.pop_due(now + lease), Some(b));
        assert_eq!(expiry.pop_due(now + lease), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_item_never_comes_due() {
        let mut expiry = Expiry::default();
        let now = Instant::now();
        let lease = Duration::from_secs(10);
        let (a, b) = (RecordId::new(b"", "a"), RecordId::new(b"", "b"));
        let ticket = expiry.push(lease, now + lease, a);
        expiry.push(lease, now + lease, b);
        expiry.cancel(ticket);
        assert_eq!(expiry.pop_due(now + lease), Some(b));
        assert_eq!(expiry.pop_due(now + lease), None);
        // A ticket whose item has gone cancels nothing.
        expiry.cancel(ticket);
        let c = RecordId::new(b"", "c");
        expiry.push(lease, now + lease, c);
        assert_eq!(expiry.pop_due(now + lease), Some(c));
    }

    /// A ticket finds its own item after items ahead of it were taken out or dropped: the lane
    /// counts what left its front.
    #[tokio::test(start_paused = true)]
    async fn a_ticket_cancels_its_own_item_after_the_front_moved() {
        let mut expiry = Expiry::default();
        let now = Instant::now();
        let lease = Duration::from_secs(30);
        let ids: Vec<RecordId> = (0..4).map(|n| RecordId::new(b"", &n.to_string())).collect();
        let tickets: Vec<_> = (ids.iter())
            .map(|id| expiry.push(lease, now + lease, *id))
            .collect();
        // Taken out: the front moves past the first.
        assert_eq!(expiry.pop_due(now + lease), Some(ids[0]));
        expiry.cancel(tickets[1]);
        // Dropped as cancelled: the front moves past the second.
        assert_eq!(expiry.next_due(), Some(now + lease));
        expiry.cancel(tickets[3]);
        assert_eq!(expiry.pop_due(now + lease), Some(ids[2]));
        assert_eq!(expiry.pop_due(now + lease), None);
        assert_eq!(expiry.next_due(), None);
    }
}
