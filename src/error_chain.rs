//! How the logs tell of an error: one line, with every cause once ([`ErrorChain`]), as the
//! layer's own log lines write a store's errors. For an application's and a tool's lines too.

use std::fmt;

/// Displays an error with its sources, each cause once.
///
/// Many errors repeat their source: redis-rs's `RedisError` displays as the I/O error it holds
/// and also returns it as its source, and deadpool's `PoolError` writes its source into its own
/// message. A source whose text ends the text of the error before it is therefore not written
/// again (`Redis is unreachable or failed: broken pipe`, not `...: broken pipe: broken pipe`).
///
/// ```
/// use tower_idempotency::error_chain::ErrorChain;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("the ledger failed: {0}")]
/// struct Ledger(#[source] std::io::Error);
///
/// let err = Ledger(std::io::Error::other("disk full"));
/// assert_eq!(ErrorChain(&err).to_string(), "the ledger failed: disk full");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut said = self.0.to_string();
        f.write_str(&said)?;
        let mut source = self.0.source();
        while let Some(err) = source {
            let text = err.to_string();
            if !said.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            said = text;
            source = err.source();
        }
        Ok(())
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

#[cfg(test)]
mod tests {
    use std::io;

    use deadpool_redis::redis::RedisError;
    use tower_idempotency_redis::RedisStoreError;

    use super::*;
    use crate::store::StoreError;

    /// A Redis failure as the store reports it: each cause named once.
    #[test]
    fn a_nested_redis_error_names_each_cause_once() {
        let broken = RedisError::from(io::Error::from(io::ErrorKind::BrokenPipe));
        let err = StoreError::Unavailable(Box::new(RedisStoreError::Redis(broken)));
        assert_eq!(
            ErrorChain(&err).to_string(),
            "the store is unavailable: Redis is unreachable or failed: broken pipe"
        );

        // The pool could not connect: deadpool writes Redis's error into its own, and returns
        // it as its source too.
        let refused = RedisError::from(io::Error::from(io::ErrorKind::ConnectionRefused));
        let pool = deadpool_redis::PoolError::Backend(refused);
        let err = StoreError::Unavailable(Box::new(RedisStoreError::Pool(pool)));
        assert_eq!(
            ErrorChain(&err).to_string(),
            "the store is unavailable: could not take a Redis connection from the pool: Error \
             occurred while creating a new object: connection refused"
        );
    }

    /// A cause that only shares words with the error before it is still said.
    #[test]
    fn a_cause_is_dropped_only_where_the_error_before_it_ends_with_it() {
        #[derive(Debug, thiserror::Error)]
        #[error("the call failed: broken pipe, then a retry")]
        struct Outer(#[source] io::Error);
        let err = Outer(io::Error::from(io::ErrorKind::BrokenPipe));
        assert_eq!(
            ErrorChain(&err).to_string(),
            "the call failed: broken pipe, then a retry: broken pipe"
        );
    }
}
