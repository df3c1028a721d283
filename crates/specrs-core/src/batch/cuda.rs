//! The batched kernels on a CUDA device (`--features cuda`): `cuda/accept.cu`, `cuda/ngram.cu` and
//! `cuda/suffix.cu`,
//! compiled with NVRTC for the device's architecture on first use and launched on candle's stream,
//! so they order correctly after the forward pass that produced the logits.
//!
//! Invariant: same inputs, same outputs as the CPU references `accept::accept`,
//! `tree_accept::tree_accept_packed`, `ngram::ngram_step` and `suffix::suffix_step`. The n-gram
//! and suffix lookups and greedy
//! acceptance (chain or tree) are exact; a sampled draw sums floats in another order (the tree
//! kernel's over vocabulary chunks), so a uniform lying within rounding of a CDF boundary can pick
//! the neighbouring token (in a tree, and so another path; on an H200, 7 of 400 sampled chain
//! sequences at vocabulary 32000, each within 2e-5 of the mass of a boundary: scripts/gpu_check.py
//! measures each such case's distance from its boundary).

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::{Device, Storage, Tensor};

use super::accept::{AcceptInput, AcceptOutput};
use super::ngram::{NgramInput, NgramStep};
use super::suffix::{SuffixStep, MAX_MATCHES, NODE_WORDS};
use super::tree_accept::{tree_accept_in, upload_packed, PackedTrees, TreeAcceptInput, TreeAcceptOutput};
use crate::error::{Error, Result};
use crate::nvrtc::{cuda_device, device_error, function, open, ACCEPT, BLOCK, NGRAM, SUFFIX};

/// Refuses target logits that are not `[batch, rows, vocab]`.
fn check_dims(target_logits: &Tensor, expected: [usize; 3]) -> Result<()> {
    if target_logits.dims() != expected {
        return Err(Error::Internal(format!("target_logits is {:?}, expected {expected:?}", target_logits.dims())));
    }
    Ok(())
}

/// `accept::accept` on the device. `target_logits` is the `[batch, k + 1, vocab]` f32 tensor on a
/// CUDA device (as the verify forward leaves it); the rest of `input` comes from the host, and
/// `input.target_logits` is ignored. Only the per-sequence counts and tokens come back.
pub fn accept_on_device(target_logits: &Tensor, input: &AcceptInput) -> Result<AcceptOutput> {
    let (b, k, v) = (input.batch, input.max_draft_tokens, input.vocab_size);
    check_dims(target_logits, [b, k + 1, v])?;
    input.check_with_logits(target_logits.elem_count())?;
    let logits = target_logits.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let device = cuda_device(logits.device())?;

    let func = function(device, &ACCEPT, "accept_kernel")?;
    let stream = device.cuda_stream();
    let copy = |what: &str, e| device_error(&format!("copying {what} to the device"), e);
    let draft_ids = stream.clone_htod(input.draft_token_ids).map_err(|e| copy("draft tokens", e))?;
    let num_draft = stream.clone_htod(input.num_draft_tokens).map_err(|e| copy("draft lengths", e))?;
    // Without draft probabilities the kernel never reads them; it still needs a valid pointer.
    let probs = stream.clone_htod(input.draft_probs.unwrap_or(&[0.0])).map_err(|e| copy("draft probabilities", e))?;
    let temperatures = stream.clone_htod(input.temperatures).map_err(|e| copy("temperatures", e))?;
    let uniforms = stream.clone_htod(input.uniforms).map_err(|e| copy("uniforms", e))?;
    let mut num_accepted = stream.alloc_zeros::<u32>(b).map_err(|e| copy("outputs", e))?;
    let mut next_tokens = stream.alloc_zeros::<u32>(b).map_err(|e| copy("outputs", e))?;
    let (k32, v32, has_probs) = (k as u32, v as u32, u32::from(input.draft_probs.is_some()));

    let (storage, layout) = logits.storage_and_layout();
    let Storage::Cuda(cuda_storage) = &*storage else {
        return Err(Error::Device("target_logits is not stored on a CUDA device".into()));
    };
    let logits_view = cuda_storage.as_cuda_slice::<f32>()?.slice(layout.start_offset()..);
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&logits_view)
        .arg(&draft_ids)
        .arg(&num_draft)
        .arg(&probs)
        .arg(&temperatures)
        .arg(&uniforms)
        .arg(&k32)
        .arg(&v32)
        .arg(&has_probs)
        .arg(&mut num_accepted)
        .arg(&mut next_tokens);
    let config = LaunchConfig { grid_dim: (b as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the argument list matches accept_kernel's signature, every buffer has the size
    // `check` verified, and the kernel writes only its two [batch] outputs.
    unsafe { launch.launch(config) }.map_err(|e| device_error("launching accept_kernel", e))?;
    let back = |e| device_error("copying the results back", e);
    Ok(AcceptOutput {
        num_accepted_tokens: stream.clone_dtoh(&num_accepted).map_err(back)?,
        next_token_ids: stream.clone_dtoh(&next_tokens).map_err(back)?,
    })
}

/// `tree_accept::tree_accept_packed` on the device, in one launch and in place: `storage` holds,
/// from word `start`, the packed descriptor (`words_len` words, its counters zero), then the
/// kernel's scratch and its output (`PackedTrees::room`); `logits` `[rows, vocab]` f32 on the same
/// device (the forward's, contiguous, read in place). No upload, no allocation, no download
/// (`tree_accept::tree_accept_in` reads the output back).
pub(super) fn tree_accept_in_place(
    storage: &mut candle_core::CudaStorage,
    start: usize,
    words_len: usize,
    logits: &Tensor,
    packed: &PackedTrees,
) -> Result<()> {
    use candle_core::backend::BackendStorage;
    let device = storage.device().clone();
    let func = function(&device, &ACCEPT, "tree_accept_kernel")?;
    let stream = device.cuda_stream();
    let (logit_storage, layout) = logits.storage_and_layout();
    let Storage::Cuda(cuda_storage) = &*logit_storage else {
        return Err(Error::Device("the logits are not stored on a CUDA device".into()));
    };
    let logits_view = cuda_storage.as_cuda_slice::<f32>()?.slice(layout.start_offset()..);
    let mut buffer = storage.as_cuda_slice_mut::<u32>()?.slice_mut(start..);
    let (mut descriptor, mut after) = buffer.split_at_mut(words_len);
    let (mut scratch, mut out) = after.split_at_mut(packed.scratch_words());
    let v32 = packed.vocab_size as u32;
    let mut launch = stream.launch_builder(&func);
    // The kernel counts in the descriptor's counters, so it is passed as written to.
    launch.arg(&logits_view).arg(&mut descriptor).arg(&mut scratch).arg(&v32).arg(&mut out);
    let grid = (packed.num_rows() as u32, packed.num_chunks() as u32, 1);
    let config = LaunchConfig { grid_dim: grid, block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the argument list matches tree_accept_kernel's signature; `PackedTrees::push`
    // checked every parent and token, `tree_accept_in` checked that the rows lie inside the
    // logits and that the buffer holds the descriptor, scratch and output the descriptor implies;
    // the kernel writes every scratch word before it reads it, and every output word.
    unsafe { launch.launch(config) }.map_err(|e| device_error("launching tree_accept_kernel", e))?;
    Ok(())
}

/// A lookup step's descriptor `words` on the device (its ONE upload, counted) and room for its
/// `output_words` drafts (each kernel writes every draft's length and that many tokens: all the
/// host reads).
fn upload_lookup_step(
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    words: &[u32],
    output_words: usize,
) -> Result<(CudaSlice<u32>, CudaSlice<u32>)> {
    crate::model::candle::count_upload();
    let descriptor = stream.clone_htod(words).map_err(|e| device_error("copying a lookup step to the device", e))?;
    // SAFETY: see above; nothing reads past what the kernel writes.
    let out = unsafe { stream.alloc::<u32>(output_words) }.map_err(|e| device_error("allocating the drafts", e))?;
    Ok((descriptor, out))
}

/// `ngram::ngram_step` on the device: `pool` `[rows * max_len]` (the histories) stays there
/// between steps; ONE upload (the step's descriptor), ONE launch (appends and lookups), ONE
/// download (the drafts, `[B, 1 + max_k]`).
pub fn ngram_step_on_device(
    device: &Device,
    pool: &mut CudaSlice<u32>,
    max_len: usize,
    step: &NgramStep,
) -> Result<Vec<u32>> {
    step.check_pool(pool.len() / max_len.max(1), max_len)?;
    if step.num_seqs() == 0 {
        return Ok(Vec::new());
    }
    let device = cuda_device(device)?;
    let func = function(device, &NGRAM, "ngram_kernel")?;
    let stream = device.cuda_stream();
    let (descriptor, mut out) = upload_lookup_step(&stream, &step.words(), step.output_words())?;
    let max_len32 = max_len as u32;
    let mut launch = stream.launch_builder(&func);
    launch.arg(pool).arg(&max_len32).arg(&descriptor).arg(&mut out);
    let config =
        LaunchConfig { grid_dim: (step.num_seqs() as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match ngram_kernel's signature; check_pool verified every row and
    // history fits the pool and no two sequences share a row.
    unsafe { launch.launch(config) }.map_err(|e| device_error("launching ngram_kernel", e))?;
    stream.clone_dtoh(&out).map_err(|e| device_error("copying the drafts back", e))
}

/// Node entries past which a step writes them in a launch of their own (once, across the grid)
/// rather than in every sequence's block: a tree written whole (a new or laid-out mirror).
const SUFFIX_ENTRIES_APART: usize = 4096;

/// `suffix::suffix_step` on the device: the step's ONE upload, ONE launch writing its node entries
/// into `pool` (`[slots, 3]`) and drafting (two where it writes more than `SUFFIX_ENTRIES_APART`
/// entries), ONE download of `[B, 1 + max_k]`.
pub fn suffix_step_on_device(device: &Device, pool: &mut CudaSlice<u32>, step: &SuffixStep) -> Result<Vec<u32>> {
    step.check_pool(pool.len() / NODE_WORDS)?;
    if step.num_seqs() == 0 {
        return Ok(Vec::new());
    }
    let device = cuda_device(device)?;
    let func = function(device, &SUFFIX, "suffix_kernel")?;
    let stream = device.cuda_stream();
    let (descriptor, mut out) = upload_lookup_step(&stream, &step.words(), step.output_words())?;
    let apart = step.num_entries() > SUFFIX_ENTRIES_APART;
    if apart {
        let write = function(device, &SUFFIX, "suffix_write_kernel")?;
        let mut launch = stream.launch_builder(&write);
        launch.arg(&mut *pool).arg(&descriptor);
        let grid = step.num_entries().div_ceil(BLOCK as usize).min(4096) as u32;
        let config = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match suffix_write_kernel's signature; check_pool verified every
        // entry's slot lies in the pool.
        unsafe { launch.launch(config) }.map_err(|e| device_error("launching suffix_write_kernel", e))?;
    }
    let entries_written = u32::from(apart);
    let mut launch = stream.launch_builder(&func);
    launch.arg(pool).arg(&descriptor).arg(&mut out).arg(&entries_written);
    let threads = 2 * MAX_MATCHES as u32;
    let config =
        LaunchConfig { grid_dim: (step.num_seqs() as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: the arguments match suffix_kernel's signature; check_pool verified every entry,
    // match and best child lies in the pool and every limit within its row of the output.
    unsafe { launch.launch(config) }.map_err(|e| device_error("launching suffix_kernel", e))?;
    stream.clone_dtoh(&out).map_err(|e| device_error("copying the suffix drafts back", e))
}

/// A zeroed pool of `len` words on `device` (the n-gram histories, the suffix trees' nodes).
pub fn zeroed_pool(device: &Device, len: usize) -> Result<CudaSlice<u32>> {
    let device = cuda_device(device)?;
    device.cuda_stream().alloc_zeros::<u32>(len.max(1)).map_err(|e| device_error("allocating a lookup pool", e))
}

/// `ngram::ngram_lookup` on `device` (inputs from the host): a fresh pool, one step.
pub fn ngram_lookup_on_device(device: &Device, input: &NgramInput) -> Result<(Vec<u32>, Vec<u32>)> {
    let step = input.step()?;
    let mut pool = zeroed_pool(device, input.lengths.len() * input.max_len)?;
    Ok(input.padded(step.drafts(&ngram_step_on_device(device, &mut pool, input.max_len, &step)?)))
}

/// `accept_on_device` with the logits copied from the host to GPU `ordinal` first (for the device
/// check, which compares the kernel with the CPU reference on the same host inputs).
pub fn accept_from_host(ordinal: usize, input: &AcceptInput) -> Result<AcceptOutput> {
    let device = open(ordinal)?;
    let shape = (input.batch, input.max_draft_tokens + 1, input.vocab_size);
    let logits = Tensor::from_slice(input.target_logits, shape, &device)?;
    accept_on_device(&logits, input)
}

/// `tree_accept::tree_accept` on GPU `ordinal`: the padded batch packed, its logits copied from
/// the host (for the device check, which compares the kernel with the CPU reference).
pub fn tree_accept_from_host(ordinal: usize, input: &TreeAcceptInput) -> Result<TreeAcceptOutput> {
    let packed = input.packed()?;
    let device = open(ordinal)?;
    let shape = (input.batch * (input.max_nodes + 1), input.vocab_size);
    let logits = Tensor::from_slice(input.target_logits, shape, &device)?;
    let words = tree_accept_in(&upload_packed(&packed, &device)?, &logits, &packed)?;
    Ok(TreeAcceptOutput::from_words(&words, input.max_nodes))
}

/// `ngram_lookup_on_device` on GPU `ordinal`.
pub fn ngram_lookup_from_host(ordinal: usize, input: &NgramInput) -> Result<(Vec<u32>, Vec<u32>)> {
    ngram_lookup_on_device(&open(ordinal)?, input)
}

#[cfg(test)]
mod tests {
    use super::super::accept::accept;
    use super::super::ngram::ngram_lookup;
    use super::super::tree_accept::tree_accept;
    use super::*;
    use crate::nvrtc::gpu_present;

    /// A small deterministic generator in [0, 1).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// Acceptance inputs where drafts are often accepted (two rows in three peak on the drafted
    /// token), with greedy and sampled sequences: `(logits [b, k + 1, v], drafts [b, k], num_draft
    /// [b], probs [b, k, v], temperatures [b], uniforms [b, k + 1])`.
    #[allow(clippy::type_complexity)]
    fn accept_inputs(b: usize, k: usize, v: usize) -> (Vec<f32>, Vec<u32>, Vec<u32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let mut rng = Lcg(11);
        let (mut logits, mut drafts, mut probs) = (Vec::new(), Vec::new(), Vec::new());
        for s in 0..b {
            for i in 0..=k {
                let token = (rng.next() * v as f32) as u32 % v as u32;
                let peaked = i < k && (s + i) % 3 != 2;
                logits.extend((0..v).map(|t| rng.next() * 4.0 + if peaked && t as u32 == token { 6.0 } else { 0.0 }));
                if i < k {
                    drafts.push(token);
                    let mut q: Vec<f32> = (0..v).map(|_| rng.next()).collect();
                    q[token as usize] += 5.0;
                    let total: f32 = q.iter().sum();
                    probs.extend(q.into_iter().map(|x| x / total));
                }
            }
        }
        let num_draft = (0..b).map(|s| (s % (k + 1)) as u32).collect();
        let temperatures = (0..b).map(|s| [0.0, 0.5, 1.0, 1.3][s % 4]).collect();
        let uniforms = (0..b * (k + 1)).map(|_| rng.next()).collect();
        (logits, drafts, num_draft, probs, temperatures, uniforms)
    }

    #[test]
    fn accept_kernel_equals_the_cpu_reference_on_a_gpu() {
        if !gpu_present() {
            return;
        }
        let (b, k, v) = (256, 4, 4096);
        let (logits, drafts, num_draft, probs, temperatures, uniforms) = accept_inputs(b, k, v);
        for with_probs in [false, true] {
            let input = AcceptInput {
                batch: b,
                max_draft_tokens: k,
                vocab_size: v,
                target_logits: &logits,
                draft_token_ids: &drafts,
                num_draft_tokens: &num_draft,
                draft_probs: with_probs.then_some(&probs[..]),
                temperatures: &temperatures,
                uniforms: &uniforms,
            };
            let cpu = accept(&input).unwrap();
            let gpu = accept_from_host(0, &input)
                .unwrap_or_else(|e| panic!("the acceptance kernel failed on a present GPU: {e}"));
            assert_eq!(gpu.num_accepted_tokens, cpu.num_accepted_tokens, "with_probs={with_probs}");
            // Greedy sequences are exact; a sampled draw sums floats in another order, so only a
            // uniform within rounding of a CDF boundary may pick the neighbouring token.
            let mut sampled_mismatches = 0;
            for s in 0..b {
                if gpu.next_token_ids[s] != cpu.next_token_ids[s] {
                    assert!(
                        temperatures[s] > 0.0,
                        "greedy sequence {s}: {} vs {}",
                        gpu.next_token_ids[s],
                        cpu.next_token_ids[s]
                    );
                    sampled_mismatches += 1;
                }
            }
            assert!(
                sampled_mismatches <= 2,
                "{sampled_mismatches} sampled next tokens differ (with_probs={with_probs})"
            );
            let all_accepted =
                (0..b).filter(|&s| num_draft[s] > 0 && cpu.num_accepted_tokens[s] == num_draft[s]).count();
            assert!(all_accepted > 0 && all_accepted < b, "the inputs must take both paths");
        }
    }

    #[test]
    fn tree_accept_kernel_equals_the_cpu_reference_on_a_gpu() {
        if !gpu_present() {
            return;
        }
        // Three full vocabulary chunks and a partial one, so a row's target combines four blocks.
        let (b, n, v) = (64, 16, 3 * super::super::tree_accept::VOCAB_CHUNK + 123);
        let mut rng = Lcg(13);
        let below = |rng: &mut Lcg, m: usize| ((rng.next() * m as f32) as usize).min(m - 1);
        let (mut logits, mut drafts, mut parents, mut num_nodes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for s in 0..b {
            let count = if s % 9 == 0 { 0 } else { 1 + below(&mut rng, n) };
            num_nodes.push(count as u32);
            // Half the nodes continue the previous one (deep paths); the others hang anywhere earlier.
            let tree: Vec<i32> = (0..n)
                .map(|i| match i < count {
                    true if rng.next() < 0.5 => i as i32 - 1,
                    true => below(&mut rng, i + 1) as i32 - 1,
                    false => -1,
                })
                .collect();
            let tokens: Vec<u32> = (0..n).map(|_| below(&mut rng, v) as u32).collect();
            for r in 0..=n {
                // Two rows in three peak on one child's token, so walks go deep as well as stop.
                let kids: Vec<usize> = (0..count).filter(|&i| tree[i] == r as i32 - 1).collect();
                let peak = (!kids.is_empty() && rng.next() < 0.67).then(|| tokens[kids[below(&mut rng, kids.len())]]);
                logits.extend((0..v).map(|t| rng.next() * 4.0 + if peak == Some(t as u32) { 12.0 } else { 0.0 }));
            }
            parents.extend(tree);
            drafts.extend(tokens);
        }
        let temperatures: Vec<f32> = (0..b).map(|s| [0.0, 0.5, 1.0, 1.3][s % 4]).collect();
        let uniforms: Vec<f32> = (0..b * (n + 1)).map(|_| rng.next()).collect();
        let input = TreeAcceptInput {
            batch: b,
            max_nodes: n,
            vocab_size: v,
            target_logits: &logits,
            draft_token_ids: &drafts,
            parents: &parents,
            num_nodes: &num_nodes,
            temperatures: &temperatures,
            uniforms: &uniforms,
        };
        let cpu = tree_accept(&input).unwrap();
        let gpu = tree_accept_from_host(0, &input)
            .unwrap_or_else(|e| panic!("the tree acceptance kernel failed on a present GPU: {e}"));
        // Greedy sequences are exact; a sampled draw within rounding of a CDF boundary may pick
        // the neighbouring token, and with it another path.
        let mut sampled_mismatches = 0;
        for (s, &temperature) in temperatures.iter().enumerate() {
            let same = gpu.num_accepted_tokens[s] == cpu.num_accepted_tokens[s]
                && gpu.accepted_nodes[s * n..(s + 1) * n] == cpu.accepted_nodes[s * n..(s + 1) * n]
                && gpu.next_token_ids[s] == cpu.next_token_ids[s];
            if !same {
                assert!(temperature > 0.0, "greedy sequence {s}: the device and the CPU disagree");
                sampled_mismatches += 1;
            }
        }
        assert!(sampled_mismatches <= 2, "{sampled_mismatches} sampled sequences differ");
        let deep = (0..b).filter(|&s| cpu.num_accepted_tokens[s] > 1).count();
        let rejected_at_root = (0..b).filter(|&s| num_nodes[s] > 0 && cpu.num_accepted_tokens[s] == 0).count();
        assert!(deep > 0 && rejected_at_root > 0, "the inputs must take both paths");
    }

    #[test]
    fn ngram_kernel_equals_the_cpu_reference_on_a_gpu() {
        if !gpu_present() {
            return;
        }
        let (batch, max_len) = (128, 512);
        let mut rng = Lcg(5);
        // Four distinct tokens, so most histories repeat n-grams and drafts are found.
        let histories: Vec<u32> = (0..batch * max_len).map(|_| (rng.next() * 4.0) as u32).collect();
        let lengths: Vec<u32> = (0..batch).map(|_| 1 + (rng.next() * max_len as f32) as u32 % max_len as u32).collect();
        let input = NgramInput { histories: &histories, max_len, lengths: &lengths, min_n: 2, max_n: 5, k: 8 };
        let cpu = ngram_lookup(&input).unwrap();
        let gpu = ngram_lookup_from_host(0, &input)
            .unwrap_or_else(|e| panic!("the n-gram kernel failed on a present GPU: {e}"));
        assert_eq!(gpu, cpu);
        assert!(cpu.1.iter().any(|&n| n > 0), "no sequence found a draft");
    }
}
