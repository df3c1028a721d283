//! Logits -> next token: greedy argmax, or temperature / top-k / top-p / min-p filtering and a
//! seeded draw.
//!
//! Invariant: `probabilities` is the one definition of the distribution a request samples from
//! (speculative verification uses it too), applied in the order temperature -> top-k -> top-p ->
//! min-p; the same seed and logits always give the same token.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::SamplingParams;

/// Index of the largest logit; the lowest index wins ties (as in llama.cpp and torch).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The filtered, normalized distribution `[vocab_size]` that non-greedy sampling draws from.
/// Requires `params.temperature > 0`.
pub fn probabilities(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    let inv_t = 1.0 / params.temperature;
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut weights: Vec<f32> = logits.iter().map(|&x| ((x - max) * inv_t).exp()).collect();

    let vocab = weights.len();
    if params.top_k > 0 && params.top_k < vocab {
        // Rank by (weight desc, index asc) so ties resolve deterministically.
        let mut order: Vec<u32> = (0..vocab as u32).collect();
        order.select_nth_unstable_by(params.top_k - 1, |&a, &b| {
            weights[b as usize].total_cmp(&weights[a as usize]).then(a.cmp(&b))
        });
        for &i in &order[params.top_k..] {
            weights[i as usize] = 0.0;
        }
    }
    if params.top_p < 1.0 {
        let mut kept: Vec<u32> = (0..vocab as u32).filter(|&i| weights[i as usize] > 0.0).collect();
        kept.sort_unstable_by(|&a, &b| weights[b as usize].total_cmp(&weights[a as usize]).then(a.cmp(&b)));
        let total: f32 = kept.iter().map(|&i| weights[i as usize]).sum();
        let mut cumulative = 0.0f32;
        let mut cut = kept.len();
        for (rank, &i) in kept.iter().enumerate() {
            cumulative += weights[i as usize];
            if cumulative >= params.top_p * total {
                cut = rank + 1;
                break;
            }
        }
        for &i in &kept[cut..] {
            weights[i as usize] = 0.0;
        }
    }
    if params.min_p > 0.0 {
        let top = weights.iter().fold(0.0f32, |m, &w| m.max(w));
        let floor = params.min_p * top;
        for w in weights.iter_mut() {
            if *w < floor {
                *w = 0.0;
            }
        }
    }
    let total: f32 = weights.iter().sum();
    for w in weights.iter_mut() {
        *w /= total;
    }
    weights
}

/// The index where the running sum of `weights` (`[vocab_size]`, not necessarily normalized)
/// first passes `uniform * total`: inverse-CDF sampling with the uniform draw `uniform` in [0, 1).
pub fn draw_with(weights: &[f32], uniform: f32) -> u32 {
    let total: f32 = weights.iter().sum();
    let target = uniform * total;
    let mut cumulative = 0.0f32;
    let mut last_nonzero = 0usize;
    for (i, &p) in weights.iter().enumerate() {
        if p > 0.0 {
            cumulative += p;
            last_nonzero = i;
            if cumulative > target {
                return i as u32;
            }
        }
    }
    last_nonzero as u32 // rounding left the target just past the end
}

/// A request's random source: seeded for reproducibility. Two kinds of draws: a sequential
/// stream (`uniform`, `draw`), and one uniform per output position (`uniform_at`, `draw_at`) that
/// does not depend on how many draws came before, so a token sampled at position i is the same
/// however the request's steps were cut into drafts (verify.rs).
#[derive(Clone)]
pub struct Sampler {
    seed: u64,
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(seed: Option<u64>) -> Self {
        let seed = seed.unwrap_or_else(|| rand::rng().random());
        Self { seed, rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// The seed: the request's, or the one drawn for an unseeded request (a coupled draft draws
    /// with the same positional uniforms as the request's verifier).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Uniform draw in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// The next `count` uniforms of the sequential stream, without consuming them: what a batched
    /// verifier reads in order (verify/batch.rs); `skip_uniforms` then consumes those it used.
    pub fn peek_uniforms(&self, count: usize) -> Vec<f32> {
        let mut rng = self.rng.clone();
        (0..count).map(|_| rng.random::<f32>()).collect()
    }

    /// Consumes `count` uniforms of the sequential stream, exactly as `count` calls of `uniform`.
    pub fn skip_uniforms(&mut self, count: usize) {
        for _ in 0..count {
            self.uniform();
        }
    }

    /// The uniform in [0, 1) of output position `position` (the token's index in prompt +
    /// output): the first word of ChaCha8 stream `position + 1` under this request's seed (the
    /// sequential stream is stream 0, so the two never share words).
    pub fn uniform_at(&self, position: usize) -> f32 {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(position as u64 + 1);
        rng.random::<f32>()
    }

    /// Draws an index from `probs` (`[vocab_size]`) with position `position`'s uniform.
    pub fn draw_at(&self, probs: &[f32], position: usize) -> u32 {
        draw_with(probs, self.uniform_at(position))
    }

    /// Draws an index from `probs` (`[vocab_size]`, summing to ~1).
    pub fn draw(&mut self, probs: &[f32]) -> u32 {
        draw_with(probs, self.uniform())
    }

    /// Next token from one row of logits `[vocab_size]`.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams) -> u32 {
        if params.is_greedy() {
            argmax(logits)
        } else {
            self.draw(&probabilities(logits, params))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, min_p, ..Default::default() }
    }

    const LOGITS: [f32; 5] = [2.0, 1.0, 0.5, 0.0, -1.0];

    #[test]
    fn argmax_prefers_the_first_of_equal_maxima() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -2.0]), 1);
    }

    #[test]
    fn temperature_one_is_the_softmax() {
        let probs = probabilities(&LOGITS, &params(1.0, 0, 1.0, 0.0));
        let z: f32 = LOGITS.iter().map(|x| x.exp()).sum();
        for (p, x) in probs.iter().zip(LOGITS) {
            assert!((p - x.exp() / z).abs() < 1e-6);
        }
    }

    #[test]
    fn filters_keep_the_expected_support() {
        let support = |p: &SamplingParams| -> Vec<usize> {
            probabilities(&LOGITS, p).iter().enumerate().filter(|(_, &x)| x > 0.0).map(|(i, _)| i).collect()
        };
        assert_eq!(support(&params(1.0, 2, 1.0, 0.0)), vec![0, 1]);
        // softmax: 0.563, 0.207, 0.126, 0.076, 0.028 -> 0.77 reaches top_p 0.7 with two tokens.
        assert_eq!(support(&params(1.0, 0, 0.7, 0.0)), vec![0, 1]);
        assert_eq!(support(&params(1.0, 0, 0.5, 0.0)), vec![0]);
        // min_p 0.3: keep p >= 0.3 * p_max, i.e. logit >= 2 + ln 0.3 = 0.796.
        assert_eq!(support(&params(1.0, 0, 1.0, 0.3)), vec![0, 1]);
        let probs = probabilities(&LOGITS, &params(1.0, 3, 1.0, 0.0));
        assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn same_seed_same_tokens_and_draws_follow_the_distribution() {
        let p = params(1.0, 0, 1.0, 0.0);
        let draws = |seed| {
            let mut s = Sampler::new(Some(seed));
            (0..50).map(|_| s.sample(&LOGITS, &p)).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
        // Positional draws do not depend on the sequential stream, nor on each other's order.
        let mut s = Sampler::new(Some(7));
        let before: Vec<f32> = (0..20).map(|i| s.uniform_at(i)).collect();
        s.uniform();
        let after: Vec<f32> = (0..20).rev().map(|i| s.uniform_at(i)).collect();
        assert_eq!(before, after.into_iter().rev().collect::<Vec<_>>());
        assert!(before.windows(2).all(|w| w[0] != w[1]));
        let probs = probabilities(&LOGITS, &p);
        let mut sampler = Sampler::new(Some(1));
        let mut counts = [0usize; 5];
        let n = 100_000;
        for _ in 0..n {
            counts[sampler.draw(&probs) as usize] += 1;
        }
        for (c, p) in counts.iter().zip(&probs) {
            let sd = (n as f32 * p * (1.0 - p)).sqrt();
            assert!((*c as f32 - n as f32 * p).abs() < 5.0 * sd, "{counts:?} vs {probs:?}");
        }
    }
}
