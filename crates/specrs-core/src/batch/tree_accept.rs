//! Batched tree acceptance: for every sequence, which root-to-node path of its token tree the
//! target keeps and the target's next token (recovered where no child matches, or bonus after a
//! leaf).
//!
//! This is `verify::tree::verify_tree` for a batch of deterministic trees (no draft probabilities:
//! n-gram, suffix and the top-k trees of models and heads), with two changes that make it a pure
//! function a device kernel can reproduce: the random draws are inputs (`uniforms`, one per depth),
//! and the target distribution is softmax(logits / temperature) alone.
//!
//! The walk starts at the root (logits row 0; row i + 1 scores the token after node i). At depth
//! d, the current node's row gives the target token: its argmax (temperature 0), or
//! `draw_with(probabilities(row), uniforms[d])`. The first child (in node index order) whose draft
//! token equals it is accepted and becomes the current node; when none does, that target token is
//! the next token and the walk ends. A tree of n nodes is at most n deep, so the walk reads at most
//! uniforms 0..=n.
//!
//! The kernel reads one packed descriptor (`PackedTrees`: one upload per step, or a section of the
//! forward's own: `tree_accept_in`) and the rows where
//! the logits already are (the forward's, not a padded copy). Because a row's target token depends
//! only on the row, its temperature and the uniform of its depth (never on the walk), the kernel
//! computes every row's target at once, the vocabulary split across blocks, and walks the trees
//! after; `tree_accept_packed` reads the same words on the CPU.
//!
//! Invariant: with `uniforms[s][d] = sampler.uniform_at(position + d)`, each sequence's result
//! equals `verify_tree` on the same tree with `draft_probs = None` and temperature-only sampling
//! parameters, driven by `sampler` at `position` (its coupled form draws depth d with
//! `draw_at(.., position + d)`, which is `draw_with(.., uniform_at(position + d))`).

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor};

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::sampler::{argmax, draw_with, probabilities};

/// One batch, row-major. `b` = batch, `n` = max nodes, `v` = vocab size.
pub struct TreeAcceptInput<'a> {
    pub batch: usize,
    pub max_nodes: usize,
    pub vocab_size: usize,
    /// `[b, n + 1, v]`: row 0 scores the token after the root (the newest context token), row
    /// i + 1 the token after node i.
    pub target_logits: &'a [f32],
    /// `[b, n]`; sequence s uses its first `num_nodes[s]`.
    pub draft_token_ids: &'a [u32],
    /// `[b, n]`: node i's parent, -1 = the root; parents come before their children
    /// (-1 <= parents[i] < i for the used nodes; the padding is not read).
    pub parents: &'a [i32],
    /// `[b]`, each <= n.
    pub num_nodes: &'a [u32],
    /// `[b]`; 0 = greedy.
    pub temperatures: &'a [f32],
    /// `[b, n + 1]` in [0, 1): uniform d decides depth d; unused by greedy sequences.
    pub uniforms: &'a [f32],
}

/// Per sequence: `num_accepted_tokens[s]` nodes kept (the path `accepted_nodes[s][..num_accepted]`,
/// root's child first), then `next_token_ids[s]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeAcceptOutput {
    /// `[b]`.
    pub num_accepted_tokens: Vec<u32>,
    /// `[b, n]`: node indices of the accepted path, padded with `u32::MAX`.
    pub accepted_nodes: Vec<u32>,
    /// `[b]`.
    pub next_token_ids: Vec<u32>,
}

/// Padding of `TreeAcceptOutput::accepted_nodes` past the accepted path.
pub const NO_NODE: u32 = u32::MAX;

impl TreeAcceptInput<'_> {
    /// Every shape and every used parent is checked once here, so the reference and the kernel can
    /// index freely.
    pub fn check(&self) -> Result<()> {
        self.check_with_logits(self.target_logits.len())
    }

    /// `check` for target logits that live elsewhere (a device tensor) and hold `num_logits` values.
    pub fn check_with_logits(&self, num_logits: usize) -> Result<()> {
        let (b, n, v) = (self.batch, self.max_nodes, self.vocab_size);
        let arrays = [
            ("target_logits", num_logits, b * (n + 1) * v),
            ("draft_token_ids", self.draft_token_ids.len(), b * n),
            ("parents", self.parents.len(), b * n),
            ("num_nodes", self.num_nodes.len(), b),
            ("temperatures", self.temperatures.len(), b),
            ("uniforms", self.uniforms.len(), b * (n + 1)),
        ];
        let mut wrong =
            super::shape_errors(&arrays, ("num_nodes", self.num_nodes, n, "max_nodes"), self.draft_token_ids, v);
        // Parents are only read where every array above has its shape.
        if wrong.is_empty() {
            let bad_parent = (0..b).find_map(|s| {
                let parents = &self.parents[s * n..s * n + self.num_nodes[s] as usize];
                parents.iter().enumerate().find(|&(i, &p)| p < -1 || p >= i as i32).map(|(i, &p)| (s, i, p))
            });
            if let Some((s, i, p)) = bad_parent {
                wrong.push(format!(
                    "parent {p} of node {i} in sequence {s} is invalid (parents are -1 for the root or an \
                     earlier node)"
                ));
            }
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(Error::Internal(format!("batched tree acceptance input: {}", wrong.join("; "))))
        }
    }
}

/// Vocabulary entries one block of `tree_accept_kernel` reduces: a row's logits are split over
/// ceil(vocab / VOCAB_CHUNK) blocks, so a 128k-token row is 32 blocks instead of one.
pub const VOCAB_CHUNK: usize = 4096;

/// Words of `PackedTrees`' sections (`cuda/accept.cu` reads them with the same numbers).
const HEADER_WORDS: usize = 4;
const SEQ_WORDS: usize = 2;
const ROW_WORDS: usize = 5;

/// A step's trees packed for `tree_accept_kernel`: ONE buffer of u32 words, uploaded once.
///
/// ```text
/// header   [4]       num_seqs B, max_nodes N (the output's path width), num_rows R, vocab chunks C
/// seqs     [B, 2]    first_row, num_nodes: rows first_row ..= first_row + num_nodes are the
///                    sequence's root, then node i
/// rows     [R, 5]    logit_row (in the caller's logits), draft token, parent (i32; a root's is
///                    -2, unread), temperature (f32; 0 = greedy), uniform of the row's depth (f32)
/// counters [R + 1]   zero: each row's chunk blocks done, then rows done (the kernel counts in them)
/// ```
///
/// The kernel's output (`TreeAcceptOutput::from_words`) is `[B, 2 + N]`: num_accepted, next
/// token, the path padded with `NO_NODE`; its scratch (per (row, chunk) partials, per row
/// targets) is `scratch_words()` it never reads before writing.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedTrees {
    pub max_nodes: usize,
    pub vocab_size: usize,
    seqs: Vec<u32>,
    rows: Vec<u32>,
}

impl PackedTrees {
    /// No sequences yet; every path is at most `max_nodes` long.
    pub fn new(max_nodes: usize, vocab_size: usize) -> Self {
        Self { max_nodes, vocab_size, seqs: Vec::new(), rows: Vec::new() }
    }

    pub fn num_seqs(&self) -> usize {
        self.seqs.len() / SEQ_WORDS
    }

    pub fn num_rows(&self) -> usize {
        self.rows.len() / ROW_WORDS
    }

    /// Blocks per row: ceil(vocab / VOCAB_CHUNK).
    pub fn num_chunks(&self) -> usize {
        self.vocab_size.div_ceil(VOCAB_CHUNK).max(1)
    }

    /// Adds a sequence whose root row is `first_logit_row` of the caller's logits and node i's row
    /// the one after it (a sequence's rows are consecutive, as a forward lays them out);
    /// `row_uniforms` `[n + 1]` is each row's uniform (that of its depth: the root's 0, node i's
    /// depth(i) + 1). Parents must precede their children and draft tokens lie in the vocabulary.
    pub fn push(
        &mut self,
        first_logit_row: usize,
        draft_token_ids: &[u32],
        parents: &[i32],
        temperature: f32,
        row_uniforms: &[f32],
    ) -> Result<()> {
        let (s, n) = (self.num_seqs(), draft_token_ids.len());
        let mut wrong = Vec::new();
        if parents.len() != n || row_uniforms.len() != n + 1 {
            wrong.push(format!("{n} draft tokens, {} parents, {} row uniforms", parents.len(), row_uniforms.len()));
        }
        if n > self.max_nodes {
            wrong.push(format!("{n} nodes exceed max_nodes {}", self.max_nodes));
        }
        if let Some(t) = draft_token_ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            wrong.push(format!("draft token {t} is outside the vocabulary ({})", self.vocab_size));
        }
        if let Err((i, p)) = crate::tree::try_depths(parents) {
            wrong.push(format!("parent {p} of node {i} is invalid (parents are -1 for the root or an earlier node)"));
        }
        if !wrong.is_empty() {
            return Err(Error::Internal(format!("packed tree acceptance, sequence {s}: {}", wrong.join("; "))));
        }
        self.seqs.extend([self.num_rows() as u32, n as u32]);
        for r in 0..=n {
            let (token, parent) = if r == 0 { (0, -2) } else { (draft_token_ids[r - 1], parents[r - 1]) };
            let logit_row = (first_logit_row + r) as u32;
            self.rows.extend([logit_row, token, parent as u32, temperature.to_bits(), row_uniforms[r].to_bits()]);
        }
        Ok(())
    }

    /// The descriptor: header, sequences, rows, zeroed counters.
    pub fn words(&self) -> Vec<u32> {
        let (b, r) = (self.num_seqs(), self.num_rows());
        let header = [b, self.max_nodes, r, self.num_chunks()].map(|x| x as u32);
        let mut words = Vec::with_capacity(self.num_words());
        words.extend(header);
        words.extend(&self.seqs);
        words.extend(&self.rows);
        words.resize(words.len() + r + 1, 0);
        words
    }

    /// The descriptor's length in words.
    pub fn num_words(&self) -> usize {
        HEADER_WORDS + self.seqs.len() + self.rows.len() + self.num_rows() + 1
    }

    /// The kernel's scratch: 2 words per (row, chunk), then one target per row.
    pub fn scratch_words(&self) -> usize {
        self.num_rows() * (2 * self.num_chunks() + 1)
    }

    /// The kernel's output words: `[B, 2 + N]`.
    pub fn output_words(&self) -> usize {
        self.num_seqs() * (2 + self.max_nodes)
    }

    /// Words the kernel needs after the descriptor in its buffer (`tree_accept_in`): its scratch,
    /// then its output.
    pub fn room(&self) -> usize {
        self.scratch_words() + self.output_words()
    }

    /// Refuses logits `[rows, vocab]` that do not hold every row the trees read.
    pub fn check_logits(&self, (num_rows, vocab_size): (usize, usize)) -> Result<()> {
        let max_row = self.rows.chunks(ROW_WORDS).map(|row| row[0] as usize).max();
        if vocab_size != self.vocab_size || max_row.is_some_and(|row| row >= num_rows) {
            return Err(Error::Internal(format!(
                "packed trees read rows up to {max_row:?} of {} vocabulary entries; the logits are [{num_rows}, {vocab_size}]",
                self.vocab_size
            )));
        }
        Ok(())
    }
}

/// The CPU reference of `tree_accept_kernel` in `cuda/accept.cu`: the packed descriptor `words`
/// (`PackedTrees::words`) over `logits` `[rows, vocab]`, read as the kernel reads them; returns
/// the output words `[B, 2 + N]`. A row's target token is computed only when the walk reaches it
/// (the kernel computes every row's; the target depends on the row alone, so the walk is the same).
pub fn tree_accept_packed(words: &[u32], logits: &[f32], vocab_size: usize) -> Vec<u32> {
    let (num_seqs, max_nodes, num_rows) = (words[0] as usize, words[1] as usize, words[2] as usize);
    let seqs = &words[HEADER_WORDS..HEADER_WORDS + SEQ_WORDS * num_seqs];
    let rows = &words[HEADER_WORDS + seqs.len()..][..ROW_WORDS * num_rows];
    let row = |r: usize| &rows[r * ROW_WORDS..(r + 1) * ROW_WORDS];
    let target = |r: usize| {
        let [logit_row, _, _, temperature, uniform] = row(r).try_into().expect("five words per row");
        let scores = &logits[logit_row as usize * vocab_size..][..vocab_size];
        let temperature = f32::from_bits(temperature);
        if temperature <= 0.0 {
            argmax(scores)
        } else {
            let params = SamplingParams { temperature, ..SamplingParams::default() };
            draw_with(&probabilities(scores, &params), f32::from_bits(uniform))
        }
    };
    let width = 2 + max_nodes;
    let mut out = vec![NO_NODE; num_seqs * width];
    for (s, seq) in seqs.chunks(SEQ_WORDS).enumerate() {
        let (first_row, count) = (seq[0] as usize, seq[1] as usize);
        let out = &mut out[s * width..(s + 1) * width];
        let mut current: i32 = -1; // the root
        let mut depth = 0;
        let next = loop {
            let target = target(first_row + (current + 1) as usize);
            // The first child in index order whose token is the target's.
            let child = (0..count).find(|&i| {
                let node = row(first_row + 1 + i);
                node[2] as i32 == current && node[1] == target
            });
            match child {
                Some(child) => {
                    out[2 + depth] = child as u32;
                    depth += 1;
                    current = child as i32;
                }
                None => break target,
            }
        };
        out[0] = depth as u32;
        out[1] = next;
    }
    out
}

/// The acceptance of `packed` over `logits` `[rows, vocab]` (f32, where the forward left them),
/// run in `buffer`: `[words + room]` u32 on the logits' device, holding `packed.words()` first
/// (the step's one upload put them there, or `upload_packed` did), then the kernel's scratch and
/// its output (`PackedTrees::room`). One launch on CUDA, the reference on the same words on the
/// CPU; nothing uploaded or allocated; one download, the output words `[B, 2 + N]`.
pub fn tree_accept_in(buffer: &Tensor, logits: &Tensor, packed: &PackedTrees) -> Result<Vec<u32>> {
    if packed.num_seqs() == 0 {
        return Ok(Vec::new());
    }
    Ok(tree_accept_launch(buffer, logits, packed)?.to_vec1()?)
}

/// `tree_accept_in`'s launch: the output words `[B * (2 + N)]` u32 as a view of `buffer`, not
/// downloaded (a step downloads them once the host has done what it can meanwhile).
pub fn tree_accept_launch(buffer: &Tensor, logits: &Tensor, packed: &PackedTrees) -> Result<Tensor> {
    packed.check_logits(logits.dims2()?)?;
    let words_len = packed.num_words();
    if buffer.dims1()? < words_len + packed.room() || buffer.dtype() != DType::U32 {
        return Err(Error::Internal(format!(
            "tree acceptance: a buffer of {:?} {:?} for {words_len} descriptor words and {} of room",
            buffer.dims(),
            buffer.dtype(),
            packed.room()
        )));
    }
    if packed.num_seqs() == 0 {
        // No block to launch (a grid of zero blocks is a launch error).
        return Err(Error::Internal("tree acceptance launched for no sequence".into()));
    }
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    buffer.inplace_op1(&InBuffer { packed, logits: &logits, words_len })?;
    Ok(buffer.narrow(0, words_len + packed.scratch_words(), packed.output_words())?)
}

/// `packed`'s descriptor and zeroed room on `device`, for `tree_accept_in` where no step's upload
/// carried them: ONE upload.
pub fn upload_packed(packed: &PackedTrees, device: &Device) -> Result<Tensor> {
    let mut words = packed.words();
    words.resize(words.len() + packed.room(), 0);
    crate::model::candle::upload(&words, device)
}

/// `tree_accept_in`'s launch, in place over the buffer: the kernel on CUDA (`batch/cuda.rs`),
/// `tree_accept_packed` on the CPU, each writing the output words where the other does.
struct InBuffer<'a> {
    packed: &'a PackedTrees,
    /// `[rows, vocab]` f32, contiguous.
    logits: &'a Tensor,
    words_len: usize,
}

impl InplaceOp1 for InBuffer<'_> {
    fn name(&self) -> &'static str {
        "tree-accept"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::U32(values) = storage else {
            return Err(candle_core::Error::Msg("a tree acceptance buffer holds u32 words".into()));
        };
        let logits: Vec<f32> = self.logits.flatten_all()?.to_vec1()?;
        let buffer = &mut values[layout.start_offset()..];
        let out = tree_accept_packed(&buffer[..self.words_len], &logits, self.packed.vocab_size);
        buffer[self.words_len + self.packed.scratch_words()..][..out.len()].copy_from_slice(&out);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut candle_core::CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (start, packed) = (layout.start_offset(), self.packed);
        super::cuda::tree_accept_in_place(storage, start, self.words_len, self.logits, packed)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

impl TreeAcceptOutput {
    /// The kernel's output words `[B, 2 + max_nodes]` (`tree_accept_packed`) as this struct.
    pub fn from_words(words: &[u32], max_nodes: usize) -> Self {
        let rows = words.chunks(2 + max_nodes);
        Self {
            num_accepted_tokens: rows.clone().map(|row| row[0]).collect(),
            accepted_nodes: rows.clone().flat_map(|row| row[2..].iter().copied()).collect(),
            next_token_ids: rows.map(|row| row[1]).collect(),
        }
    }
}

impl TreeAcceptInput<'_> {
    /// This padded batch packed (checked first): sequence s's rows start at logit row s * (n + 1).
    pub fn packed(&self) -> Result<PackedTrees> {
        self.check()?;
        let (n, mut packed) = (self.max_nodes, PackedTrees::new(self.max_nodes, self.vocab_size));
        for s in 0..self.batch {
            let count = self.num_nodes[s] as usize;
            let parents = &self.parents[s * n..s * n + count];
            let by_depth = &self.uniforms[s * (n + 1)..(s + 1) * (n + 1)];
            let depths = crate::tree::depths(parents)?;
            let row_uniforms: Vec<f32> =
                std::iter::once(by_depth[0]).chain(depths.iter().map(|&d| by_depth[d + 1])).collect();
            let drafts = &self.draft_token_ids[s * n..s * n + count];
            packed.push(s * (n + 1), drafts, parents, self.temperatures[s], &row_uniforms)?;
        }
        Ok(packed)
    }
}

/// The batch's acceptance on the CPU: `tree_accept_packed` of the padded batch packed.
pub fn tree_accept(input: &TreeAcceptInput) -> Result<TreeAcceptOutput> {
    let packed = input.packed()?;
    let words = tree_accept_packed(&packed.words(), input.target_logits, input.vocab_size);
    Ok(TreeAcceptOutput::from_words(&words, input.max_nodes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::accept::{accept, AcceptInput};
    use crate::sampler::Sampler;
    use crate::verify::tree::verify_tree;

    /// A small deterministic generator for test inputs.
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 40) as f32 / (1u64 << 24) as f32
        }
        fn below(&mut self, n: usize) -> usize {
            ((self.next() * n as f32) as usize).min(n - 1)
        }
    }

    /// Random trees (`[b, n]` tokens and parents, `[b]` sizes from 0 to n) and their logits
    /// `[b, n + 1, v]`: two rows in three peak on the token of one of the row's children, so walks
    /// often go deep, stop at the root, or stop mid-tree.
    fn random_trees(b: usize, n: usize, v: usize, seed: u64) -> (Vec<f32>, Vec<u32>, Vec<i32>, Vec<u32>) {
        let mut rng = Lcg(seed);
        let (mut logits, mut drafts, mut parents, mut num_nodes) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for s in 0..b {
            let count = if s % 7 == 0 { 0 } else { 1 + rng.below(n) };
            num_nodes.push(count as u32);
            let first = parents.len();
            for i in 0..n {
                // Sometimes a chain link, sometimes any earlier node or the root; padding is -1.
                let parent = if i >= count {
                    -1
                } else if i > 0 && rng.next() < 0.4 {
                    i as i32 - 1
                } else {
                    rng.below(i + 1) as i32 - 1
                };
                parents.push(parent);
                drafts.push(rng.below(v) as u32);
            }
            for r in 0..=n {
                let kids: Vec<usize> = (0..count).filter(|&i| parents[first + i] == r as i32 - 1).collect();
                let peak = (!kids.is_empty() && rng.next() < 0.67).then(|| drafts[first + kids[rng.below(kids.len())]]);
                logits.extend((0..v).map(|t| rng.next() * 2.0 + if peak == Some(t as u32) { 9.0 } else { 0.0 }));
            }
        }
        (logits, drafts, parents, num_nodes)
    }

    /// How a walk ended: at the root with children to choose from, mid-tree at a node with
    /// children, at a leaf (full acceptance), or at a root without children.
    fn ending(parents: &[i32], path: &[usize]) -> &'static str {
        let last = path.last().map_or(-1, |&node| node as i32);
        match (path.is_empty(), parents.contains(&last)) {
            (true, true) => "rejected at the root",
            (true, false) => "empty tree",
            (false, true) => "rejected mid-tree",
            (false, false) => "accepted to a leaf",
        }
    }

    fn check_against_verify_tree(temperatures: &[f32]) {
        let (b, n, v) = (96, 6, 12);
        let (logits, drafts, parents, num_nodes) = random_trees(b, n, v, 17);
        let temperatures: Vec<f32> = (0..b).map(|s| temperatures[s % temperatures.len()]).collect();
        let seeds: Vec<u64> = (0..b as u64).map(|s| 500 + s).collect();
        let positions: Vec<usize> = (0..b).map(|s| 30 + 3 * s).collect();
        let uniforms: Vec<f32> = (0..b)
            .flat_map(|s| {
                let sampler = Sampler::new(Some(seeds[s]));
                (0..=n).map(|d| sampler.uniform_at(positions[s] + d)).collect::<Vec<_>>()
            })
            .collect();
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
        let out = tree_accept(&input).unwrap();
        let mut endings = std::collections::BTreeSet::new();
        for s in 0..b {
            let count = num_nodes[s] as usize;
            let rows = &logits[s * (n + 1) * v..][..(count + 1) * v];
            let tree_parents = &parents[s * n..s * n + count];
            let params = SamplingParams { temperature: temperatures[s], ..SamplingParams::default() };
            let mut sampler = Sampler::new(Some(seeds[s]));
            let expected = verify_tree(
                rows,
                v,
                &drafts[s * n..s * n + count],
                tree_parents,
                None,
                &params,
                &mut sampler,
                positions[s],
            )
            .unwrap();
            let accepted = out.num_accepted_tokens[s] as usize;
            let path: Vec<usize> = out.accepted_nodes[s * n..s * n + accepted].iter().map(|&i| i as usize).collect();
            assert_eq!(path, expected.accepted_path, "sequence {s}");
            assert!(out.accepted_nodes[s * n + accepted..(s + 1) * n].iter().all(|&i| i == NO_NODE), "sequence {s}");
            assert_eq!(out.next_token_ids[s], *expected.token_ids.last().unwrap(), "sequence {s}");
            endings.insert(ending(tree_parents, &path));
        }
        assert_eq!(endings.len(), 4, "every kind of walk must occur: {endings:?}");
    }

    #[test]
    fn equals_verify_tree_greedy() {
        check_against_verify_tree(&[0.0]);
    }

    #[test]
    fn equals_verify_tree_sampled() {
        check_against_verify_tree(&[0.7, 1.0, 1.5]);
    }

    #[test]
    fn equals_verify_tree_with_greedy_and_sampled_sequences_mixed() {
        check_against_verify_tree(&[0.0, 1.0, 0.0, 0.5]);
    }

    #[test]
    fn a_greedy_chain_equals_chain_acceptance() {
        // A chain (parent i - 1) is a draft: greedy tree acceptance is the chain's acceptance.
        let (b, n, v) = (40, 5, 10);
        let (logits, drafts, _, num_nodes) = random_trees(b, n, v, 3);
        let chain: Vec<i32> = (0..b).flat_map(|_| (0..n as i32).map(|i| i - 1)).collect();
        let (temperatures, uniforms) = (vec![0.0; b], vec![0.5; b * (n + 1)]);
        let tree = tree_accept(&TreeAcceptInput {
            batch: b,
            max_nodes: n,
            vocab_size: v,
            target_logits: &logits,
            draft_token_ids: &drafts,
            parents: &chain,
            num_nodes: &num_nodes,
            temperatures: &temperatures,
            uniforms: &uniforms,
        })
        .unwrap();
        let chain_out = accept(&AcceptInput {
            batch: b,
            max_draft_tokens: n,
            vocab_size: v,
            target_logits: &logits,
            draft_token_ids: &drafts,
            num_draft_tokens: &num_nodes,
            draft_probs: None,
            temperatures: &temperatures,
            uniforms: &uniforms,
        })
        .unwrap();
        assert!(tree.num_accepted_tokens.iter().any(|&a| a > 1), "no chain was accepted past its first node");
        assert_eq!(tree.num_accepted_tokens, chain_out.num_accepted_tokens);
        assert_eq!(tree.next_token_ids, chain_out.next_token_ids);
        for s in 0..b {
            let accepted = tree.num_accepted_tokens[s] as usize;
            assert_eq!(tree.accepted_nodes[s * n..s * n + accepted], (0..accepted as u32).collect::<Vec<_>>()[..]);
        }
    }

    #[test]
    fn bad_shapes_are_named() {
        let input = TreeAcceptInput {
            batch: 1,
            max_nodes: 2,
            vocab_size: 4,
            target_logits: &[0.0; 12],
            draft_token_ids: &[1, 9],
            parents: &[-1],
            num_nodes: &[3],
            temperatures: &[0.0],
            uniforms: &[0.5; 2],
        };
        let message = tree_accept(&input).unwrap_err().to_string();
        for expected in
            ["uniforms has 2 values, expected 3", "parents has 1 values, expected 2", "num_nodes 3", "draft token 9"]
        {
            assert!(message.contains(expected), "{message}");
        }
    }

    #[test]
    fn bad_parents_are_named() {
        // Node 1's parent is itself; node 2's is a later node; the padding (node 3) is not read.
        for (parents, bad) in [
            ([-1, 1, 0, 7], "parent 1 of node 1"),
            ([-1, 0, 3, 7], "parent 3 of node 2"),
            ([-2, 0, 0, 7], "parent -2 of node 0"),
        ] {
            let input = TreeAcceptInput {
                batch: 1,
                max_nodes: 4,
                vocab_size: 4,
                target_logits: &[0.0; 20],
                draft_token_ids: &[1, 2, 3, 0],
                parents: &parents,
                num_nodes: &[3],
                temperatures: &[0.0],
                uniforms: &[0.5; 5],
            };
            let message = tree_accept(&input).unwrap_err().to_string();
            assert!(message.contains(bad), "{message}");
        }
        let fine = TreeAcceptInput {
            batch: 1,
            max_nodes: 4,
            vocab_size: 4,
            target_logits: &[0.0; 20],
            draft_token_ids: &[1, 2, 3, 0],
            parents: &[-1, 0, 0, 7],
            num_nodes: &[3],
            temperatures: &[0.0],
            uniforms: &[0.5; 5],
        };
        // All-equal logits: the argmax is token 0, which no child of the root carries.
        let out = tree_accept(&fine).unwrap();
        assert_eq!((out.num_accepted_tokens, out.next_token_ids), (vec![0], vec![0]));
        assert_eq!(out.accepted_nodes, vec![NO_NODE; 4]);
    }
}
