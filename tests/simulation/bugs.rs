//! Bugs put back on purpose (`SIM_BUG=<name>`), each of the kind a tired maintainer could write,
//! so that the checker's power to catch them is shown, and repeatable.

/// At most one bug is on in a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Bug {
    #[default]
    None,
    /// The store answers a claim before a replica has it, so a failover loses acknowledged claims.
    NoReplicationWait,
    /// Fenced handlers charge without their guard.
    UnguardedEffects,
    /// The store completes a record for a token that no longer owns it (§5.3).
    StaleToken,
    /// A completed record's fingerprint is not compared: it comes back as the asking request's,
    /// so a request with another body is answered with the replay.
    SkipFingerprint,
    /// A key in flight is reported with a whole lease left, whatever is left of it (§6.3).
    FullLeaseLeft,
    /// A renewal succeeds for a token that lost the key: `still_held()` stays true after a
    /// takeover.
    RenewAnyToken,
    /// The client sends each retry with a key of its own (§14.1).
    NewKeyPerRetry,
    /// A completed record is kept for one lease instead of the dedup window.
    ShortWindow,
}

impl Bug {
    pub(crate) const NAMES: [(&str, Bug); 8] = [
        ("no-replication-wait", Bug::NoReplicationWait),
        ("unguarded-effects", Bug::UnguardedEffects),
        ("stale-token", Bug::StaleToken),
        ("skip-fingerprint", Bug::SkipFingerprint),
        ("full-lease-left", Bug::FullLeaseLeft),
        ("renew-any-token", Bug::RenewAnyToken),
        ("new-key-per-retry", Bug::NewKeyPerRetry),
        ("short-window", Bug::ShortWindow),
    ];

    /// The bug `SIM_BUG` names, or none.
    pub(crate) fn from_env() -> Self {
        match std::env::var("SIM_BUG") {
            Ok(name) => Self::NAMES
                .iter()
                .find(|(known, _)| *known == name)
                .map(|(_, bug)| *bug)
                .unwrap_or_else(|| {
                    let known: Vec<&str> = Self::NAMES.iter().map(|(name, _)| *name).collect();
                    panic!("unknown SIM_BUG {name:?}: one of {known:?}")
                }),
            Err(_) => Self::None,
        }
    }
}
