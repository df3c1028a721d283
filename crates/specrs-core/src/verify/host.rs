//! The one host verifier: walks every sequence of a `VerifyBatch` (a chain is a one-path tree)
//! from its root, deciding at each node among its children in index order (verify.rs's header
//! gives the rules and why they are lossless).
//!
//! - Greedy: the child equal to the row's argmax is accepted, else the argmax is emitted.
//! - Coupled: the row's token is drawn from p with the row's noise; the child equal to it is
//!   accepted, else it is emitted.
//! - Rejection: the sequence's uniforms are read in order, one per child tried and one for the
//!   final draw. A draft not declared a tree runs the chain's arithmetic (`u * q[x] < p[x]`,
//!   residual `max(0, p - q)`); a declared tree runs recursive rejection sampling without
//!   replacement with running sums (`u * q[x] * p_sum < p[x] * q_sum`), even when chain-shaped.
//!   A node without a q row is one-hot. As in today's tree walk, a recovered token equal to a
//!   child accepts that child (only the rounding fallback, which draws from p, can produce one).
//!
//! Invariant: bitwise the walks of today's `verify` (chain) and `verify_tree` (tree): the same
//! tokens, the same path and the same count of sequential uniforms read, for every mode, filter
//! and shape (tests: `one_verifier_equals_the_old_walks`, tests/verify_pins.rs). Sequences are
//! independent, so walking them in parallel changes no bit.

use rayon::prelude::*;

use super::batch::{Mode, RowNoise, SeqRule, Verdicts, VerifyBatch, VerifyBatchBuilder, NO_ROW};
use crate::config::SamplingParams;
use crate::error::Result;
use crate::sampler::{argmax, draw_with, probabilities, Sampler};
use crate::tree::children;

/// One sequence's verdict: accepted nodes (root's child first), the next token, uniforms read.
struct SeqVerdict {
    accepted: Vec<u32>,
    next_token: u32,
    uniforms_used: u32,
}

/// Verifies every sequence of `batch` against `logits` `[R, V]` (row order as in the batch).
pub fn verify_batch(batch: &VerifyBatch, logits: &[f32]) -> Result<Verdicts> {
    batch.check(logits.len())?;
    let seqs: Vec<SeqVerdict> = (0..batch.num_seqs()).into_par_iter().map(|s| walk(batch, logits, s)).collect();
    let mut out = Verdicts { accepted_offsets: vec![0], ..Default::default() };
    for seq in seqs {
        out.accepted_nodes.extend(&seq.accepted);
        out.accepted_offsets.push(out.accepted_nodes.len() as u32);
        out.next_tokens.push(seq.next_token);
        out.uniforms_used.push(seq.uniforms_used);
    }
    Ok(out)
}

/// The sequential stream of one sequence: its pre-drawn uniforms, read in order.
struct Stream<'a> {
    uniforms: &'a [f32],
    used: usize,
}

impl Stream<'_> {
    fn uniform(&mut self) -> f32 {
        let u = self.uniforms[self.used];
        self.used += 1;
        u
    }
}

fn walk(batch: &VerifyBatch, logits: &[f32], s: usize) -> SeqVerdict {
    let v = batch.vocab_size;
    let nodes = batch.nodes(s);
    let ids = &batch.draft_ids[nodes.clone()];
    let rule = &batch.rules[s];
    let params = rule.params();
    let root_row = batch.root_row(s);
    // node 0 = the root, i + 1 = draft node i (the logits row after the root row).
    let row = |node: usize| &logits[(root_row + node) * v..(root_row + node + 1) * v];
    let q_row = |i: usize| -> Vec<f32> {
        match batch.prob_rows[nodes.start + i] {
            NO_ROW => {
                let mut q = vec![0.0; v];
                q[ids[i] as usize] = 1.0;
                q
            }
            r => batch.draft_probs[r as usize * v..(r as usize + 1) * v].to_vec(),
        }
    };
    let mut stream = Stream { uniforms: batch.seq_uniforms(s), used: 0 };
    let done = |accepted: Vec<u32>, next_token: u32, used: usize| SeqVerdict {
        accepted,
        next_token,
        uniforms_used: used as u32,
    };
    if rule.mode == Mode::Rejection && !rule.declared_tree {
        let (accepted, token) = rejection_chain(ids, &row, &q_row, &params, &mut stream);
        return done(accepted, token, stream.used);
    }
    let kids = children(&batch.parents[nodes.clone()]);
    let mut accepted = Vec::new();
    let mut node = 0;
    loop {
        let candidates = &kids[node];
        let chosen = match rule.mode {
            Mode::Greedy => Err(argmax(row(node))),
            Mode::Coupled => {
                let RowNoise::Uniform(u) = batch.row_noise[root_row + node];
                Err(draw_with(&probabilities(row(node), &params), u))
            }
            Mode::Rejection => rejection_tree_step(row(node), &q_row, ids, candidates, &params, &mut stream),
        };
        // Greedy and coupled produce the target's token first; find the child equal to it.
        let chosen = chosen.or_else(|target| candidates.iter().copied().find(|&c| ids[c] == target).ok_or(target));
        match chosen {
            Ok(child) => {
                accepted.push(child as u32);
                node = child + 1;
            }
            Err(token) => return done(accepted, token, stream.used),
        }
    }
}

/// Leviathan et al.'s chain rule, in today's chain arithmetic (verify.rs before the batch).
fn rejection_chain<'a>(
    ids: &[u32],
    row: &dyn Fn(usize) -> &'a [f32],
    q_row: &dyn Fn(usize) -> Vec<f32>,
    params: &SamplingParams,
    stream: &mut Stream,
) -> (Vec<u32>, u32) {
    let mut accepted = Vec::new();
    for (i, &draft) in ids.iter().enumerate() {
        let mut target_probs = probabilities(row(i), params);
        let x = draft as usize;
        let q = q_row(i);
        // Accept with probability min(1, p(x)/q(x)), written without the division so q(x) = 0
        // cannot produce NaN.
        if stream.uniform() * q[x] < target_probs[x] {
            accepted.push(i as u32);
            continue;
        }
        // Recovered token from norm(max(0, p - q)).
        target_probs.iter_mut().zip(&q).for_each(|(p, &q)| *p = (*p - q).max(0.0));
        let residual_mass: f32 = target_probs.iter().sum();
        let recovered = if residual_mass > 0.0 {
            draw_with(&target_probs, stream.uniform())
        } else {
            // p <= q everywhere only happens through rounding when p == q, which always accepts;
            // drawing from p keeps the output a valid target sample.
            draw_with(&probabilities(row(i), params), stream.uniform())
        };
        return (accepted, recovered);
    }
    (accepted, draw_with(&probabilities(row(ids.len()), params), stream.uniform()))
}

/// One node's recursive rejection sampling over its `candidates` (children in draw order), in
/// today's tree arithmetic (verify/tree.rs before the batch): `Ok(child)` accepted, or
/// `Err(token)` recovered from the last residual (the bonus token when there are no candidates).
fn rejection_tree_step(
    logits: &[f32],
    q_row: &dyn Fn(usize) -> Vec<f32>,
    ids: &[u32],
    candidates: &[usize],
    params: &SamplingParams,
    stream: &mut Stream,
) -> std::result::Result<usize, u32> {
    let target_probs = probabilities(logits, params);
    let Some(&first) = candidates.first() else { return Err(draw_with(&target_probs, stream.uniform())) };
    let mut p = target_probs.clone();
    // Siblings were drawn from the first sibling's row without replacement.
    let mut q = q_row(first);
    for &child in candidates {
        let x = ids[child] as usize;
        // p and q are unnormalized after a rejection: p_i = p / p_sum, q_i = q / q_sum. Accept with
        // probability min(1, p_i(x)/q_i(x)), written without the division.
        let p_sum: f32 = p.iter().sum();
        let q_sum: f32 = q.iter().sum();
        if stream.uniform() * q[x] * p_sum < p[x] * q_sum {
            return Ok(child);
        }
        // p <- max(0, p_i - q_i) (draws normalize), and x leaves q: the next sibling was drawn
        // without it.
        p.iter_mut().zip(&q).for_each(|(p, &q)| *p = (*p / p_sum - q / q_sum).max(0.0));
        q[x] = 0.0;
        if p.iter().sum::<f32>() <= 0.0 {
            // p <= q everywhere only happens through rounding when p == q, which always accepts;
            // drawing from p keeps the output a valid target sample.
            return Err(draw_with(&target_probs, stream.uniform()));
        }
    }
    Err(draw_with(&p, stream.uniform()))
}

/// One sequence through the batch walk, drawing from `sampler` as today's `verify` (a chain,
/// `declared_tree` false) and `verify_tree` (`declared_tree` true) did: coupled rows get their
/// positions' uniforms, and rejection reads the sequential stream, which then advances by exactly
/// the uniforms the walk used. Returns the accepted nodes and the recovered or bonus token.
#[allow(clippy::too_many_arguments)] // one per input of the rule, as verify / verify_tree
pub fn verify_one(
    logits: &[f32],
    vocab_size: usize,
    draft_ids: &[u32],
    parents: &[i32],
    draft_probs: Option<&[f32]>,
    params: &SamplingParams,
    sampler: &mut Sampler,
    position: usize,
    declared_tree: bool,
) -> Result<(Vec<usize>, u32)> {
    let rule = SeqRule::new(params, draft_probs.is_some(), declared_tree);
    let (row_noise, uniforms) = sequence_inputs(&rule, parents, sampler, position)?;
    let mut builder = VerifyBatchBuilder::new(vocab_size);
    builder.push(draft_ids, parents, rule, &row_noise, &uniforms, draft_probs);
    let verdicts = verify_batch(&builder.batch(), logits)?;
    sampler.skip_uniforms(verdicts.uniforms_used[0] as usize);
    Ok((verdicts.accepted(0).iter().map(|&i| i as usize).collect(), verdicts.next_tokens[0]))
}

/// What `rule` reads of a sequence's random streams for a draft with `parents` whose root token
/// is emitted at `position`: `[n + 1]` row noise (coupled: each row's position's uniform; else
/// unread) and the sequential uniforms a rejection walk may read (peeked: the caller consumes
/// `Verdicts::uniforms_used` of them with `Sampler::skip_uniforms`).
pub fn sequence_inputs(
    rule: &SeqRule,
    parents: &[i32],
    sampler: &Sampler,
    position: usize,
) -> Result<(Vec<RowNoise>, Vec<f32>)> {
    let n = parents.len();
    let row_noise: Vec<RowNoise> = if rule.mode == Mode::Coupled {
        let depths = crate::tree::depths(parents)?;
        std::iter::once(position)
            .chain(depths.iter().map(|d| position + d + 1))
            .map(|p| RowNoise::Uniform(sampler.uniform_at(p)))
            .collect()
    } else {
        vec![RowNoise::Uniform(0.0); n + 1]
    };
    Ok((row_noise, sampler.peek_uniforms(rule.uniforms_needed(n))))
}

#[cfg(test)]
mod tests {
    use super::super::old_walks;
    use super::*;

    /// xorshift64*: the tests' only randomness.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn pick<T: Copy>(&mut self, options: &[T]) -> T {
            options[self.below(options.len())]
        }
    }

    /// One random sequence: its draft, logits `[n + 1, V]`, dense q rows `[n, V]` for the oracle
    /// (a one-hot node's row made explicit) and the batch's q rows (`None` = `NO_ROW`).
    struct Seq {
        ids: Vec<u32>,
        parents: Vec<i32>,
        logits: Vec<f32>,
        rule: SeqRule,
        params: SamplingParams,
        dense_q: Option<Vec<f32>>,
        q_rows: Vec<Option<Vec<f32>>>,
        seed: u64,
        position: usize,
    }

    fn random_seq(rng: &mut Rng, vocab: usize) -> Seq {
        let mode = rng.pick(&[Mode::Greedy, Mode::Coupled, Mode::Rejection]);
        let max_nodes = if vocab > 1000 { 6 } else { 16 };
        let n = rng.below(max_nodes + 1);
        let chain = rng.below(3) == 0;
        let mut parents: Vec<i32> =
            (0..n).map(|i| if chain || i == 0 { i as i32 - 1 } else { rng.below(i + 1) as i32 - 1 }).collect();
        let rows: Vec<(Vec<f32>, u32)> = (0..=n)
            .map(|_| {
                let mut row: Vec<f32> =
                    (0..vocab).map(|_| (rng.below(if vocab < 64 { 8 } else { 1 << 20 }) as f32) * 0.37 - 1.5).collect();
                let favored = rng.below(vocab) as u32;
                if rng.below(3) > 0 {
                    row[favored as usize] += rng.pick(&[0.0, 2.0, 6.0, 20.0]);
                }
                (row, favored)
            })
            .collect();
        let mut ids = vec![0u32; n];
        for i in 0..n {
            let mut siblings: Vec<u32> = (0..i).filter(|&j| parents[j] == parents[i]).map(|j| ids[j]).collect();
            if siblings.len() >= vocab {
                parents[i] = i as i32 - 1; // node i - 1 has no children yet
                siblings.clear();
            }
            let favored = rows[(parents[i] + 1) as usize].1;
            let mut token = if siblings.is_empty() && rng.below(10) < 7 { favored } else { rng.below(vocab) as u32 };
            while siblings.contains(&token) {
                token = (token + 1) % vocab as u32;
            }
            ids[i] = token;
        }
        let is_chain = parents.iter().enumerate().all(|(i, &p)| p == i as i32 - 1);
        let declared_tree = !is_chain || rng.below(2) == 0;
        let params = if mode == Mode::Greedy {
            SamplingParams { temperature: 0.0, ..Default::default() }
        } else {
            SamplingParams {
                temperature: rng.pick(&[0.5, 0.7, 1.0, 1.3]),
                top_k: rng.pick(&[0, 0, 1, 3, 8]),
                top_p: rng.pick(&[1.0, 1.0, 0.9, 0.5]),
                min_p: rng.pick(&[0.0, 0.0, 0.05, 0.2]),
                ..Default::default()
            }
        };
        let logits: Vec<f32> = rows.iter().flat_map(|(r, _)| r.iter().copied()).collect();
        let (dense_q, q_rows) = if mode == Mode::Rejection {
            let mut q_rows: Vec<Option<Vec<f32>>> = Vec::with_capacity(n);
            let mut dense = Vec::with_capacity(n * vocab);
            for i in 0..n {
                let q = match rng.below(8) {
                    0 | 1 => None, // one-hot
                    // q = p of the parent's row: the residual is empty through rounding
                    2 => Some(probabilities(&rows[(parents[i] + 1) as usize].0, &params)),
                    _ => {
                        let mut q: Vec<f32> = (0..vocab).map(|_| rng.below(100) as f32).collect();
                        q[ids[i] as usize] = if rng.below(6) == 0 { 0.0 } else { 50.0 * vocab as f32 };
                        let total: f32 = q.iter().sum::<f32>().max(1.0);
                        q.iter_mut().for_each(|x| *x /= total);
                        Some(q)
                    }
                };
                match &q {
                    Some(q) => dense.extend_from_slice(q),
                    None => dense.extend((0..vocab).map(|t| if t == ids[i] as usize { 1.0 } else { 0.0 })),
                }
                q_rows.push(q);
            }
            (Some(dense), q_rows)
        } else {
            (None, vec![None; n])
        };
        let rule = SeqRule::new(&params, mode == Mode::Rejection, declared_tree);
        assert_eq!(rule.mode, mode);
        Seq { ids, parents, logits, rule, params, dense_q, q_rows, seed: rng.next() % 1000, position: rng.below(1000) }
    }

    /// The old walk of the sequence's shape: (path, tokens, the next sequential uniform).
    fn oracle(seq: &Seq, vocab: usize) -> (Vec<usize>, Vec<u32>, f32) {
        let mut sampler = Sampler::new(Some(seq.seed));
        let probs = seq.dense_q.as_deref();
        let declared_tree = seq.rule.mode != Mode::Rejection || seq.rule.declared_tree;
        let (path, tokens) = if declared_tree {
            let v = old_walks::verify_tree(
                &seq.logits,
                vocab,
                &seq.ids,
                &seq.parents,
                probs,
                &seq.params,
                &mut sampler,
                seq.position,
            )
            .unwrap();
            (v.accepted_path, v.token_ids)
        } else {
            let v = old_walks::verify(&seq.logits, vocab, &seq.ids, probs, &seq.params, &mut sampler, seq.position)
                .unwrap();
            ((0..v.num_accepted_tokens).collect(), v.token_ids)
        };
        (path, tokens, sampler.uniform())
    }

    #[test]
    fn one_verifier_equals_the_old_walks() {
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        let (mut accepted_any, mut rejected_any) = (0, 0);
        for batch_index in 0..1500 {
            let vocab = rng.pick(&[5, 5, 64, 64, 4096]);
            let num_seqs = 1 + rng.below(if vocab > 1000 { 3 } else { 12 });
            let seqs: Vec<Seq> = (0..num_seqs).map(|_| random_seq(&mut rng, vocab)).collect();
            // Flatten.
            let mut node_offsets = vec![0u32];
            let (mut draft_ids, mut parents, mut rules, mut row_noise) = (vec![], vec![], vec![], vec![]);
            let (mut uniform_offsets, mut uniforms) = (vec![0u32], vec![]);
            let (mut prob_rows, mut draft_probs, mut logits) = (vec![], vec![], vec![]);
            for seq in &seqs {
                let sampler = Sampler::new(Some(seq.seed));
                draft_ids.extend(&seq.ids);
                parents.extend(&seq.parents);
                node_offsets.push(draft_ids.len() as u32);
                rules.push(seq.rule);
                let depths = crate::tree::depths(&seq.parents).unwrap();
                row_noise.push(RowNoise::Uniform(sampler.uniform_at(seq.position)));
                row_noise.extend(depths.iter().map(|d| RowNoise::Uniform(sampler.uniform_at(seq.position + d + 1))));
                uniforms.extend(sampler.peek_uniforms(seq.rule.uniforms_needed(seq.ids.len())));
                uniform_offsets.push(uniforms.len() as u32);
                for q in &seq.q_rows {
                    match q {
                        Some(q) => {
                            prob_rows.push((draft_probs.len() / vocab) as u32);
                            draft_probs.extend_from_slice(q);
                        }
                        None => prob_rows.push(NO_ROW),
                    }
                }
                logits.extend_from_slice(&seq.logits);
            }
            let batch = VerifyBatch {
                vocab_size: vocab,
                node_offsets: &node_offsets,
                draft_ids: &draft_ids,
                parents: &parents,
                rules: &rules,
                row_noise: &row_noise,
                uniform_offsets: &uniform_offsets,
                uniforms: &uniforms,
                prob_rows: &prob_rows,
                draft_probs: &draft_probs,
            };
            let verdicts = verify_batch(&batch, &logits).unwrap();
            for (s, seq) in seqs.iter().enumerate() {
                let (path, tokens, next_uniform) = oracle(seq, vocab);
                let accepted: Vec<usize> = verdicts.accepted(s).iter().map(|&i| i as usize).collect();
                let mut emitted: Vec<u32> = accepted.iter().map(|&i| seq.ids[i]).collect();
                emitted.push(verdicts.next_tokens[s]);
                let mut sampler = Sampler::new(Some(seq.seed));
                sampler.skip_uniforms(verdicts.uniforms_used[s] as usize);
                let case = format!(
                    "batch {batch_index} sequence {s}: vocab {vocab}, {:?} declared_tree {}, parents {:?}",
                    seq.rule.mode, seq.rule.declared_tree, seq.parents
                );
                assert_eq!(accepted, path, "{case}: path");
                assert_eq!(emitted, tokens, "{case}: tokens");
                assert_eq!(sampler.uniform().to_bits(), next_uniform.to_bits(), "{case}: stream position");
                if seq.ids.is_empty() {
                    continue;
                }
                if path.is_empty() {
                    rejected_any += 1;
                } else {
                    accepted_any += 1;
                }
            }
        }
        assert!(accepted_any > 1000 && rejected_any > 1000, "accepted {accepted_any}, rejected {rejected_any}");
    }

    #[test]
    fn malformed_batches_are_named() {
        let params = SamplingParams { temperature: 0.7, ..Default::default() };
        let rules = [SeqRule::new(&params, true, false)];
        let logits = vec![0.0f32; 3 * 4];
        let noise = [RowNoise::Uniform(0.5); 3];
        let batch = VerifyBatch {
            vocab_size: 4,
            node_offsets: &[0, 2],
            draft_ids: &[1, 2],
            parents: &[-1, 0],
            rules: &rules,
            row_noise: &noise,
            uniform_offsets: &[0, 2],
            uniforms: &[0.1, 0.2],
            prob_rows: &[NO_ROW, NO_ROW],
            draft_probs: &[],
        };
        let message = |b: &VerifyBatch, logits: &[f32]| verify_batch(b, logits).unwrap_err().to_string();
        assert!(message(&batch, &logits).contains("sequence 0's uniforms has 2 values, expected 3"));
        let batch = VerifyBatch { uniform_offsets: &[0, 3], uniforms: &[0.1, 0.2, 0.3], ..batch };
        assert!(message(&batch, &logits[..8]).contains("logits has 8 values, expected 12"));
        assert!(message(&VerifyBatch { parents: &[-1, 1], ..batch }, &logits).contains("node 1 has parent 1"));
        assert!(message(&VerifyBatch { parents: &[-1, -1], ..batch }, &logits).contains("must be a chain"));
        assert!(message(&VerifyBatch { draft_ids: &[1, 9], ..batch }, &logits).contains("draft token 9"));
        assert!(message(&VerifyBatch { prob_rows: &[0, NO_ROW], ..batch }, &logits).contains("q row 0 of 0"));
        assert!(verify_batch(&batch, &logits).is_ok());
    }
}
