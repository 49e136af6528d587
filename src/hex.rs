//! Lowercase hex for ids, tokens and digests in keys and logs: one printer for the whole crate.

use std::fmt;

/// Bytes displayed in lowercase hex, with no allocation: `write!` it into a key, or use it as a
/// `tracing` field.
#[derive(Clone, Copy)]
pub(crate) struct Hex<'a>(pub(crate) &'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write as _;
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        for b in self.0 {
            f.write_char(char::from(DIGITS[usize::from(b >> 4)]))?;
            f.write_char(char::from(DIGITS[usize::from(b & 0x0f)]))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Hex;

    #[test]
    fn prints_every_byte_as_two_lowercase_digits() {
        assert_eq!(Hex(&[0x00, 0x0f, 0xa5, 0xff]).to_string(), "000fa5ff");
        assert_eq!(Hex(&[]).to_string(), "");
    }
}
