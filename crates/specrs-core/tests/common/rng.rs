//! xorshift64*: the random forwards' only randomness, seeded per property (forward_batch.rs,
//! kv_layouts.rs).

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }

    /// A random tree of `n` nodes (parents before children), or a chain one time in `chain_one_in`.
    pub fn parents(&mut self, n: usize, chain_one_in: usize) -> Vec<i32> {
        let chain = self.below(chain_one_in) == 0;
        (0..n).map(|i| if chain || i == 0 { i as i32 - 1 } else { self.below(i + 1) as i32 - 1 }).collect()
    }
}
