//! Decimal digits of an unsigned integer, written in place without allocating: the numbers of
//! the budget fields on every answer and the arguments of every Redis command.
//!
//! ```text
//! let mut digits = Digits::default();
//! assert_eq!(digits.of(1_733_000_000), b"1733000000");
//! assert_eq!(len(0), 1);
//! ```

/// The number of decimal digits of `n` (1 for 0).
#[inline]
pub(crate) fn len(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |log| log as usize + 1)
}

/// Writes the decimal digits of `n` to the end of `out`, two at a time; the bytes before them
/// are left as they were. `out` must hold at least [`len`]`(n)` bytes.
#[inline]
pub(crate) fn write_end(out: &mut [u8], mut n: u64) {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839\
        4041424344454647484950515253545556575859\
        6061626364656667686970717273747576777879\
        8081828384858687888990919293949596979899";
    let mut end = out.len();
    while n >= 100 {
        let pair = (n % 100) as usize * 2;
        n /= 100;
        out[end - 2..end].copy_from_slice(&PAIRS[pair..pair + 2]);
        end -= 2;
    }
    if n >= 10 {
        let pair = n as usize * 2;
        out[end - 2..end].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        out[end - 1] = b'0' + n as u8;
    }
}

/// A buffer for the decimal digits of one `u64`.
#[derive(Default)]
pub(crate) struct Digits([u8; 20]);

impl Digits {
    /// The digits of `n`, written into this buffer.
    #[inline]
    pub(crate) fn of(&mut self, n: u64) -> &[u8] {
        let start = self.0.len() - len(n);
        write_end(&mut self.0[start..], n);
        &self.0[start..]
    }
}

#[cfg(test)]
mod tests {
    use super::{Digits, len};

    #[test]
    fn every_length_and_the_ends_of_the_range_are_written_as_format_writes_them() {
        let mut digits = Digits::default();
        let mut samples = vec![0, 1, 9, 10, 11, 99, 100, 101, 999, u64::MAX, u64::MAX - 1];
        for power in 1..20 {
            let p = 10u64.pow(power);
            samples.extend([p - 1, p, p + 1, p + p / 2 + 7]);
        }
        for n in samples {
            let text = n.to_string();
            assert_eq!(digits.of(n), text.as_bytes(), "{n}");
            assert_eq!(len(n), text.len(), "{n}");
        }
    }

    #[test]
    fn a_pseudo_random_sweep_matches_format() {
        let mut digits = Digits::default();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Every magnitude, not only 20-digit numbers.
            let n = x >> (x % 64);
            assert_eq!(digits.of(n), n.to_string().as_bytes(), "{n}");
        }
    }
}
