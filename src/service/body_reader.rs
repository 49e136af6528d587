//! Reading bodies whole: the request body within its limit, before the fingerprint is taken, and
//! the chunks of any body gathered into one buffer.

use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::Limited;

use super::BoxError;

/// Reads a whole body of at most `limit` bytes. (Not `BodyExt::collect`: a body of one chunk, the
/// common case, is returned as it came, with no allocation.)
pub(super) async fn collect_limited<B>(body: B, limit: usize) -> Result<Bytes, BoxError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let mut chunks = Chunks::default();
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        if let Ok(data) = frame?.into_data() {
            chunks.push(data);
        }
    }
    Ok(chunks.into_bytes())
}

/// Body chunks gathered into one buffer, copied only when there is more than one.
#[derive(Default)]
pub(super) struct Chunks {
    first: Option<Bytes>,
    joined: Option<BytesMut>,
    pub(super) len: usize,
}

impl Chunks {
    pub(super) fn push(&mut self, data: Bytes) {
        self.len += data.len();
        if let Some(joined) = &mut self.joined {
            joined.extend_from_slice(&data);
        } else if let Some(first) = self.first.take() {
            let mut joined = BytesMut::with_capacity(first.len() + data.len());
            joined.extend_from_slice(&first);
            joined.extend_from_slice(&data);
            self.joined = Some(joined);
        } else {
            self.first = Some(data);
        }
    }

    pub(super) fn into_bytes(self) -> Bytes {
        match (self.joined, self.first) {
            (Some(joined), _) => joined.freeze(),
            (None, first) => first.unwrap_or_default(),
        }
    }
}
