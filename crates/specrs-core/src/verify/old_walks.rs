//! Today's walks before the one verifier (`verify` of verify.rs and `verify_tree` of
//! verify/tree.rs at the commit that added verify/host.rs), copied verbatim as the oracles
//! `host.rs`'s tests compare the one walk with. Test-only.
//!
//! Invariant: never edited; a change here would move the oracle with the code it checks.

use super::tree::TreeVerification;
use super::Verification;
use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::sampler::{argmax, probabilities, Sampler};
use crate::tree::children;

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
    let row = |i: usize| &target_logits[i * vocab_size..(i + 1) * vocab_size];
    let mut token_ids = Vec::with_capacity(n + 1);
    if params.is_greedy() {
        for (i, &draft) in draft_ids.iter().enumerate() {
            let target = argmax(row(i));
            token_ids.push(target);
            if target != draft {
                return Ok(Verification { num_accepted_tokens: i, token_ids });
            }
        }
        token_ids.push(argmax(row(n)));
        return Ok(Verification { num_accepted_tokens: n, token_ids });
    }
    let Some(draft_probs) = draft_probs else {
        // Coupled rejection sampling for a one-hot draft (see the module header).
        for (i, &draft) in draft_ids.iter().enumerate() {
            let target = sampler.draw_at(&probabilities(row(i), params), position + i);
            token_ids.push(target);
            if target != draft {
                return Ok(Verification { num_accepted_tokens: i, token_ids });
            }
        }
        token_ids.push(sampler.draw_at(&probabilities(row(n), params), position + n));
        return Ok(Verification { num_accepted_tokens: n, token_ids });
    };
    for (i, &draft) in draft_ids.iter().enumerate() {
        let mut target_probs = probabilities(row(i), params);
        let x = draft as usize;
        let q = &draft_probs[i * vocab_size..(i + 1) * vocab_size];
        // Accept with probability min(1, p(x)/q(x)), written without the division so q(x) = 0
        // cannot produce NaN.
        if sampler.uniform() * q[x] < target_probs[x] {
            token_ids.push(draft);
            continue;
        }
        // Recovered token from norm(max(0, p - q)).
        target_probs.iter_mut().zip(q).for_each(|(p, &q)| *p = (*p - q).max(0.0));
        let residual_mass: f32 = target_probs.iter().sum();
        let recovered = if residual_mass > 0.0 {
            sampler.draw(&target_probs)
        } else {
            // p <= q everywhere can only happen through rounding when p == q, which always accepts;
            // drawing from p keeps the output a valid target sample.
            sampler.draw(&probabilities(row(i), params))
        };
        token_ids.push(recovered);
        return Ok(Verification { num_accepted_tokens: i, token_ids });
    }
    token_ids.push(sampler.draw(&probabilities(row(n), params)));
    Ok(Verification { num_accepted_tokens: n, token_ids })
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
    let kids = children(parents); // kids[0]: the root's; kids[i + 1]: node i's
    let row = |node: usize| &target_logits[node * vocab_size..(node + 1) * vocab_size]; // node 0 = root
    let mut accepted_path = Vec::new();
    let mut token_ids = Vec::new();
    let mut node = 0; // the current node's logits row: 0 = root, i + 1 = draft node i
    loop {
        let depth = accepted_path.len();
        let candidates = &kids[node];
        let chosen = match draft_probs {
            _ if params.is_greedy() => {
                let target = argmax(row(node));
                Err(target)
            }
            None => Err(sampler.draw_at(&probabilities(row(node), params), position + depth)),
            Some(probs) => rejection_step(row(node), probs, vocab_size, draft_ids, candidates, params, sampler),
        };
        // Greedy and coupled verification produce the target's token first; find the child equal
        // to it.
        let chosen =
            chosen.or_else(|target| candidates.iter().copied().find(|&child| draft_ids[child] == target).ok_or(target));
        match chosen {
            Ok(child) => {
                accepted_path.push(child);
                token_ids.push(draft_ids[child]);
                node = child + 1;
            }
            Err(target) => {
                token_ids.push(target);
                return Ok(TreeVerification { accepted_path, token_ids });
            }
        }
    }
}

/// One node's recursive rejection sampling over its `candidates` (children in draw order):
/// `Ok(child)` accepted, or `Err(token)` recovered from the last residual (the bonus token when
/// there are no candidates).
fn rejection_step(
    logits: &[f32],
    draft_probs: &[f32],
    vocab_size: usize,
    draft_ids: &[u32],
    candidates: &[usize],
    params: &SamplingParams,
    sampler: &mut Sampler,
) -> std::result::Result<usize, u32> {
    let target_probs = probabilities(logits, params);
    let Some(&first) = candidates.first() else { return Err(sampler.draw(&target_probs)) };
    let mut p = target_probs.clone();
    let mut q = draft_probs[first * vocab_size..(first + 1) * vocab_size].to_vec();
    for &child in candidates {
        let x = draft_ids[child] as usize;
        // p and q are unnormalized after a rejection: p_i = p / p_sum, q_i = q / q_sum. Accept with
        // probability min(1, p_i(x)/q_i(x)), written without the division so q(x) = 0 cannot
        // produce NaN.
        let p_sum: f32 = p.iter().sum();
        let q_sum: f32 = q.iter().sum();
        if sampler.uniform() * q[x] * p_sum < p[x] * q_sum {
            return Ok(child);
        }
        // p <- max(0, p_i - q_i) (draws normalize), and x leaves q: the next sibling was drawn
        // without it.
        p.iter_mut().zip(&q).for_each(|(p, &q)| *p = (*p / p_sum - q / q_sum).max(0.0));
        q[x] = 0.0;
        if p.iter().sum::<f32>() <= 0.0 {
            // p <= q everywhere only happens through rounding when p == q, which always accepts;
            // drawing from p keeps the output a valid target sample.
            return Err(sampler.draw(&target_probs));
        }
    }
    Err(sampler.draw(&p))
}
