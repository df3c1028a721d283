//! The device verifier: a step's `VerifyBatch` sequences that need nothing but their logits (greedy,
//! or coupled with temperature alone; one-hot drafts: chains, trees, plain decoding's empty draft)
//! decided where the logits are, all of them in ONE launch of `cuda/accept.cu`'s tree kernel
//! (`batch/cuda.rs`) that reads the forward's logit rows in place, and ONE download (the accepted
//! paths and next tokens). Its descriptor (the packed trees, `batch::tree_accept::PackedTrees`)
//! and the room for the kernel's scratch and output ride the forward's own upload where the
//! forward carries them (`carried`: a paged step's buffer), so the whole step uploads once and
//! allocates nothing for its acceptance; elsewhere they take one upload of their own. On the CPU
//! the same words run through the kernel's reference, so the GPU step's path is tested here.
//!
//! The contract is the host verifier's (`host.rs`); the kernel reads one uniform per row, that of
//! the row's depth: a coupled row's noise is its position's uniform, so it is the row's own noise.
//!
//! Invariant: the kernel's reference (`batch::tree_accept::tree_accept_packed`) on this layout
//! decides what `host::verify_batch` decides on the batch, bitwise, for every greedy and
//! temperature-only coupled sequence (test: `the_device_layout_decides_what_the_host_walk_does`);
//! the kernel equals that reference up to sampled draws within rounding of a CDF boundary
//! (`batch/cuda.rs`).

use super::batch::{Mode, RowNoise, Verdicts, VerifyBatch};
use crate::batch::tree_accept::{tree_accept_launch, upload_packed, PackedTrees, TreeAcceptOutput};
use crate::error::{Error, Result};
use crate::model::CarriedWords;

/// Whether a sequence with `rule` and no q rows is decided by the device verifier.
pub fn takes(rule: &super::batch::SeqRule, has_probs: bool) -> bool {
    !has_probs && (rule.mode == Mode::Greedy || rule.mode == Mode::Coupled && rule.params().is_temperature_only())
}

/// `batch` packed for the kernel; sequence s's root row is `root_rows[s]` of the caller's logits
/// (the forward's, as they are) and its nodes' rows follow it. A sequence the device verifier does
/// not take (`takes`) is an internal error naming it.
pub fn packed(batch: &VerifyBatch, root_rows: &[usize]) -> Result<PackedTrees> {
    let num_seqs = batch.num_seqs();
    if root_rows.len() != num_seqs {
        return Err(Error::Internal(format!("device verify: {num_seqs} sequences, {} root rows", root_rows.len())));
    }
    let max_nodes = (0..num_seqs).map(|s| batch.nodes(s).len()).max().unwrap_or(0);
    let mut packed = PackedTrees::new(max_nodes, batch.vocab_size);
    for (s, &root) in root_rows.iter().enumerate() {
        let (rule, nodes) = (&batch.rules[s], batch.nodes(s));
        let has_probs =
            !batch.prob_rows.is_empty() && nodes.clone().any(|i| batch.prob_rows[i] != super::batch::NO_ROW);
        if !takes(rule, has_probs) {
            return Err(Error::Internal(format!(
                "device verify: sequence {s} ({:?}, top_k {}, top_p {}, min_p {}, q rows {has_probs}) is the host's",
                rule.mode, rule.top_k, rule.top_p, rule.min_p
            )));
        }
        let temperature = if rule.mode == Mode::Greedy { 0.0 } else { rule.temperature };
        let rows = batch.root_row(s)..batch.root_row(s) + nodes.len() + 1;
        let row_uniforms: Vec<f32> = batch.row_noise[rows]
            .iter()
            .map(|noise| {
                let RowNoise::Uniform(u) = *noise;
                if rule.mode == Mode::Coupled {
                    u
                } else {
                    0.0
                }
            })
            .collect();
        packed.push(root, &batch.draft_ids[nodes.clone()], &batch.parents[nodes], temperature, &row_uniforms)?;
    }
    Ok(packed)
}

/// The kernel's output words as the contract's verdicts (no sequential uniform is read).
fn verdicts(words: &[u32], max_nodes: usize) -> Verdicts {
    let out = TreeAcceptOutput::from_words(words, max_nodes);
    let mut verdicts = Verdicts { accepted_offsets: vec![0], ..Default::default() };
    for (s, &count) in out.num_accepted_tokens.iter().enumerate() {
        verdicts.accepted_nodes.extend(&out.accepted_nodes[s * max_nodes..][..count as usize]);
        verdicts.accepted_offsets.push(verdicts.accepted_nodes.len() as u32);
        verdicts.next_tokens.push(out.next_token_ids[s]);
        verdicts.uniforms_used.push(0);
    }
    verdicts
}

/// `host::verify_batch` of `batch` (every sequence one `takes`) where `logits` `[rows, V]` are (the
/// forward's, sequence s's root at row `root_rows[s]`): `verify_packed` with its own upload.
pub fn verify_batch_at(batch: &VerifyBatch, logits: &candle_core::Tensor, root_rows: &[usize]) -> Result<Verdicts> {
    verify_packed(&packed(batch, root_rows)?, logits, None)
}

/// What a step's one upload carries for `verify_packed` of `packed`: its descriptor, and room for
/// the kernel's scratch and output.
pub fn carried(packed: &PackedTrees) -> CarriedWords {
    CarriedWords { words: packed.words(), room: packed.room() }
}

/// The verdicts of `packed` (`packed`'s sequences) over `logits` `[rows, V]` where they are: one
/// kernel launch over the logits in place (on the CPU, the GPU path's tests: the kernel's
/// reference on the same words) and one download, in `carried` (`[words + room]`, the step's
/// upload of `carried(packed)`), or else after one upload of its own.
pub fn verify_packed(
    packed: &PackedTrees,
    logits: &candle_core::Tensor,
    carried: Option<&candle_core::Tensor>,
) -> Result<Verdicts> {
    launch_packed(packed, logits, carried)?.download()
}

/// `verify_packed`'s launch: the kernel enqueued behind the forward, its output words left on
/// the device until `LaunchedVerdicts::download` (a step's only wait for the device).
pub fn launch_packed(
    packed: &PackedTrees,
    logits: &candle_core::Tensor,
    carried: Option<&candle_core::Tensor>,
) -> Result<LaunchedVerdicts> {
    let words = if packed.num_seqs() == 0 {
        None
    } else {
        let uploaded;
        let buffer = match carried {
            Some(buffer) => buffer,
            None => {
                uploaded = upload_packed(packed, logits.device())?;
                &uploaded
            }
        };
        Some(tree_accept_launch(buffer, logits, packed)?)
    };
    Ok(LaunchedVerdicts { words, max_nodes: packed.max_nodes })
}

/// A launched verification's output words `[output words]` u32 where the kernel wrote them.
pub struct LaunchedVerdicts {
    words: Option<candle_core::Tensor>,
    max_nodes: usize,
}

impl LaunchedVerdicts {
    /// The verdicts, in one download (it waits for the kernel, and so for the forward).
    pub fn download(self) -> Result<Verdicts> {
        let words = match self.words {
            Some(words) => words.to_vec1()?,
            None => Vec::new(),
        };
        Ok(verdicts(&words, self.max_nodes))
    }
}

#[cfg(test)]
mod tests {
    use super::super::batch::{SeqRule, VerifyBatchBuilder};
    use super::super::host::{sequence_inputs, verify_batch};
    use super::*;
    use crate::config::SamplingParams;
    use crate::model::candle::UPLOADS;
    use crate::sampler::Sampler;
    use candle_core::{Device, Tensor};
    use std::cell::Cell;

    /// Random greedy and temperature-only coupled sequences (chains, trees, empty drafts, drafts
    /// that follow the argmax) verified by the host walk and by `verify_batch_at` (the tree
    /// kernel's reference on the packed trees): the same verdicts, bitwise, with one upload; the
    /// kernel reads the rows where the caller's logits hold them (here each sequence's after a
    /// junk row).
    #[test]
    fn the_device_layout_decides_what_the_host_walk_does() {
        let mut state = 0x1234_5678_9abc_def1u64;
        let mut below = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n.max(1) as u64) as usize
        };
        let vocab = 24;
        for case in 0..200 {
            let num_seqs = 1 + below(6);
            let mut builder = VerifyBatchBuilder::new(vocab);
            let mut logits: Vec<f32> = Vec::new();
            for s in 0..num_seqs {
                let n = below(7);
                let chain = below(2) == 0;
                let parents: Vec<i32> =
                    (0..n).map(|i| if chain || i == 0 { i as i32 - 1 } else { below(i + 1) as i32 - 1 }).collect();
                let rows: Vec<f32> = (0..(n + 1) * vocab).map(|_| below(40) as f32 * 0.25 - 5.0).collect();
                // Draft tokens: the row's argmax-ish token half the time, distinct among siblings.
                let mut ids = vec![0u32; n];
                for i in 0..n {
                    let row = &rows[(parents[i] + 1) as usize * vocab..][..vocab];
                    let best = crate::sampler::argmax(row);
                    let mut token = if below(2) == 0 { best } else { below(vocab) as u32 };
                    while (0..i).any(|j| parents[j] == parents[i] && ids[j] == token) {
                        token = (token + 1) % vocab as u32;
                    }
                    ids[i] = token;
                }
                let params = match below(2) {
                    0 => SamplingParams { temperature: 0.0, ..Default::default() },
                    _ => SamplingParams { temperature: [0.6, 1.0, 1.4][below(3)], ..Default::default() },
                };
                let rule = SeqRule::new(&params, false, !chain);
                let sampler = Sampler::new(Some(case * 10 + s as u64));
                let (noise, uniforms) = sequence_inputs(&rule, &parents, &sampler, 5 + below(50)).unwrap();
                builder.push(&ids, &parents, rule, &noise, &uniforms, None);
                logits.extend(&rows);
            }
            let batch = builder.batch();
            let want = verify_batch(&batch, &logits).unwrap();
            // The caller's logits: each sequence's rows after a row of junk.
            let (mut caller, mut roots) = (Vec::new(), Vec::new());
            for s in 0..batch.num_seqs() {
                caller.extend(vec![9.0f32; vocab]);
                roots.push(caller.len() / vocab);
                let rows = batch.root_row(s)..batch.root_row(s) + batch.nodes(s).len() + 1;
                caller.extend(&logits[rows.start * vocab..rows.end * vocab]);
            }
            let caller = Tensor::from_vec(caller, (roots.len() + batch.num_rows(), vocab), &Device::Cpu).unwrap();
            let uploads = UPLOADS.with(Cell::get);
            assert_eq!(verify_batch_at(&batch, &caller, &roots).unwrap(), want, "case {case}");
            assert_eq!(UPLOADS.with(Cell::get) - uploads, 1, "case {case}: one upload, the packed trees");
        }
    }

    /// Rejection sequences, q rows and top-k/top-p/min-p filters stay on the host, refused by name.
    #[test]
    fn what_needs_the_host_is_refused() {
        let sampler = Sampler::new(Some(1));
        for (params, probs) in [
            (SamplingParams { temperature: 0.8, top_k: 5, ..Default::default() }, false),
            (SamplingParams { temperature: 0.8, min_p: 0.1, ..Default::default() }, false),
            (SamplingParams { temperature: 0.8, ..Default::default() }, true),
        ] {
            let rule = SeqRule::new(&params, probs, false);
            let mut builder = VerifyBatchBuilder::new(4);
            let (noise, uniforms) = sequence_inputs(&rule, &[-1], &sampler, 3).unwrap();
            let q = [0.25f32; 4];
            builder.push(&[1], &[-1], rule, &noise, &uniforms, probs.then_some(&q[..]));
            let e = packed(&builder.batch(), &[0]).unwrap_err().to_string();
            assert!(e.contains("is the host's"), "{e}");
            assert!(!takes(&rule, probs));
        }
    }
}
