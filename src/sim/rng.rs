//! [`Rng`]: the simulation's only source of chance, a SplitMix64 generator: the same seed gives
//! the same numbers on every machine, so a seed is a whole run.

/// A deterministic generator of numbers.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    /// The generator of `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// A generator of its own for one part of a run (`stream`), so that one part drawing more
    /// numbers does not change what another part draws.
    pub(crate) fn fork(&self, stream: u64) -> Rng {
        let mut forked = Rng(self.0 ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        forked.next();
        forked
    }

    /// The next 64 random bits.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `low..=high`.
    pub(crate) fn between(&mut self, low: u64, high: u64) -> u64 {
        debug_assert!(low <= high);
        low + self.next() % (high - low + 1)
    }

    /// True with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }

    /// One of `items`.
    pub(crate) fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.between(0, items.len() as u64 - 1) as usize]
    }
}
