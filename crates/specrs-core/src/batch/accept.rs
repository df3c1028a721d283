//! Batched acceptance: for every sequence, how many draft tokens the target keeps and the target's
//! next token (recovered at the first rejection, or bonus after a fully accepted draft).
//!
//! This is `verify::verify` for a batch, with two changes that make it a pure function a device
//! kernel can reproduce: the random draws are inputs (`uniforms`), and the target distribution is
//! softmax(logits / temperature) alone (top-k/top-p/min-p requests use the per-sequence verifier).
//!
//! Invariant: with the same uniforms, each sequence's result equals `verify::verify` driven by a
//! sampler that returns those uniforms in order, with the draft's probabilities given (a
//! deterministic draft as one-hot rows): uniform i decides draft position i, and the next one
//! (index num_accepted + 1, or n when all n drafts pass) draws the recovered or bonus token.
//! (`verify` runs a draft without probabilities in its coupled form instead, one uniform per
//! position; both are exact rejection sampling, but only the coupled form emits the same tokens
//! whatever the draft length, which is why the scheduler never cuts the drafts of a seeded sampled
//! request verified here.)

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::sampler::{argmax, draw_with, probabilities};

/// One batch, row-major. `b` = batch, `k` = max draft tokens, `v` = vocab size.
pub struct AcceptInput<'a> {
    pub batch: usize,
    pub max_draft_tokens: usize,
    pub vocab_size: usize,
    /// `[b, k + 1, v]`: row i scores the token after the context plus the first i drafts.
    pub target_logits: &'a [f32],
    /// `[b, k]`; sequence s uses its first `num_draft_tokens[s]`.
    pub draft_token_ids: &'a [u32],
    /// `[b]`, each <= k.
    pub num_draft_tokens: &'a [u32],
    /// `[b, k, v]` draft distributions, or None for deterministic drafts (q one-hot).
    pub draft_probs: Option<&'a [f32]>,
    /// `[b]`; 0 = greedy.
    pub temperatures: &'a [f32],
    /// `[b, k + 1]` in [0, 1); unused by greedy sequences.
    pub uniforms: &'a [f32],
}

/// Per sequence: `num_accepted_tokens[s]` draft tokens kept, then `next_token_ids[s]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptOutput {
    pub num_accepted_tokens: Vec<u32>,
    pub next_token_ids: Vec<u32>,
}

impl AcceptInput<'_> {
    /// Every shape is checked once here, so the reference and the kernel can index freely.
    pub fn check(&self) -> Result<()> {
        self.check_with_logits(self.target_logits.len())
    }

    /// `check` for target logits that live elsewhere (a device tensor) and hold `num_logits` values.
    pub fn check_with_logits(&self, num_logits: usize) -> Result<()> {
        let (b, k, v) = (self.batch, self.max_draft_tokens, self.vocab_size);
        let arrays = [
            ("target_logits", num_logits, b * (k + 1) * v),
            ("draft_token_ids", self.draft_token_ids.len(), b * k),
            ("num_draft_tokens", self.num_draft_tokens.len(), b),
            ("temperatures", self.temperatures.len(), b),
            ("uniforms", self.uniforms.len(), b * (k + 1)),
            ("draft_probs", self.draft_probs.map_or(b * k * v, <[f32]>::len), b * k * v),
        ];
        let wrong = super::shape_errors(
            &arrays,
            ("num_draft_tokens", self.num_draft_tokens, k, "max_draft_tokens"),
            self.draft_token_ids,
            v,
        );
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(Error::Internal(format!("batched acceptance input: {}", wrong.join("; "))))
        }
    }
}

/// The CPU reference of `cuda/accept.cu`.
pub fn accept(input: &AcceptInput) -> Result<AcceptOutput> {
    input.check()?;
    let (k, v) = (input.max_draft_tokens, input.vocab_size);
    let mut out = AcceptOutput { num_accepted_tokens: Vec::new(), next_token_ids: Vec::new() };
    for s in 0..input.batch {
        let logits = &input.target_logits[s * (k + 1) * v..(s + 1) * (k + 1) * v];
        let row = |i: usize| &logits[i * v..(i + 1) * v];
        let n = input.num_draft_tokens[s] as usize;
        let drafts = &input.draft_token_ids[s * k..s * k + n];
        let uniforms = &input.uniforms[s * (k + 1)..(s + 1) * (k + 1)];
        let temperature = input.temperatures[s];
        let (accepted, next) = if temperature <= 0.0 {
            let accepted = drafts.iter().enumerate().position(|(i, &d)| argmax(row(i)) != d).unwrap_or(n);
            (accepted, argmax(row(accepted)))
        } else {
            let params = SamplingParams { temperature, ..SamplingParams::default() };
            let q_row = |i: usize| input.draft_probs.map(|q| &q[(s * k + i) * v..(s * k + i + 1) * v]);
            sample_one(drafts, &row, &q_row, &params, uniforms)
        };
        out.num_accepted_tokens.push(accepted as u32);
        out.next_token_ids.push(next);
    }
    Ok(out)
}

/// Rejection sampling for one sequence, in `verify::verify`'s order of draws.
fn sample_one<'a>(
    drafts: &[u32],
    row: &dyn Fn(usize) -> &'a [f32],
    q_row: &dyn Fn(usize) -> Option<&'a [f32]>,
    params: &SamplingParams,
    uniforms: &[f32],
) -> (usize, u32) {
    for (i, &draft) in drafts.iter().enumerate() {
        let mut p = probabilities(row(i), params);
        let x = draft as usize;
        let q = q_row(i);
        if uniforms[i] * q.map_or(1.0, |q| q[x]) < p[x] {
            continue;
        }
        match q {
            None => p[x] = 0.0,
            Some(q) => p.iter_mut().zip(q).for_each(|(p, &q)| *p = (*p - q).max(0.0)),
        }
        if p.iter().sum::<f32>() <= 0.0 {
            p = probabilities(row(i), params);
        }
        return (i, draw_with(&p, uniforms[i + 1]));
    }
    let n = drafts.len();
    (n, draw_with(&probabilities(row(n), params), uniforms[n]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Sampler;
    use crate::verify::verify;

    /// A small deterministic generator for test inputs.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    fn normalized(values: Vec<f32>) -> Vec<f32> {
        let total: f32 = values.iter().sum();
        values.into_iter().map(|x| x / total).collect()
    }

    /// Random batches whose drafts often agree with the target (two rows in three are made peaked
    /// around the drafted token), so every path is taken: accept all, reject, no draft.
    fn check_against_verify(with_probs: bool) {
        let (b, k, v) = (24, 4, 16);
        let mut rng = Lcg(7);
        let mut draft_ids = Vec::new();
        let mut num_draft = Vec::new();
        let mut logits = Vec::new();
        let mut q = Vec::new();
        for s in 0..b {
            let n = s % (k + 1);
            num_draft.push(n as u32);
            for i in 0..k {
                let token = (rng.next() * v as f32) as u32 % v as u32;
                draft_ids.push(token);
                let peaked = i < n && (s + i) % 3 != 2;
                let row: Vec<f32> =
                    (0..v).map(|t| rng.next() * 2.0 + if peaked && t as u32 == token { 3.0 } else { 0.0 }).collect();
                logits.extend(row);
                let mut q_row: Vec<f32> = (0..v).map(|_| rng.next()).collect();
                q_row[token as usize] += 2.0;
                q.extend(normalized(q_row));
            }
            logits.extend((0..v).map(|_| rng.next() * 2.0));
        }
        let temperatures: Vec<f32> = (0..b).map(|s| [0.0, 0.7, 1.0, 1.5][s % 4]).collect();
        let seeds: Vec<u64> = (0..b as u64).map(|s| 1000 + s).collect();
        let uniforms: Vec<f32> = seeds
            .iter()
            .flat_map(|&seed| {
                let mut sampler = Sampler::new(Some(seed));
                (0..=k).map(move |_| sampler.uniform()).collect::<Vec<_>>()
            })
            .collect();
        let input = AcceptInput {
            batch: b,
            max_draft_tokens: k,
            vocab_size: v,
            target_logits: &logits,
            draft_token_ids: &draft_ids,
            num_draft_tokens: &num_draft,
            draft_probs: with_probs.then_some(&q[..]),
            temperatures: &temperatures,
            uniforms: &uniforms,
        };
        let out = accept(&input).unwrap();
        let mut paths = std::collections::BTreeSet::new();
        for s in 0..b {
            let n = num_draft[s] as usize;
            let rows = &logits[s * (k + 1) * v..][..(n + 1) * v];
            let drafted = &draft_ids[s * k..s * k + n];
            let one_hot: Vec<f32> =
                drafted.iter().flat_map(|&x| (0..v).map(move |t| if t as u32 == x { 1.0 } else { 0.0 })).collect();
            let probs = if with_probs { &q[s * k * v..][..n * v] } else { &one_hot[..] };
            let params = SamplingParams { temperature: temperatures[s], ..SamplingParams::default() };
            let mut sampler = Sampler::new(Some(seeds[s]));
            let expected = verify(rows, v, drafted, Some(probs), &params, &mut sampler, 0).unwrap();
            assert_eq!(out.num_accepted_tokens[s] as usize, expected.num_accepted_tokens, "sequence {s}");
            assert_eq!(out.next_token_ids[s], *expected.token_ids.last().unwrap(), "sequence {s}");
            paths.insert((n > 0, expected.num_accepted_tokens == n));
        }
        assert_eq!(paths.len(), 3, "accepted-all, rejected and no-draft paths must all occur: {paths:?}");
    }

    #[test]
    fn equals_verify_with_draft_probabilities() {
        check_against_verify(true);
    }

    #[test]
    fn equals_verify_with_deterministic_drafts() {
        check_against_verify(false);
    }

    #[test]
    fn bad_shapes_are_named() {
        let input = AcceptInput {
            batch: 1,
            max_draft_tokens: 2,
            vocab_size: 4,
            target_logits: &[0.0; 12],
            draft_token_ids: &[1, 9],
            num_draft_tokens: &[3],
            draft_probs: None,
            temperatures: &[0.0],
            uniforms: &[0.5; 2],
        };
        let message = accept(&input).unwrap_err().to_string();
        for expected in ["uniforms has 2 values, expected 3", "num_draft_tokens 3", "draft token 9"] {
            assert!(message.contains(expected), "{message}");
        }
    }
}
