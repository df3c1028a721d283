//! Tree verification: which root-to-node path of a token tree the target keeps, and the target's
//! own next token. A chain is the tree whose token i has parent i - 1, and `verify::verify` is this
//! function on a chain.
//!
//! The walk starts at the root (the newest context token, logits row 0) and, at each node, decides
//! among that node's children in their order (rank 0 first); one accepted child becomes the next
//! node, no accepted child ends the walk with the target's own token (recovered), and a node
//! without children ends it with the bonus token.
//!
//! - Greedy: the child equal to the target's argmax is accepted; else the argmax is emitted.
//! - Deterministic drafts (no probabilities; n-gram, suffix, and the top-k trees of models and
//!   heads), sampled: the coupled form. The target token at depth d is drawn from p with the
//!   position's own uniform (`Sampler::draw_at`) and the child equal to it is accepted; else that
//!   drawn token is emitted. Exactness: whatever the tree, each emitted token is a draw from p
//!   given the tokens before it, which is plain decoding; the tree only decides how many of those
//!   draws one forward checks. The selection of which children to draft may depend on anything
//!   except the target's draws, so choosers and static shapes may prune such trees freely.
//! - Drafts with probabilities: recursive rejection sampling without replacement (Jeon et al.
//!   2024, "Recursive Speculative Decoding", arXiv 2402.14160; SpecInfer's multi-round rejection,
//!   Miao et al. 2023, is the same walk for children drawn with replacement). The children
//!   x_1..x_m of a node must be drawn in order from q without replacement (x_i from q_i = q with
//!   x_1..x_{i-1} removed, renormalized), and how many are kept must not depend on the drawn
//!   tokens themselves. With p_1 = p: child x_i is accepted with probability
//!   min(1, p_i(x_i) / q_i(x_i)); on rejection p_{i+1} = norm(max(0, p_i - q_i)); after m rejections
//!   the recovered token is drawn from p_{m+1}.
//!   Proof sketch: one stage is ordinary rejection sampling, which, given x_i ~ q_i, emits x_i with
//!   probability min(p_i, q_i)(x) and otherwise a draw from its residual: in all, exactly p_i.
//!   Given x_1..x_i, the next child x_{i+1} ~ q_{i+1} is a fresh draw independent of the
//!   rejection's uniform, so stage i + 1 emits exactly p_{i+1}, the residual stage i needs. By
//!   induction from the last stage (whose residual is drawn directly), stage 1 emits p. The walk
//!   then continues from the accepted child, whose children were drawn from q given its path.
//!   With one child per node this is Leviathan et al.'s chain rule, consuming the random stream in
//!   the same order.
//!
//! Invariant (losslessness): the emitted tokens have exactly the distribution plain decoding gives.

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::sampler::Sampler;

/// What one tree verification keeps: the accepted path and the tokens it emits (the path's tokens,
/// then the recovered or bonus token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeVerification {
    /// Draft indices of the accepted nodes, root's child first.
    pub accepted_path: Vec<usize>,
    /// `accepted_path.len() + 1` tokens.
    pub token_ids: Vec<u32>,
}

/// Verifies the tree `draft_ids` / `parents` (n nodes; parents -1 = the root) against
/// `target_logits` `[n + 1, vocab_size]` (row 0 scores the token after the root, row i + 1 the
/// token after node i). `draft_probs` is `[n, vocab_size]`: row i is the distribution node i and
/// its siblings were drawn from (only the first sibling's row is read). `position` is the index
/// (in prompt + output) of the first token this verification emits.
#[allow(clippy::too_many_arguments)] // one per input of the rule; a struct would only rename them
pub fn verify_tree(
    target_logits: &[f32],
    vocab_size: usize,
    draft_ids: &[u32],
    parents: &[i32],
    draft_probs: Option<&[f32]>,
    params: &SamplingParams,
    sampler: &mut Sampler,
    position: usize,
) -> Result<TreeVerification> {
    let n = draft_ids.len();
    if target_logits.len() != (n + 1) * vocab_size || parents.len() != n {
        return Err(Error::Internal(format!(
            "verify_tree: {} target logits and {} parents for {n} draft tokens and vocab {vocab_size}",
            target_logits.len(),
            parents.len()
        )));
    }
    let (accepted_path, next) = super::host::verify_one(
        target_logits,
        vocab_size,
        draft_ids,
        parents,
        draft_probs,
        params,
        sampler,
        position,
        true,
    )?;
    let mut token_ids: Vec<u32> = accepted_path.iter().map(|&i| draft_ids[i]).collect();
    token_ids.push(next);
    Ok(TreeVerification { accepted_path, token_ids })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{argmax, probabilities};

    const VOCAB: usize = 5;

    fn sampled(temperature: f32, top_k: usize) -> SamplingParams {
        SamplingParams { temperature, top_k, ..Default::default() }
    }

    /// Fixed pseudo-random logits `[rows, VOCAB]`.
    fn logits(rows: usize, salt: u32) -> Vec<f32> {
        (0..rows * VOCAB).map(|i| (((i as u32).wrapping_mul(2654435761u32) ^ salt) % 1000) as f32 / 300.0).collect()
    }

    /// Draws `m` distinct tokens from `q` in order, without replacement.
    fn without_replacement(q: &[f32], m: usize, sampler: &mut Sampler) -> Vec<u32> {
        let mut q = q.to_vec();
        let mut drawn = Vec::new();
        for _ in 0..m {
            let x = sampler.draw(&q);
            drawn.push(x);
            q[x as usize] = 0.0;
        }
        drawn
    }

    /// The target's distribution of the first two emitted tokens `[VOCAB * VOCAB]` of a two-level
    /// verification: p(a) at the root and p(b | a) from row a's logits. Logits rows: the root, then
    /// one per first token (a tree of the full first level is scored with these).
    fn joint_two_tokens(root_and_next: &[f32], params: &SamplingParams) -> Vec<f64> {
        let p0 = probabilities(&root_and_next[..VOCAB], params);
        let mut joint = vec![0.0; VOCAB * VOCAB];
        for a in 0..VOCAB {
            let p1 = probabilities(&root_and_next[(a + 1) * VOCAB..(a + 2) * VOCAB], params);
            for b in 0..VOCAB {
                joint[a * VOCAB + b] = p0[a] as f64 * p1[b] as f64;
            }
        }
        joint
    }

    /// Verifies a two-level tree `draws` times and counts the first two emitted tokens: the root
    /// has `width` children; each child c has `width` children whose logits row is the one for c's
    /// token; with `with_probs`, every level is drawn from its own q without replacement.
    fn two_token_histogram(params: &SamplingParams, width: usize, with_probs: bool, draws: usize) -> Vec<usize> {
        let scores = logits(VOCAB + 1, 41); // [root, after token 0, .., after token VOCAB - 1]
        let q_logits = logits(VOCAB + 1, 7);
        let q_row = |r: usize| probabilities(&q_logits[r * VOCAB..(r + 1) * VOCAB], &sampled(0.9, 0));
        let mut sampler = Sampler::new(Some(3));
        let mut draft_sampler = Sampler::new(Some(4));
        let mut counts = vec![0usize; VOCAB * VOCAB];
        for draw in 0..draws {
            let first: Vec<u32> = if with_probs {
                without_replacement(&q_row(0), width, &mut draft_sampler)
            } else {
                (0..width as u32).map(|i| (i * 2 + 1) % VOCAB as u32).collect()
            };
            let mut ids = first.clone();
            let mut parents = vec![-1; width];
            let mut probs: Vec<f32> = first.iter().flat_map(|_| q_row(0)).collect();
            let mut rows: Vec<f32> = scores[..VOCAB].to_vec();
            rows.extend(
                first.iter().flat_map(|&a| scores[(a as usize + 1) * VOCAB..(a as usize + 2) * VOCAB].to_vec()),
            );
            for (i, &a) in first.iter().enumerate() {
                let second: Vec<u32> = if with_probs {
                    without_replacement(&q_row(a as usize + 1), width, &mut draft_sampler)
                } else {
                    (0..width as u32).map(|j| (j + a) % VOCAB as u32).collect()
                };
                for &b in &second {
                    ids.push(b);
                    parents.push(i as i32);
                    probs.extend(q_row(a as usize + 1));
                    // Third-level rows: logits after (a, b); any fixed row works for the first two tokens.
                    rows.extend_from_slice(&scores[..VOCAB]);
                }
            }
            let draft_probs = with_probs.then_some(probs.as_slice());
            let v = verify_tree(&rows, VOCAB, &ids, &parents, draft_probs, params, &mut sampler, draw * 3).unwrap();
            let second = match v.token_ids.get(1) {
                Some(&b) => b,
                // Recovered at the root: the next token would be drawn after it by plain decoding.
                None => sampler.draw(&probabilities(
                    &scores[(v.token_ids[0] as usize + 1) * VOCAB..(v.token_ids[0] as usize + 2) * VOCAB],
                    params,
                )),
            };
            counts[v.token_ids[0] as usize * VOCAB + second as usize] += 1;
        }
        counts
    }

    #[test]
    fn tree_verification_reproduces_the_target_distribution_exactly() {
        // 2e5 draws of the first two tokens, against the exact target joint: every cell within 5
        // standard errors, and a chi-square at p = 0.001.
        for params in [sampled(1.0, 0), sampled(0.7, 4)] {
            let expected = joint_two_tokens(&logits(VOCAB + 1, 41), &params);
            for (width, with_probs) in [(2, false), (3, true), (1, true), (2, true)] {
                let draws = 200_000;
                let counts = two_token_histogram(&params, width, with_probs, draws);
                let mut chi2 = 0.0;
                let mut cells = 0;
                for (cell, (&c, &p)) in counts.iter().zip(&expected).enumerate() {
                    if p == 0.0 {
                        assert_eq!(c, 0, "cell {cell} is outside the target's support");
                        continue;
                    }
                    let mean = draws as f64 * p;
                    let sd = (draws as f64 * p * (1.0 - p)).sqrt();
                    assert!(
                        (c as f64 - mean).abs() <= 5.0 * sd + 1.0,
                        "{params:?} width {width} probs {with_probs}: cell {cell} {c} vs {mean:.0}"
                    );
                    chi2 += (c as f64 - mean).powi(2) / mean;
                    cells += 1;
                }
                let df = (cells - 1) as f64;
                let critical = df * (1.0 - 2.0 / (9.0 * df) + 3.0902 * (2.0 / (9.0 * df)).sqrt()).powi(3);
                assert!(
                    chi2 <= critical,
                    "{params:?} width {width} probs {with_probs}: chi2 {chi2:.1} > {critical:.1}"
                );
            }
        }
    }

    #[test]
    fn greedy_keeps_the_longest_path_equal_to_the_argmaxes() {
        // Row r's argmax; the tree: root -> {w, a0}, a0 -> {a1, w'}, a1 -> {a2}.
        let scores = logits(6, 13);
        let argmax_of = |r: usize| argmax(&scores[r * VOCAB..(r + 1) * VOCAB]);
        let a0 = argmax_of(0);
        let wrong = |t: u32| (t + 1) % VOCAB as u32;
        // Node order: 0 = wrong at root, 1 = a0, 2 = a1 (row 3 = after node 1... scored by row 2 + 1)
        let ids = vec![wrong(a0), a0, argmax_of(2), wrong(argmax_of(2)), argmax_of(3)];
        let parents = vec![-1, -1, 1, 1, 2];
        let v =
            verify_tree(&scores, VOCAB, &ids, &parents, None, &SamplingParams::greedy(16), &mut Sampler::new(None), 0)
                .unwrap();
        assert_eq!(v.accepted_path, vec![1, 2, 4]);
        assert_eq!(v.token_ids, vec![a0, argmax_of(2), argmax_of(3), argmax_of(5)]);
    }

    #[test]
    fn coupled_tree_verification_emits_the_plain_sampled_tokens() {
        // Whatever the deterministic tree, depth d emits the token plain sampling draws at
        // position + d (from the logits row of the path so far).
        let scores = logits(4, 29);
        let params = sampled(1.0, 0);
        let sampler = Sampler::new(Some(11));
        let plain0 = sampler.draw_at(&probabilities(&scores[..VOCAB], &params), 20);
        for ids in [vec![0u32, 1, 2], vec![plain0, (plain0 + 1) % 5, 3], vec![(plain0 + 1) % 5, plain0, 4]] {
            let parents = vec![-1, -1, 0];
            let v =
                verify_tree(&scores, VOCAB, &ids, &parents, None, &params, &mut Sampler::new(Some(11)), 20).unwrap();
            assert_eq!(v.token_ids[0], plain0, "tree {ids:?}");
        }
    }
}
