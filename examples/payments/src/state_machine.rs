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
//! An `-ing` state is held during the provider call: another request on the charge gets
//! `invalid_state`, not a second call. When the provider refused a capture, refund or
//! cancellation (unavailable, or the key another request's), `provider_did_nothing` rolls the
//! charge back, so a retry can run again; a refused create's charge is removed instead.

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
}

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
