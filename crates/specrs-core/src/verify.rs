//! Verification: which draft tokens the target keeps, and the target's own next token.
//!
//! Invariant (losslessness): the emitted tokens have exactly the distribution plain decoding
//! would give. Greedy keeps the longest draft prefix equal to the target's argmax, then the
//! target's own argmax (recovered) or, when every draft token passed, the argmax after the last
//! one (bonus). Sampling is rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft
//! token x with draft probability q(x) is accepted with probability min(1, p(x)/q(x)), where p is
//! the target distribution after temperature/top-k/top-p/min-p (`sampler::probabilities`); the
//! first rejected position emits a token recovered from norm(max(0, p - q)); a bonus token comes
//! from p after the last draft. A draft without probabilities is deterministic: q is one-hot.
//!
//! For a one-hot draft, rejection sampling is run in its coupled form: the target token of each
//! position is drawn from p with that position's own uniform (`Sampler::draw_at`), the draft token
//! is accepted iff it equals it, and otherwise that drawn token is the recovered one. This is
//! exactly rejection sampling with q one-hot (x passes with probability p(x) = min(1, p(x)/1); a
//! token drawn from p given it is not x is drawn from norm(max(0, p - onehot(x)))), and it emits
//! the very token plain decoding draws at that position: a seeded request's output does not
//! depend on its draft lengths, nor on whether it speculated at all. So a scheduler may cut the
//! drafts of such requests by load without changing any output (engine/scheduler.rs). Seeded
//! requests' model drafts use it too by default (the config's "verification": "auto"): they draw
//! each sampled token with the same positional uniform over their own q and hand no q over
//! (`proposer/draft_model.rs`), so any draft is exact this way and a close draft is accepted.
//! Drafts with probabilities (unseeded requests' under "auto", "rejection", a custom proposer's)
//! keep the sequential stream: their output depends on the draft itself.
//!
//! Token trees are verified by `tree::verify_tree`, the same rules walked over a tree. Both are
//! one-sequence wrappers over the one walk of `host.rs`, which verifies a whole `batch::VerifyBatch`.

pub mod batch;
pub mod device;
pub mod host;
#[cfg(test)]
mod old_walks;
pub mod tree;

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::sampler::Sampler;

/// What one verification keeps: the accepted draft tokens followed by one target token
/// (recovered at the first rejection, or bonus when all drafts were accepted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verification {
    pub num_accepted_tokens: usize,
    /// `num_accepted_tokens + 1` tokens.
    pub token_ids: Vec<u32>,
}

/// Verifies `draft_ids` (length n) against `target_logits` `[n + 1, vocab_size]` (row i scores the
/// token after the context plus the first i drafts). `draft_probs` is `[n, vocab_size]` or None.
/// `position` is the index (in prompt + output) of the first token this verification emits.
pub fn verify(
    target_logits: &[f32],
    vocab_size: usize,
    draft_ids: &[u32],
    draft_probs: Option<&[f32]>,
    params: &SamplingParams,
    sampler: &mut Sampler,
    position: usize,
) -> Result<Verification> {
    let n = draft_ids.len();
    if target_logits.len() != (n + 1) * vocab_size {
        return Err(Error::Internal(format!(
            "verify: {} target logits for {n} draft tokens and vocab {vocab_size}",
            target_logits.len()
        )));
    }
    let parents: Vec<i32> = (0..n as i32).map(|i| i - 1).collect();
    let (path, next) = host::verify_one(
        target_logits,
        vocab_size,
        draft_ids,
        &parents,
        draft_probs,
        params,
        sampler,
        position,
        false,
    )?;
    let mut token_ids: Vec<u32> = path.iter().map(|&i| draft_ids[i]).collect();
    token_ids.push(next);
    Ok(Verification { num_accepted_tokens: path.len(), token_ids })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{argmax, probabilities};

    const VOCAB: usize = 6;

    fn sampled(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, ..Default::default() }
    }

    /// `rows` rows of fixed pseudo-random logits `[rows, VOCAB]`.
    fn logits(rows: usize, salt: u32) -> Vec<f32> {
        (0..rows * VOCAB).map(|i| (((i as u32).wrapping_mul(2654435761u32) ^ salt) % 1000) as f32 / 250.0).collect()
    }

    /// Chi-square critical value at p = 0.001 (Wilson-Hilferty approximation).
    fn chi_square_critical(df: usize) -> f64 {
        let df = df as f64;
        let z = 3.0902;
        df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
    }

    /// Chi-square statistic of `counts` against `probs`, over the cells with nonzero probability;
    /// a count in a zero-probability cell is an immediate failure.
    fn chi_square(counts: &[usize], probs: &[f32]) -> (f64, usize) {
        let n: usize = counts.iter().sum();
        let mut statistic = 0.0;
        let mut cells = 0;
        for (&c, &p) in counts.iter().zip(probs) {
            if p == 0.0 {
                assert_eq!(c, 0, "a token outside the target's support was emitted: {counts:?} vs {probs:?}");
                continue;
            }
            let expected = n as f64 * p as f64;
            statistic += (c as f64 - expected).powi(2) / expected;
            cells += 1;
        }
        (statistic, cells - 1)
    }

    /// First emitted token over `draws` verifications of a 3-token draft; each draw uses fresh draft
    /// tokens sampled from the draft distribution, as a real draft model would.
    fn first_token_histogram(params: &SamplingParams, draft_probs: Option<&[f32]>, draws: usize) -> Vec<usize> {
        let target = logits(4, 17);
        let mut sampler = Sampler::new(Some(1234));
        let mut draft_sampler = Sampler::new(Some(99));
        let mut counts = vec![0usize; VOCAB];
        for position in 0..draws {
            let draft: Vec<u32> = match draft_probs {
                Some(q) => (0..3).map(|i| draft_sampler.draw(&q[i * VOCAB..(i + 1) * VOCAB])).collect(),
                // A fixed guess: averaging over guesses spread evenly would hide a biased recovery.
                None => vec![3, 2, 4],
            };
            let v = verify(&target, VOCAB, &draft, draft_probs, params, &mut sampler, position).unwrap();
            counts[v.token_ids[0] as usize] += 1;
        }
        counts
    }

    #[test]
    fn rejection_sampling_reproduces_the_target_distribution() {
        let q: Vec<f32> = {
            let raw = logits(3, 5);
            raw.chunks(VOCAB).flat_map(|row| probabilities(row, &sampled(0.7, 0, 1.0))).collect()
        };
        for params in [sampled(1.0, 0, 1.0), sampled(0.8, 3, 1.0), sampled(1.3, 0, 0.6), sampled(0.5, 4, 0.9)] {
            let expected = probabilities(&logits(4, 17)[..VOCAB], &params);
            for draft_probs in [None, Some(q.as_slice())] {
                let counts = first_token_histogram(&params, draft_probs, 100_000);
                let (statistic, df) = chi_square(&counts, &expected);
                let critical = if df == 0 { 0.0 } else { chi_square_critical(df) };
                assert!(
                    statistic <= critical,
                    "{params:?} draft_probs={}: chi2 {statistic:.1} > {critical:.1}; {counts:?} vs {expected:?}",
                    draft_probs.is_some()
                );
            }
        }
    }

    #[test]
    fn greedy_keeps_the_matching_prefix_then_the_target_token() {
        let target = logits(4, 3);
        let argmaxes: Vec<u32> = target.chunks(VOCAB).map(argmax).collect();
        let mut sampler = Sampler::new(Some(0));
        let greedy = SamplingParams::greedy(16);
        let all = verify(&target, VOCAB, &argmaxes[..3], None, &greedy, &mut sampler, 0).unwrap();
        assert_eq!(all, Verification { num_accepted_tokens: 3, token_ids: argmaxes.clone() });
        let wrong = (argmaxes[1] + 1) % VOCAB as u32;
        let partial =
            verify(&target, VOCAB, &[argmaxes[0], wrong, argmaxes[2]], None, &greedy, &mut sampler, 0).unwrap();
        assert_eq!(partial, Verification { num_accepted_tokens: 1, token_ids: argmaxes[..2].to_vec() });
        let none = verify(&target[..VOCAB], VOCAB, &[], None, &greedy, &mut sampler, 0).unwrap();
        assert_eq!(none.token_ids, vec![argmaxes[0]]);
    }

    #[test]
    fn acceptance_properties() {
        let target = logits(5, 11); // [5, VOCAB]: four draft positions and the bonus row
        let params = sampled(1.0, 0, 1.0);
        // q = p accepts everything.
        let p: Vec<f32> = target.chunks(VOCAB).take(4).flat_map(|row| probabilities(row, &params)).collect();
        let mut sampler = Sampler::new(Some(5));
        let mut draft_sampler = Sampler::new(Some(6));
        for _ in 0..2000 {
            let draft: Vec<u32> = (0..4).map(|i| draft_sampler.draw(&p[i * VOCAB..(i + 1) * VOCAB])).collect();
            let v = verify(&target, VOCAB, &draft, Some(&p), &params, &mut sampler, 0).unwrap();
            assert_eq!(v.num_accepted_tokens, 4);
            assert_eq!(&v.token_ids[..4], &draft[..]);
        }
        // A draft token the target gives zero probability (outside top-k) is never accepted, and
        // accepted <= k always.
        let top1 = sampled(1.0, 1, 1.0);
        for seed in 0..500 {
            let mut sampler = Sampler::new(Some(seed));
            let draft: Vec<u32> = target.chunks(VOCAB).take(4).map(|row| (argmax(row) + 1) % VOCAB as u32).collect();
            let v = verify(&target, VOCAB, &draft, None, &top1, &mut sampler, 0).unwrap();
            assert_eq!(v.num_accepted_tokens, 0);
            assert_eq!(v.token_ids, vec![argmax(&target[..VOCAB])]);
            let v = verify(&target[..3 * VOCAB], VOCAB, &draft[..2], None, &params, &mut sampler, 0).unwrap();
            assert!(v.num_accepted_tokens <= 2 && v.token_ids.len() == v.num_accepted_tokens + 1);
        }
        // Seeded determinism.
        let run = |seed| {
            let mut sampler = Sampler::new(Some(seed));
            (0..50)
                .map(|step| verify(&target, VOCAB, &[1, 2, 3, 4], None, &params, &mut sampler, step * 5).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn a_one_hot_draft_never_changes_the_sampled_tokens() {
        // Whatever the draft (none, right, wrong, long or short), position i emits the token plain
        // sampling draws there: the output depends on the seed and the logits alone.
        let target = logits(5, 23);
        let params = sampled(1.0, 0, 1.0);
        let sampler = Sampler::new(Some(9));
        for start in [0usize, 7, 100] {
            let plain: Vec<u32> = (0..5)
                .map(|i| sampler.draw_at(&probabilities(&target[i * VOCAB..(i + 1) * VOCAB], &params), start + i))
                .collect();
            for draft in [vec![], plain[..2].to_vec(), plain[..4].to_vec(), vec![plain[0], (plain[1] + 1) % 6, 0]] {
                let n = draft.len();
                let mut s = Sampler::new(Some(9));
                let v = verify(&target[..(n + 1) * VOCAB], VOCAB, &draft, None, &params, &mut s, start).unwrap();
                assert_eq!(v.token_ids, plain[..v.token_ids.len()], "draft {draft:?}");
                let expected_accepted = draft.iter().zip(&plain).take_while(|(d, p)| d == p).count();
                assert_eq!(v.num_accepted_tokens, expected_accepted);
            }
        }
    }
}
