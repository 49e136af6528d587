//! The Lua scripts (the claim, and the fenced complete, renew and release) and how they are sent:
//! `EVALSHA`, reloaded once when Redis has lost them.

use deadpool_redis::redis::{self, Cmd, FromRedisValue, RedisResult, Script};

use super::replication::Replication;
use super::{RedisStore, RedisStoreError};
use tower_idempotency::record::{ClaimToken, RecordId};
use tower_idempotency::store::StoreError;

/// Claims a key for a lease, numbering the claim with Redis's clock, or returns its record.
/// KEYS[1] record; ARGV[1] the in-flight record with a zero fence, ARGV[2] lease in ms.
pub(super) const CLAIM: &str = include_str!("claim.lua");
/// Replaces the in-flight record with the completed one, if the claim's token still matches, or
/// writes it where the key has no record. KEYS[1] record; ARGV[1] token, ARGV[2] completed record, ARGV[3] ttl in ms.
pub(super) const COMPLETE: &str = include_str!("complete.lua");
/// Extends the lease of the in-flight record, if the claim's token still matches.
/// KEYS[1] record; ARGV[1] token, ARGV[2] lease in ms (Redis stamps the lease end).
pub(super) const RENEW: &str = include_str!("renew.lua");
/// Deletes the in-flight record, if the claim's token still matches (its unique half).
/// KEYS[1] record; ARGV[1] token.
pub(super) const RELEASE: &str = include_str!("release.lua");

/// A script: its source, and the SHA1 that `EVALSHA` names it by.
pub(super) struct Lua {
    pub(super) source: &'static str,
    pub(super) hash: String,
}

impl Lua {
    pub(super) fn new(source: &'static str) -> Self {
        Self {
            source,
            hash: Script::new(source).get_hash().to_owned(),
        }
    }
}

impl RedisStore {
    /// Runs a fenced script with `EVALSHA`, built straight into one command (no intermediate
    /// copies of the record), loading the script and retrying once when Redis has lost it (a
    /// restart or `SCRIPT FLUSH`). With `replication`, a write that too few replicas acknowledged
    /// is an error.
    pub(super) async fn fenced(
        &self,
        script: &Lua,
        id: &RecordId,
        token: &ClaimToken,
        args: &[&[u8]],
        replication: Option<&Replication>,
    ) -> Result<bool, StoreError> {
        let key = self.redis_key(id);
        let evalsha = || {
            let size = 40 + key.len() + 16 + args.iter().map(|a| a.len()).sum::<usize>();
            let mut cmd = Cmd::with_capacity(5 + args.len(), size);
            cmd.arg("EVALSHA")
                .arg(&script.hash)
                .arg(1)
                .arg(&key)
                .arg(token.as_bytes().as_slice());
            for arg in args {
                cmd.arg(*arg);
            }
            cmd
        };
        let run = |cmd: Cmd| async move {
            match replication {
                None => self.send::<i64>(cmd).await.map(|written| (written, None)),
                Some(replication) => {
                    let (written, acked) = self.replicated(replication, cmd).await?;
                    let written = i64::from_redis_value(written)?;
                    Ok((written, Some((acked, replication.replicas))))
                }
            }
        };
        let (written, acks) = self
            .run(async {
                match run(evalsha()).await {
                    Err(err)
                        if err.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                    {
                        let mut load = redis::cmd("SCRIPT");
                        load.arg("LOAD").arg(script.source);
                        // To the key's node: on a cluster, each node has its own script cache.
                        load_on(self, load, &key).await?;
                        run(evalsha()).await
                    }
                    answer => answer,
                }
            })
            .await?;
        if written == 1
            && let Some((acked, wanted)) = acks
            && acked < wanted
        {
            return Err(StoreError::Unavailable(Box::new(
                RedisStoreError::NotReplicated { acked, wanted },
            )));
        }
        Ok(written == 1)
    }
}

/// Loads a script where `key` lives: on one server, that server; on a cluster, the key's master
/// (`SCRIPT LOAD` carries no key, so it is routed with a keyed command in one pipeline).
pub(super) async fn load_on(store: &RedisStore, load: Cmd, key: &str) -> RedisResult<()> {
    if !store.is_cluster() {
        return store.send::<String>(load).await.map(drop);
    }
    let mut pipe = redis::Pipeline::with_capacity(2);
    pipe.cmd("EXISTS").arg(key).ignore();
    pipe.add_command(load);
    store
        .on_a_lane(store.inner.timeout, |mut connection| async move {
            pipe.query_async::<(String,)>(&mut connection).await
        })
        .await
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ops::Range;

    use tower_idempotency::record::layout;

    /// `range`, 1-based and inclusive as Lua's `string.sub` takes it.
    fn lua(range: Range<usize>) -> (usize, usize) {
        (range.start + 1, range.end)
    }

    /// The scripts read an in-flight record in place: their offsets must be the encoding's.
    #[test]
    fn scripts_fence_on_the_encodings_offsets() {
        let kind = format!(
            "string.byte(record, {}) ~= {}",
            layout::KIND + 1,
            layout::IN_FLIGHT
        );
        let (first, last) = lua(layout::TOKEN);
        let token = format!("string.sub(record, {first}, {last}) ~= ARGV[1]");
        let (unique_first, _) = lua(layout::TOKEN.start + 8..layout::TOKEN.end);
        let unique =
            format!("string.sub(record, {unique_first}, {last}) ~= string.sub(ARGV[1], 9, 16)");
        assert!(
            RELEASE.contains(&kind),
            "release.lua reads the kind at {kind}"
        );
        assert!(
            RELEASE.contains(&unique),
            "release.lua reads the token's unique half as {unique}"
        );
        let (fence_first, fence_last) = lua(layout::TOKEN.start..layout::TOKEN.start + 8);
        let (_, before_lease) = lua(0..layout::LEASE_END.start);
        let fenced = format!(
            "string.sub(ARGV[1], 1, {}) .. fence .. string.sub(ARGV[1], {}, {before_lease}) .. \
             lease_end",
            fence_first - 1,
            fence_last + 1
        );
        assert!(
            CLAIM.contains(&fenced),
            "claim.lua writes the fence, and stamps the lease end after the fingerprint, as \
             {fenced}"
        );
        for (name, script) in [("complete", COMPLETE), ("renew", RENEW)] {
            assert!(
                script.contains(&kind),
                "{name}.lua reads the kind at {kind}"
            );
            assert!(
                script.contains(&token),
                "{name}.lua reads the token as {token}"
            );
        }
        let kept = format!("string.sub(record, 1, {before_lease}) .. lease_end");
        assert!(
            RENEW.contains(&kept),
            "renew.lua rewrites the lease end: {kept}"
        );
        assert_eq!(
            layout::LEASE_END.end,
            layout::IN_FLIGHT_LEN,
            "the lease end is last"
        );
    }
}
