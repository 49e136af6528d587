//! [`Reader`]: the bounds-checked cursor every part of the record encoding is read with, so that
//! bytes that end early are a [`DecodeError::Truncated`], never a panic or a read past the end.

use super::codec::DecodeError;
use crate::fingerprint::Fingerprint;

/// The bytes of a record not read yet.
pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    /// Whether every byte has been read.
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the next bytes are `prefix`, reading nothing.
    pub(super) fn starts_with(&self, prefix: &[u8]) -> bool {
        self.0.starts_with(prefix)
    }

    /// The next `n` bytes.
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.0.len() < n {
            return Err(DecodeError::Truncated);
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(super) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(super) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub(super) fn fingerprint(&mut self) -> Result<Fingerprint, DecodeError> {
        Ok(Fingerprint::from_bytes(self.array()?))
    }
}
