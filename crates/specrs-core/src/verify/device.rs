//! The device verifier: a step's `VerifyBatch` sequences that need nothing but their logits (greedy,
//! or coupled with temperature alone; one-hot drafts: chains, trees, plain decoding's empty draft)
//! decided where the logits are, all of them in ONE launch of `cuda/accept.cu`'s tree kernel
//! (`batch/cuda.rs`), so only the accepted nodes and next tokens come back to the host. On the
//! CPU the same layout runs through the kernel's reference, so the GPU step's path is tested here.
//!
//! The contract is the host verifier's (`host.rs`); the kernel reads a padded `[B, n + 1, V]`
//! layout with one uniform per depth, so `DeviceVerify::new` lays the batch out that way: one
//! gather of the sequences' logit rows (root row first, padding repeats the root row, which the
//! walk never reads), and uniform d = the noise of the rows at depth d (a coupled row's noise is
//! its position's uniform, so every row at one depth has the same).
//!
//! Invariant: `verdicts` of the tree kernel's reference (`batch::tree_accept`) on this layout equal
//! `host::verify_batch` on the batch, bitwise, for every greedy and temperature-only coupled
//! sequence (test: `the_device_layout_decides_what_the_host_walk_does`); the kernel equals that
//! reference up to sampled draws within rounding of a CDF boundary (`batch/cuda.rs`).

use super::batch::{Mode, RowNoise, Verdicts, VerifyBatch};
use crate::batch::tree_accept::{tree_accept, TreeAcceptInput, TreeAcceptOutput};
use crate::error::{Error, Result};

/// A `VerifyBatch` in the tree kernel's padded layout.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceVerify {
    pub batch: usize,
    pub max_nodes: usize,
    pub vocab_size: usize,
    /// `[B * (max_nodes + 1)]` the logit row (in the logits the caller holds) each padded row reads.
    pub gather: Vec<u32>,
    /// `[B, max_nodes]` each.
    pub draft_token_ids: Vec<u32>,
    pub parents: Vec<i32>,
    /// `[B]`.
    pub num_nodes: Vec<u32>,
    /// `[B]`; 0 = greedy.
    pub temperatures: Vec<f32>,
    /// `[B, max_nodes + 1]`: uniform d draws depth d.
    pub uniforms: Vec<f32>,
}

impl DeviceVerify {
    /// Whether a sequence with `rule` and no q rows is decided by the device verifier.
    pub fn takes(rule: &super::batch::SeqRule, has_probs: bool) -> bool {
        !has_probs && (rule.mode == Mode::Greedy || rule.mode == Mode::Coupled && rule.params().is_temperature_only())
    }

    /// `batch` laid out for the kernel; sequence s's root row is `root_rows[s]` of the caller's
    /// logits (the forward's, as they are). A sequence the device verifier does not take (`takes`)
    /// is an internal error naming it.
    pub fn new(batch: &VerifyBatch, root_rows: &[usize]) -> Result<Self> {
        let num_seqs = batch.num_seqs();
        if root_rows.len() != num_seqs {
            return Err(Error::Internal(format!("device verify: {num_seqs} sequences, {} root rows", root_rows.len())));
        }
        let max_nodes = (0..num_seqs).map(|s| batch.nodes(s).len()).max().unwrap_or(0);
        let width = max_nodes + 1;
        let mut out = Self {
            batch: num_seqs,
            max_nodes,
            vocab_size: batch.vocab_size,
            gather: Vec::with_capacity(num_seqs * width),
            draft_token_ids: vec![0; num_seqs * max_nodes],
            parents: vec![-1; num_seqs * max_nodes],
            num_nodes: Vec::with_capacity(num_seqs),
            temperatures: Vec::with_capacity(num_seqs),
            uniforms: vec![0.0; num_seqs * width],
        };
        for (s, &root) in root_rows.iter().enumerate() {
            let (rule, nodes) = (&batch.rules[s], batch.nodes(s));
            let has_probs =
                !batch.prob_rows.is_empty() && nodes.clone().any(|i| batch.prob_rows[i] != super::batch::NO_ROW);
            if !Self::takes(rule, has_probs) {
                return Err(Error::Internal(format!(
                    "device verify: sequence {s} ({:?}, top_k {}, top_p {}, min_p {}, q rows {has_probs}) is the host's",
                    rule.mode, rule.top_k, rule.top_p, rule.min_p
                )));
            }
            let n = nodes.len();
            out.gather.extend((0..width).map(|row| (root + if row <= n { row } else { 0 }) as u32));
            out.draft_token_ids[s * max_nodes..s * max_nodes + n].copy_from_slice(&batch.draft_ids[nodes.clone()]);
            let parents = &batch.parents[nodes.clone()];
            out.parents[s * max_nodes..s * max_nodes + n].copy_from_slice(parents);
            out.num_nodes.push(n as u32);
            out.temperatures.push(if rule.mode == Mode::Greedy { 0.0 } else { rule.temperature });
            if rule.mode == Mode::Coupled {
                let noise = |row: usize| {
                    let RowNoise::Uniform(u) = batch.row_noise[batch.root_row(s) + row];
                    u
                };
                let uniforms = &mut out.uniforms[s * width..(s + 1) * width];
                uniforms[0] = noise(0);
                for (i, depth) in crate::tree::depths(parents)?.into_iter().enumerate() {
                    uniforms[depth + 1] = noise(i + 1);
                }
            }
        }
        Ok(out)
    }

    /// The kernel's input over `target_logits` (`[B, max_nodes + 1, V]` as `gather` lays them
    /// out; empty for the device, which reads its own tensor).
    pub fn input<'a>(&'a self, target_logits: &'a [f32]) -> TreeAcceptInput<'a> {
        TreeAcceptInput {
            batch: self.batch,
            max_nodes: self.max_nodes,
            vocab_size: self.vocab_size,
            target_logits,
            draft_token_ids: &self.draft_token_ids,
            parents: &self.parents,
            num_nodes: &self.num_nodes,
            temperatures: &self.temperatures,
            uniforms: &self.uniforms,
        }
    }

    /// The kernel's output as the contract's verdicts (no sequential uniform is read).
    pub fn verdicts(&self, out: &TreeAcceptOutput) -> Verdicts {
        let mut verdicts = Verdicts { accepted_offsets: vec![0], ..Default::default() };
        for s in 0..self.batch {
            let count = out.num_accepted_tokens[s] as usize;
            verdicts.accepted_nodes.extend(&out.accepted_nodes[s * self.max_nodes..][..count]);
            verdicts.accepted_offsets.push(verdicts.accepted_nodes.len() as u32);
            verdicts.next_tokens.push(out.next_token_ids[s]);
            verdicts.uniforms_used.push(0);
        }
        verdicts
    }
}

/// `host::verify_batch` of `batch` (every sequence one `DeviceVerify::takes`) where `logits`
/// `[rows, V]` are (the forward's, sequence s's root at row `root_rows[s]`): on CUDA one gather
/// and one tree-kernel launch for the whole batch; on the CPU (the GPU path's tests) the kernel's
/// reference on the same layout.
pub fn verify_batch_at(batch: &VerifyBatch, logits: &candle_core::Tensor, root_rows: &[usize]) -> Result<Verdicts> {
    let layout = DeviceVerify::new(batch, root_rows)?;
    let empty = TreeAcceptOutput { num_accepted_tokens: vec![], accepted_nodes: vec![], next_token_ids: vec![] };
    if layout.batch == 0 {
        return Ok(layout.verdicts(&empty));
    }
    let index = candle_core::Tensor::new(layout.gather.as_slice(), logits.device())?;
    let padded = logits.index_select(&index, 0)?; // [B * (max_nodes + 1), V]
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let padded = padded.reshape((layout.batch, layout.max_nodes + 1, layout.vocab_size))?;
        return Ok(layout.verdicts(&crate::batch::cuda::tree_accept_on_device(&padded, &layout.input(&[]))?));
    }
    let values: Vec<f32> = padded.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(layout.verdicts(&tree_accept(&layout.input(&values))?))
}

#[cfg(test)]
mod tests {
    use super::super::batch::{SeqRule, VerifyBatchBuilder};
    use super::super::host::{sequence_inputs, verify_batch};
    use super::*;
    use crate::config::SamplingParams;
    use crate::sampler::Sampler;
    use candle_core::{Device, Tensor};

    /// Random greedy and temperature-only coupled sequences (chains, trees, empty drafts, drafts
    /// that follow the argmax) verified by the host walk and by `verify_batch_at` (the tree
    /// kernel's reference on the device layout): the same verdicts, bitwise; the layout reads the
    /// rows where the caller's logits hold them (here each sequence's after a junk row).
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
            assert_eq!(verify_batch_at(&batch, &caller, &roots).unwrap(), want, "case {case}");
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
            let e = DeviceVerify::new(&builder.batch(), &[0]).unwrap_err().to_string();
            assert!(e.contains("is the host's"), "{e}");
            assert!(!DeviceVerify::takes(&rule, probs));
        }
    }
}
