//! Lowercase hex for ids, tokens and digests in keys and logs: one printer for the whole crate.

use std::fmt;

/// Bytes displayed in lowercase hex, with no allocation: `write!` it into a key, or use it as a
/// `tracing` field.
#[derive(Clone, Copy)]
pub(crate) struct Hex<'a>(pub(crate) &'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        // A chunk at a time into a buffer, and one write per chunk: a formatter call per digit
        // costs more than the digits (a record id is printed for every Redis call).
        let mut buffer = [0; 64];
        for chunk in self.0.chunks(buffer.len() / 2) {
            for (pair, b) in buffer.chunks_exact_mut(2).zip(chunk) {
                pair[0] = DIGITS[usize::from(b >> 4)];
                pair[1] = DIGITS[usize::from(b & 0x0f)];
            }
            let digits = &buffer[..chunk.len() * 2];
            f.write_str(std::str::from_utf8(digits).map_err(|_| fmt::Error)?)?;
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
        // Longer than one chunk of the buffer.
        let bytes: Vec<u8> = (0..=80).collect();
        let expected: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(Hex(&bytes).to_string(), expected);
    }
}
