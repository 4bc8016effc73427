//! A small on-stack byte buffer for header values and bodies: one allocation at the end.

use bytes::Bytes;
use http::HeaderValue;

/// Bytes written on the stack, spilling to the heap only past `INLINE` bytes (384 unless
/// chosen: a problem document fits; a budget field needs far less, and a smaller buffer is
/// quicker to set up).
pub(crate) struct Buffer<const INLINE: usize = 384> {
    inline: [u8; INLINE],
    len: usize,
    spilled: Option<Vec<u8>>,
}

impl<const INLINE: usize> Default for Buffer<INLINE> {
    fn default() -> Self {
        Buffer {
            inline: [0; INLINE],
            len: 0,
            spilled: None,
        }
    }
}

impl<const INLINE: usize> Buffer<INLINE> {
    #[inline]
    pub(crate) fn push(&mut self, bytes: &[u8]) -> &mut Self {
        match &mut self.spilled {
            None if self.len + bytes.len() <= INLINE => {
                self.inline[self.len..self.len + bytes.len()].copy_from_slice(bytes);
                self.len += bytes.len();
            }
            None => {
                let mut heap = Vec::with_capacity(2 * INLINE + bytes.len());
                heap.extend_from_slice(&self.inline[..self.len]);
                heap.extend_from_slice(bytes);
                self.spilled = Some(heap);
            }
            Some(heap) => heap.extend_from_slice(bytes),
        }
        self
    }

    /// Appends the decimal digits of `n`, written in place.
    #[inline]
    pub(crate) fn push_u64(&mut self, n: u64) -> &mut Self {
        let len = crate::decimal::len(n);
        match &mut self.spilled {
            None if self.len + len <= INLINE => {
                crate::decimal::write_end(&mut self.inline[self.len..self.len + len], n);
                self.len += len;
                self
            }
            _ => {
                let mut digits = crate::decimal::Digits::default();
                self.push(digits.of(n))
            }
        }
    }

    fn as_slice(&self) -> &[u8] {
        match &self.spilled {
            Some(heap) => heap,
            None => &self.inline[..self.len],
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// A header value of these bytes (always visible ASCII here).
    pub(crate) fn header_value(&self) -> HeaderValue {
        HeaderValue::from_bytes(self.as_slice()).unwrap_or(HeaderValue::from_static(""))
    }

    pub(crate) fn to_bytes(&self) -> Bytes {
        Bytes::copy_from_slice(self.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::Buffer;

    #[test]
    fn writes_numbers_and_spills_past_the_inline_space() {
        let mut b = <Buffer>::default();
        b.push(b"r=")
            .push_u64(0)
            .push(b";t=")
            .push_u64(18_446_744_073_709_551_615);
        assert_eq!(b.to_bytes(), "r=0;t=18446744073709551615");
        for _ in 0..100 {
            b.push(b"0123456789");
        }
        assert_eq!(b.to_bytes().len(), 26 + 1000);
        assert!(b.to_bytes().ends_with(b"789"));
    }

    #[test]
    fn a_number_that_crosses_the_inline_end_spills_whole() {
        let mut b = Buffer::<8>::default();
        b.push(b"r=").push_u64(99_999).push_u64(0);
        assert_eq!(b.to_bytes(), "r=999990");
        b.push_u64(4_321);
        assert_eq!(b.to_bytes(), "r=9999904321");
        b.push_u64(u64::MAX);
        assert_eq!(b.to_bytes(), "r=999990432118446744073709551615");
    }
}
