//! The charge state machine: every allowed transition, in one table.
//!
//! ```text
//! created ─authorize─▶ authorizing ─approved─▶ authorized ─capture─▶ capturing ─captured─▶ captured
//!                      authorizing ─declined─▶ failed
//!                                              authorized ─cancel──▶ canceling ─canceled─▶ canceled
//! captured ─refund─▶ refunding ─partially_refunded─▶ captured
//!                    refunding ─refunded───────────▶ refunded
//! ```
//!
//! The `-ing` states are held while the payment provider is called: a second request on the same
//! charge (with another idempotency key) finds the charge busy and gets `invalid_state` instead of
//! a second provider call. When the provider does nothing (it is unavailable, or it knows the key
//! from another request), `provider_did_nothing` rolls the charge back to the state it came from,
//! so the client's retry can run again.

/// Where a charge is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Created,
    Authorizing,
    Authorized,
    Capturing,
    Captured,
    Refunding,
    Refunded,
    Canceling,
    Canceled,
    Failed,
}

impl Status {
    /// The status as the API writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Created => "created",
            Status::Authorizing => "authorizing",
            Status::Authorized => "authorized",
            Status::Capturing => "capturing",
            Status::Captured => "captured",
            Status::Refunding => "refunding",
            Status::Refunded => "refunded",
            Status::Canceling => "canceling",
            Status::Canceled => "canceled",
            Status::Failed => "failed",
        }
    }

    /// The status [`Status::as_str`] wrote, read back (from a database row).
    pub fn parse(text: &str) -> Option<Self> {
        STATUSES.into_iter().find(|status| status.as_str() == text)
    }
}

/// Every status.
const STATUSES: [Status; 10] = [
    Status::Created,
    Status::Authorizing,
    Status::Authorized,
    Status::Capturing,
    Status::Captured,
    Status::Refunding,
    Status::Refunded,
    Status::Canceling,
    Status::Canceled,
    Status::Failed,
];

/// What happens to a charge: a client's request or the provider's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Event {
    Authorize,
    Approved,
    Declined,
    Capture,
    Captured,
    Refund,
    PartiallyRefunded,
    Refunded,
    Cancel,
    Canceled,
    ProviderDidNothing,
}

impl Event {
    /// What the event does to a charge, for error messages ("it cannot be captured").
    pub fn operation(self) -> &'static str {
        match self {
            Event::Authorize => "authorized",
            Event::Approved => "approved",
            Event::Declined => "declined",
            Event::Capture | Event::Captured => "captured",
            Event::Refund | Event::PartiallyRefunded | Event::Refunded => "refunded",
            Event::Cancel | Event::Canceled => "canceled",
            Event::ProviderDidNothing => "rolled back",
        }
    }
}

/// Every allowed transition: `(from, event, to)`. Anything not listed is refused.
pub const TRANSITIONS: &[(Status, Event, Status)] = {
    use Event as E;
    use Status as S;
    &[
        (S::Created, E::Authorize, S::Authorizing),
        (S::Authorizing, E::Approved, S::Authorized),
        (S::Authorizing, E::Declined, S::Failed),
        (S::Authorizing, E::ProviderDidNothing, S::Created),
        (S::Authorized, E::Capture, S::Capturing),
        (S::Capturing, E::Captured, S::Captured),
        (S::Capturing, E::ProviderDidNothing, S::Authorized),
        (S::Authorized, E::Cancel, S::Canceling),
        (S::Canceling, E::Canceled, S::Canceled),
        (S::Canceling, E::ProviderDidNothing, S::Authorized),
        (S::Captured, E::Refund, S::Refunding),
        (S::Refunding, E::PartiallyRefunded, S::Captured),
        (S::Refunding, E::Refunded, S::Refunded),
        (S::Refunding, E::ProviderDidNothing, S::Captured),
    ]
};

/// The state after `event` in `status`, or `None` when the machine does not allow it.
pub fn next(status: Status, event: Event) -> Option<Status> {
    TRANSITIONS
        .iter()
        .find(|(from, on, _)| *from == status && *on == event)
        .map(|(_, _, to)| *to)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Event as E;
    use Status as S;

    const EVENTS: [Event; 11] = [
        E::Authorize,
        E::Approved,
        E::Declined,
        E::Capture,
        E::Captured,
        E::Refund,
        E::PartiallyRefunded,
        E::Refunded,
        E::Cancel,
        E::Canceled,
        E::ProviderDidNothing,
    ];

    #[test]
    fn every_listed_transition_is_allowed() {
        let expected = [
            (S::Created, E::Authorize, S::Authorizing),
            (S::Authorizing, E::Approved, S::Authorized),
            (S::Authorizing, E::Declined, S::Failed),
            (S::Authorizing, E::ProviderDidNothing, S::Created),
            (S::Authorized, E::Capture, S::Capturing),
            (S::Capturing, E::Captured, S::Captured),
            (S::Capturing, E::ProviderDidNothing, S::Authorized),
            (S::Authorized, E::Cancel, S::Canceling),
            (S::Canceling, E::Canceled, S::Canceled),
            (S::Canceling, E::ProviderDidNothing, S::Authorized),
            (S::Captured, E::Refund, S::Refunding),
            (S::Refunding, E::PartiallyRefunded, S::Captured),
            (S::Refunding, E::Refunded, S::Refunded),
            (S::Refunding, E::ProviderDidNothing, S::Captured),
        ];
        for (from, event, to) in expected {
            assert_eq!(next(from, event), Some(to), "{from:?} --{event:?}-->");
        }
        assert_eq!(
            TRANSITIONS.len(),
            expected.len(),
            "the table has unlisted rows"
        );
    }

    #[test]
    fn the_table_is_a_function() {
        for (i, (from, event, _)) in TRANSITIONS.iter().enumerate() {
            for (other_from, other_event, _) in &TRANSITIONS[i + 1..] {
                assert!(
                    (from, event) != (other_from, other_event),
                    "{from:?} --{event:?}--> is listed twice"
                );
            }
        }
    }

    #[test]
    fn disallowed_transitions_are_refused() {
        let refused = [
            (S::Created, E::Capture),
            (S::Created, E::Refund),
            (S::Authorizing, E::Capture),
            (S::Authorized, E::Refund),
            (S::Authorized, E::Authorize),
            (S::Capturing, E::Capture),
            (S::Capturing, E::Cancel),
            (S::Captured, E::Capture),
            (S::Captured, E::Cancel),
            (S::Refunding, E::Refund),
            (S::Refunded, E::Refund),
            (S::Refunded, E::Capture),
            (S::Canceling, E::Cancel),
            (S::Canceled, E::Capture),
            (S::Canceled, E::Cancel),
            (S::Failed, E::Capture),
            (S::Failed, E::Authorize),
        ];
        for (from, event) in refused {
            assert_eq!(
                next(from, event),
                None,
                "{from:?} --{event:?}--> must be refused"
            );
        }
    }

    #[test]
    fn every_status_reads_back() {
        for status in STATUSES {
            assert_eq!(Status::parse(status.as_str()), Some(status));
        }
        assert_eq!(Status::parse("paid"), None);
    }

    #[test]
    fn final_states_have_no_way_out() {
        for status in [S::Refunded, S::Canceled, S::Failed] {
            for event in EVENTS {
                assert_eq!(next(status, event), None, "{status:?} --{event:?}-->");
            }
        }
    }

    #[test]
    fn every_state_is_reachable_from_created() {
        let mut reached = vec![S::Created];
        let mut i = 0;
        while let Some(&status) = reached.get(i) {
            for event in EVENTS {
                if let Some(to) = next(status, event).filter(|to| !reached.contains(to)) {
                    reached.push(to);
                }
            }
            i += 1;
        }
        for status in STATUSES {
            assert!(reached.contains(&status), "{status:?} is unreachable");
        }
    }
}
