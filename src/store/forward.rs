//! [`forward_store!`](crate::forward_store): the methods a wrapper store passes through unchanged.

/// Writes the [`Store`](crate::store::Store) and [`OperatorStore`](crate::store::OperatorStore)
/// methods that a wrapper store passes to the store it wraps unchanged, inside its `impl Store` (or
/// `impl OperatorStore`) block: the field that holds the inner store (a name, or `0` for a tuple
/// struct, or `*` for a type that derefs to it), then the methods.
///
/// Forward every method the wrapper does not change,
/// [`Store::prepare`](crate::store::Store::prepare) and
/// [`Store::changed`](crate::store::Store::changed) included: their defaults do nothing, so a
/// wrapper that leaves them out cuts `PgTx` off from its transaction, or its waiters off from their
/// signal, without an error. A wrapper whose inner store is an `OperatorStore` is one too, most
/// often by forwarding `inspect` and `forget` in a block of their own.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::time::Duration;
///
/// use tower_idempotency::record::{Fingerprint, RecordId};
/// use tower_idempotency::store::{Claim, OperatorStore, Store, StoreError};
/// use tower_idempotency::{MemoryStore, forward_store};
///
/// /// Counts claims; everything else goes to the inner store as it is.
/// struct CountingClaims<St> {
///     inner: St,
///     claims: AtomicUsize,
/// }
///
/// impl<St: Store> Store for CountingClaims<St> {
///     async fn claim(
///         &self,
///         id: &RecordId,
///         fingerprint: &Fingerprint,
///         lease: Duration,
///     ) -> Result<Claim, StoreError> {
///         self.claims.fetch_add(1, Ordering::Relaxed);
///         self.inner.claim(id, fingerprint, lease).await
///     }
///
///     forward_store!(inner => complete, renew, prepare, release, changed);
/// }
///
/// impl<St: OperatorStore> OperatorStore for CountingClaims<St> {
///     forward_store!(inner => inspect, forget);
/// }
///
/// let store = CountingClaims { inner: MemoryStore::new(), claims: AtomicUsize::new(0) };
/// # let _ = store;
/// ```
#[macro_export]
macro_rules! forward_store {
    ($field:tt => $($method:ident),+ $(,)?) => {
        $($crate::forward_store!(@method [$field] $method);)+
    };
    (@inner [*] $self:ident) => { &**$self };
    (@inner [$field:tt] $self:ident) => { &$self.$field };
    (@method [$field:tt] claim) => {
        fn claim(
            &self,
            id: &$crate::record::RecordId,
            fingerprint: &$crate::record::Fingerprint,
            lease: ::std::time::Duration,
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<$crate::store::Claim, $crate::store::StoreError>,
        > + Send {
            $crate::store::Store::claim(
                $crate::forward_store!(@inner [$field] self),
                id,
                fingerprint,
                lease,
            )
        }
    };
    (@method [$field:tt] complete) => {
        fn complete(
            &self,
            id: &$crate::record::RecordId,
            token: &$crate::record::ClaimToken,
            completed: &$crate::record::Completed,
            ttl: ::std::time::Duration,
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<bool, $crate::store::StoreError>,
        > + Send {
            $crate::store::Store::complete(
                $crate::forward_store!(@inner [$field] self),
                id,
                token,
                completed,
                ttl,
            )
        }
    };
    (@method [$field:tt] renew) => {
        fn renew(
            &self,
            id: &$crate::record::RecordId,
            token: &$crate::record::ClaimToken,
            lease: ::std::time::Duration,
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<bool, $crate::store::StoreError>,
        > + Send {
            $crate::store::Store::renew($crate::forward_store!(@inner [$field] self), id, token, lease)
        }
    };
    (@method [$field:tt] prepare) => {
        fn prepare(
            &self,
            id: &$crate::record::RecordId,
            token: &$crate::record::ClaimToken,
            extensions: &mut $crate::store::__http::Extensions,
        ) {
            $crate::store::Store::prepare(
                $crate::forward_store!(@inner [$field] self),
                id,
                token,
                extensions,
            )
        }
    };
    (@method [$field:tt] release) => {
        fn release(
            &self,
            id: &$crate::record::RecordId,
            token: &$crate::record::ClaimToken,
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<bool, $crate::store::StoreError>,
        > + Send {
            $crate::store::Store::release($crate::forward_store!(@inner [$field] self), id, token)
        }
    };
    (@method [$field:tt] inspect) => {
        fn inspect(
            &self,
            id: &$crate::record::RecordId,
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<
                ::std::option::Option<$crate::store::Inspected>,
                $crate::store::StoreError,
            >,
        > + Send {
            $crate::store::OperatorStore::inspect($crate::forward_store!(@inner [$field] self), id)
        }
    };
    (@method [$field:tt] forget) => {
        fn forget(
            &self,
            id: &$crate::record::RecordId,
            force: bool,
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<$crate::store::ForgetOutcome, $crate::store::StoreError>,
        > + Send {
            $crate::store::OperatorStore::forget($crate::forward_store!(@inner [$field] self), id, force)
        }
    };
    (@method [$field:tt] changed) => {
        fn changed(
            &self,
            id: &$crate::record::RecordId,
        ) -> ::std::option::Option<impl ::std::future::Future<Output = ()> + Send + 'static> {
            $crate::store::Store::changed($crate::forward_store!(@inner [$field] self), id)
        }
    };
}
