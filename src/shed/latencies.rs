//! [`Latencies`]: a histogram of request latencies that many threads add to at once, read and
//! emptied in one pass — the window an adaptive shedder judges by its 90th percentile.
//!
//! ```text
//! let window = Latencies::new();
//! window.add(11_000); // µs
//! let (p90, count) = window.take(0.9);
//! ```
//!
//! Buckets are sixteen per power of two (each within 6.25 % of its values), so that adding is one
//! atomic increment and no sample is kept.

use std::sync::atomic::{AtomicU32, Ordering};

/// Buckets per power of two: `2^SUB_BITS`.
const SUB_BITS: u32 = 4;
const SUBS: u64 = 1 << SUB_BITS;
/// Values past this (about 12 days in µs) count in the last bucket.
const MAX_VALUE: u64 = (1 << 40) - 1;
/// Buckets: values below `SUBS` exactly, then `SUBS` per power of two up to `MAX_VALUE`.
const BUCKETS: usize = bucket(MAX_VALUE) + 1;

/// The bucket of `value`.
const fn bucket(value: u64) -> usize {
    if value < SUBS {
        return value as usize;
    }
    let top = 63 - value.leading_zeros();
    let sub = (value >> (top - SUB_BITS)) & (SUBS - 1);
    ((top - SUB_BITS + 1) as u64 * SUBS + sub) as usize
}

/// The middle of bucket `index`'s values.
fn middle(index: usize) -> u64 {
    let index = index as u64;
    if index < SUBS {
        return index;
    }
    let shift = index / SUBS - 1;
    let low = (SUBS + index % SUBS) << shift;
    low + (1u64 << shift) / 2
}

/// A histogram of latencies (µs), added to by many threads and emptied by [`take`](Self::take).
#[derive(Debug)]
pub(crate) struct Latencies {
    buckets: Box<[AtomicU32]>,
}

impl Latencies {
    pub(crate) fn new() -> Self {
        Latencies {
            buckets: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// `micros` as a window reads it back: the middle of its bucket. A base rounded so
    /// compares with a window's quantile as with itself, whatever the tolerance.
    pub(crate) fn rounded(micros: u64) -> u64 {
        middle(bucket(micros.min(MAX_VALUE)))
    }

    /// Counts one latency.
    pub(crate) fn add(&self, micros: u64) {
        // A window is emptied every 10 s at most: four billion in one bucket would take 400
        // million requests a second.
        self.buckets[bucket(micros.min(MAX_VALUE))].fetch_add(1, Ordering::Relaxed);
    }

    /// How many latencies were counted since the last [`take`](Self::take).
    pub(crate) fn count(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| u64::from(b.load(Ordering::Relaxed)))
            .sum()
    }

    /// Empties the histogram: the `quantile` (0 to 1) of what it held (the middle of its
    /// bucket, 0 when empty) and how many it held. A latency added meanwhile counts in this
    /// window or the next, never in none.
    pub(crate) fn take(&self, quantile: f64) -> (u64, u64) {
        let mut counts = [0u64; BUCKETS];
        for (count, b) in counts.iter_mut().zip(self.buckets.iter()) {
            *count = u64::from(b.swap(0, Ordering::AcqRel));
        }
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return (0, 0);
        }
        let rank = ((total as f64 * quantile).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (index, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return (middle(index), total);
            }
        }
        (middle(BUCKETS - 1), total)
    }

    /// Empties the histogram without reading it.
    pub(crate) fn clear(&self) {
        for b in self.buckets.iter() {
            b.store(0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_contiguous_and_each_within_a_sixteenth_of_its_values() {
        let mut last = 0;
        for value in 1..100_000u64 {
            let b = bucket(value);
            assert!(b == last || b == last + 1, "{value}: {last} then {b}");
            last = b;
            let m = middle(b);
            assert!(
                m.abs_diff(value) * 16 <= value.max(16),
                "{value} in bucket {b} read as {m}"
            );
        }
        for value in [1u64 << 20, 3 << 27, (1 << 35) + 12_345, MAX_VALUE] {
            assert!(
                middle(bucket(value)).abs_diff(value) * 32 <= value,
                "{value}"
            );
        }
        assert_eq!(bucket(MAX_VALUE), BUCKETS - 1);
        let window = Latencies::new();
        window.add(u64::MAX);
        assert_eq!(
            window.take(1.0).0,
            middle(BUCKETS - 1),
            "past the last bucket: in it"
        );
        let window = Latencies::new();
        window.add(12_345);
        assert_eq!(window.take(0.9).0, Latencies::rounded(12_345));
    }

    #[test]
    fn a_quantile_is_read_and_the_window_emptied() {
        let window = Latencies::new();
        for micros in 1..=100u64 {
            window.add(micros * 1_000);
        }
        window.add(u64::MAX);
        assert_eq!(window.count(), 101);
        let (p90, count) = window.take(0.9);
        assert_eq!(count, 101);
        assert_eq!(p90, Latencies::rounded(91_000), "the 91st of 101");
        assert_eq!(window.take(0.9), (0, 0), "emptied");
        window.add(5);
        window.clear();
        assert_eq!(window.count(), 0);
    }
}
