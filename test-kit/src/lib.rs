//! The store contract suite of [`tower-idempotency`](tower_idempotency): the cases every
//! [`Store`](tower_idempotency::store::Store) must pass, for stores written outside the workspace
//! as for its own.
//!
//! ```toml
//! [dev-dependencies]
//! tower-idempotency-test = "0.1"
//! # with the gRPC mode's case too: tower-idempotency-test = { version = "0.1", features = ["grpc"] }
//! ```
//!
//! Rust 1.95 or newer. A store is done when it passes this suite (the
//! [protocol](tower_idempotency::protocol)'s §10.7; §10 states what each store call must do).
//! Write a [`Harness`] for the store, then invoke [`store_contract!`](crate::store_contract) in an
//! integration test: it expands to one `#[tokio::test]` per rule of the contract, each with a
//! fresh harness. [`layer_contract!`](crate::layer_contract), opt-in, runs the layer over the
//! store too, end to end. The workspace's own `MemoryStore`, `RedisStore` and `PgStore` run both
//! exactly this way.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::MemoryStore;
//! use tower_idempotency_test::Harness;
//!
//! /// A store on tokio's clock, run on paused time: a 30 s lease and a 24 h window cost nothing.
//! #[derive(Debug)]
//! struct MyHarness {
//!     store: MemoryStore,
//! }
//!
//! impl Harness for MyHarness {
//!     type Store = MemoryStore;
//!
//!     fn store(&self) -> MemoryStore {
//!         self.store.clone()
//!     }
//!
//!     fn lease(&self) -> Duration {
//!         Duration::from_secs(30)
//!     }
//!
//!     fn window(&self) -> Duration {
//!         Duration::from_secs(24 * 60 * 60)
//!     }
//! }
//!
//! // In a test file of the store's crate (tests/my_store_contract.rs), this line is the whole
//! // contract: one test per rule.
//! tower_idempotency_test::store_contract!(MyHarness { store: MemoryStore::new() }, start_paused = true);
//! // And, opt-in, the layer over the store: one test per case.
//! tower_idempotency_test::layer_contract!(MyHarness { store: MemoryStore::new() }, start_paused = true);
//!
//! # fn main() {}
//! ```
//!
//! The generated tests use the calling crate's `tokio`: its dev-dependency needs the `macros` and
//! `rt` features, `test-util` for `start_paused = true`, and `rt-multi-thread` for
//! `flavor = "multi_thread"`.
//!
//! Every time-dependent case is written in terms of the harness's [`Harness::lease`],
//! [`Harness::window`] and [`Harness::advance`], never raw sleeps: a store on tokio's clock runs
//! on paused time with a 30 s lease and a 24 h window; a store with a clock of its own (a
//! database server, Redis) runs on real time with short ones (a 1 s lease and a 3 s window).
//!
//! The store contract's cases (`store_*`) call the [`Store`](tower_idempotency::store::Store)
//! methods directly. The layer contract's drive [`IdempotencyLayer`] over the store through a real
//! `axum::Router` or `tower::ServiceBuilder`, counting the inner service's calls (and, through
//! [`Counting`], the store's); some wrap the store in [`Faulty`] to make its calls fail, time out
//! or roll back. With this crate's `grpc` feature (which turns on `tower-idempotency`'s), the layer
//! contract also runs the gRPC mode's case: an answer replayed with its trailers.
//!
//! The module also holds what the cases are made of, for a store's own further tests: the
//! [`Counting`] and [`Faulty`] store wrappers, the counting [`Handler`] service, request builders,
//! and the [`Reply`] of a request.

#![forbid(unsafe_code)]

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tower::ServiceBuilder;

use tower_idempotency::store::OperatorStore;
use tower_idempotency::{Idempotency, IdempotencyLayer};

// Public for the contracts' expansions only: the cases are theirs, not an API.
#[doc(hidden)]
pub mod cases;
mod extended;
mod handler;
mod stores;

pub use extended::assert_extensions_a_release_does_not_know_are_skipped;
pub use handler::{
    Call, Handler, Reply, account_post, account_scope, assert_a_quota_keeps_a_flood_off_the_others,
    call, created, expect_one_execution, flood, gated_handler, keyed, pattern, post, respond, send,
    spawn_send, status_handler, status_request, streamed,
};
pub use stores::{Calls, Counting, Faulty, Prepared, StoreCall};

// The README's example, compiled as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// What a store needs to provide to run the contract.
pub trait Harness: Send + Sync + 'static {
    /// The store under test, with an operator's calls: the contract checks them too.
    type Store: OperatorStore + Clone + fmt::Debug;

    /// A handle onto this harness's storage: every call sees the same records; every harness
    /// instance starts empty.
    fn store(&self) -> Self::Store;

    /// The claim lease the cases configure.
    fn lease(&self) -> Duration;

    /// The dedup window the cases configure: at least two leases.
    fn window(&self) -> Duration;

    /// Lets `d` of time pass. Default: `tokio::time::sleep(d)`, which is instant on paused time
    /// (and, unlike one `tokio::time::advance` step, lets every timer in between fire in order, so
    /// lease renewals happen when they are due) and a real sleep otherwise.
    fn advance(&self, d: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(d)
    }
}

/// The store contract: expands, where it is invoked, to one `#[tokio::test]` per rule of
/// PROTOCOL §10 that a store must keep, each calling the store's methods directly with a fresh
/// harness from the first argument (evaluated inside the async test, so it may `.await`). The
/// other arguments are the `#[tokio::test]` attribute's:
///
/// - `store_contract!(MyHarness::new(), start_paused = true)`: paused time, for a store on
///   tokio's clock;
/// - `store_contract!(MyHarness::start().await, flavor = "multi_thread")`: real time, for a store
///   with a clock of its own (a server), on a multi-threaded runtime;
/// - `store_contract!(MyHarness::new())`: real time, on a current-thread runtime.
///
/// A store is done when it passes this. [`layer_contract!`](crate::layer_contract) runs the layer
/// over the store as well, end to end.
///
/// Call it as `tower_idempotency_test::store_contract!(...)`, or
/// `use tower_idempotency_test::store_contract;` first. The [crate documentation](crate) has a
/// complete example.
#[macro_export]
macro_rules! store_contract {
    ($harness:expr $(, $($attr:tt)*)?) => {
        $crate::__cases!(($harness) ($($($attr)*)?)
            store_claim_is_exclusive,
            store_claims_are_per_record_id,
            store_completed_record_is_returned_intact,
            store_tombstone_is_kept,
            store_completed_record_lives_for_its_ttl_not_the_lease,
            store_lease_expires_without_renewal,
            store_lease_left_is_more_than_zero_to_its_end,
            store_renew_extends_the_lease,
            store_release_frees_the_key,
            store_fencing_stops_an_owner_whose_lease_was_lost,
            store_completed_record_is_final,
            store_complete_sent_again_by_its_claim_is_written,
            store_complete_writes_a_missing_record_and_nothing_else_does,
            store_complete_after_the_lease_ran_out_writes_the_record,
            store_concurrent_claims_have_one_winner,
            store_fences_grow_with_every_claim_of_a_key,
            store_first_claims_are_numbered_by_the_clock,
            store_completed_record_keeps_its_trailers,
            store_inspect_reads_each_state,
            store_forget_frees_a_completed_key,
            store_forget_refuses_a_key_in_flight_unless_forced,
            store_completed_record_keeps_its_trace_origin,
        );
    };
}

/// The layer over the store: expands, where it is invoked, to one `#[tokio::test]` per case of
/// [`IdempotencyLayer`] driven over the store through a real `axum::Router` or
/// `tower::ServiceBuilder`: replays byte for byte, requests in flight, mismatches, handlers that
/// fail or panic, store failures (through [`Faulty`]), fences, trailers, waiting duplicates, the
/// options, sealed records and, with this crate's `grpc` feature, the gRPC mode. Opt-in for a
/// store's author: what the layer promises end to end, on this store. Its arguments are
/// [`store_contract!`](crate::store_contract)'s, and one more form:
///
/// - `layer_contract!(sealed: MyHarness::new(), start_paused = true)`: for a harness whose store
///   seals its records itself (a `SealedStore`): every case but the sealed-record ones, which
///   would seal its records a second time.
#[macro_export]
macro_rules! layer_contract {
    (sealed: $harness:expr $(, $($attr:tt)*)?) => {
        $crate::layer_contract!(@general ($harness) ($($($attr)*)?));
    };
    ($harness:expr $(, $($attr:tt)*)?) => {
        $crate::layer_contract!(@general ($harness) ($($($attr)*)?));
        $crate::__cases!(($harness) ($($($attr)*)?)
            // Sealed records.
            sealed_records_replay_and_keep_no_response_in_clear,
            a_sealed_record_with_a_changed_byte_is_never_replayed,
            a_sealed_record_moved_to_another_key_or_scope_does_not_open,
            rotated_keys_open_old_records_and_seal_new_ones,
            a_record_sealed_under_a_retired_key_is_never_replayed,
            records_in_clear_and_sealed_records_without_keys_are_not_replayed,
            a_sealed_record_keeps_its_trace_origin_inside_the_seal,
        );
    };
    (@general ($harness:expr) $attrs:tt) => {
        $crate::__grpc_cases!(($harness) $attrs);
        $crate::__cases!(($harness) $attrs
            replay_is_byte_identical_through_a_router,
            replay_is_byte_identical_through_service_builder,
            in_flight_request_gets_409_then_the_replay,
            retry_after_never_goes_beyond_the_lease,
            different_request_with_the_same_key_gets_422,
            responses_that_are_not_stored_run_again,
            responses_that_are_stored_replay,
            replay_drops_cookies_hop_by_hop_headers_and_date,
            oversized_response_is_delivered_and_leaves_a_tombstone,
            panicking_handler_gets_500_and_a_retry_runs_again,
            failing_handler_gets_500_and_releases_the_claim,
            dropped_request_runs_to_completion_and_shutdown_waits_for_it,
            slow_handler_keeps_its_claim_past_the_lease,
            renewals_lost_to_a_short_fault_keep_the_claim,
            key_is_new_again_after_the_dedup_window,
            scopes_never_see_each_others_records,
            concurrent_requests_with_one_key_run_once,
            concurrent_requests_with_distinct_keys_all_run,
            store_failure_at_claim_fails_closed_with_503,
            store_failure_at_claim_fails_open_when_configured,
            fail_open_never_runs_over_a_record_the_store_cannot_decode,
            the_store_alone_bounds_a_claim,
            failed_store_write_still_answers_and_is_retried,
            an_aborted_completion_is_not_reported_as_done,
            store_write_failing_past_the_lease_lands_when_the_store_returns,
            completions_failing_while_renewals_work_keep_the_claim,
            retried_write_gives_up_once_another_claim_holds_the_key,
            a_displaced_handler_learns_it_and_has_the_smaller_fence,
            a_running_handler_still_holds_its_claim,
            trailers_are_stored_and_replayed,
            trailers_count_against_the_response_limit,
            // Opt-in options.
            the_record_keeps_the_first_runs_trace_origin,
            retention_header_states_the_records_expiry,
            retention_header_takes_a_name_and_format,
            retention_header_on_a_409_in_flight_is_a_window_from_now,
            a_scope_past_its_quota_leaves_the_others_untouched,
            a_waiting_duplicate_gets_the_replay,
            a_duplicate_past_the_wait_bound_gets_409,
            retry_after_a_wait_is_the_lease_left_less_the_wait,
            many_waiters_cost_a_bounded_number_of_store_calls,
            a_waiter_that_goes_away_leaves_nothing_behind,
            a_waiter_runs_when_the_first_request_is_released,
        );
    };
}

/// One `#[tokio::test]` per named case, each with a fresh harness.
#[doc(hidden)]
#[macro_export]
macro_rules! __cases {
    (($harness:expr) $attrs:tt $($case:ident),* $(,)?) => {
        $(
            #[tokio::test $attrs]
            async fn $case() {
                $crate::cases::$case($harness).await;
            }
        )*
    };
}

/// The gRPC mode's cases of [`layer_contract!`], with this crate's `grpc` feature.
#[cfg(feature = "grpc")]
#[doc(hidden)]
#[macro_export]
macro_rules! __grpc_cases {
    ($harness:tt $attrs:tt) => {
        $crate::__cases!($harness $attrs
            grpc_answers_replay_with_their_trailers,
        );
    };
}

/// Without the `grpc` feature, no gRPC cases.
#[cfg(not(feature = "grpc"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __grpc_cases {
    ($harness:tt $attrs:tt) => {};
}

/// A margin well inside the lease, for "just before" and "just after" a deadline.
pub fn margin<H: Harness>(h: &H) -> Duration {
    h.lease() / 4
}

/// A layer over `store` with the harness's lease and dedup window.
pub fn layer<H: Harness, St>(h: &H, store: St) -> IdempotencyLayer<St> {
    IdempotencyLayer::new(store)
        .lease(h.lease())
        .dedup_window(h.window())
}

/// `inner` behind `layer`, through `tower::ServiceBuilder`.
pub fn service<St: Clone, S>(layer: IdempotencyLayer<St>, inner: S) -> Idempotency<S, St> {
    ServiceBuilder::new().layer(layer).service(inner)
}

/// Whole seconds, rounded up.
pub fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}
