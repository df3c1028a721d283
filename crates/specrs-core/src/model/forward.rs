//! The forward contract both backends implement: one forward over several sequences, each with its
//! own KV cache, its new tokens laid out as a chain or a token tree, returning logits for the rows
//! that ask for them and hidden states at the requested taps.
//!
//! Rows are flattened: sequence `s` owns rows `offsets[s]..offsets[s + 1]`, and row `r` of the
//! batch is its token `tokens[r]` at position `positions[r]`. `parents[r]` is the index, within
//! its own sequence, of the row it extends, or -1 when it extends the cache directly. A chain is
//! the tree whose row i has parent i - 1. A row attends to every position its cache held before
//! the forward plus its ancestors (itself included), and to nothing else: not its siblings, not
//! other sequences. Its position must be `cache.len() + depth` (depth 0 for a row whose parent is
//! the cache), which is what a chain run of its root-to-row path would give it.
//!
//! Invariant (the one losslessness stands on): on the CPU backend a row's logits and hidden states
//! are bitwise the same whatever else is in the forward (other sequences, tree siblings, chain or
//! tree, one forward or several). After the forward, each cache holds its old positions plus every
//! new row in row order; `KvCache::keep` then keeps the accepted path.
//!
//! Tap convention: `Tap::Residual(i)` is the residual stream after the first `i` decoder blocks
//! (`Residual(0)` is the token embedding, scaled where the family scales it). It is transformers'
//! `output_hidden_states[i]` for `i < num_layers`, and vLLM's and EAGLE's auxiliary layer id `i`
//! (their models capture the residual entering block `i`; EAGLE-3's defaults `2, L/2, L-3` are
//! `Residual(2), Residual(L/2), Residual(L-3)`). SGLang's defaults are the same tensors, but an
//! explicit `eagle_aux_hidden_state_layer_ids` entry `k` makes SGLang capture `Residual(k + 1)`
//! where vLLM captures `Residual(k)`: checkpoints trained with SGLang's ids need them plus one. `Residual(num_layers)` is the last
//! hidden state before the final norm; `Tap::FinalNorm` is the one after it (what the LM head
//! reads, and transformers' last `output_hidden_states` entry).
//!
//! A batch may carry words for the work that follows the forward (the step's acceptance:
//! `CarriedWords`); a forward that uploads a step buffer writes them beside its own and returns
//! where they are (`Carried`), so a step uploads once.

use crate::error::{Error, Result};

/// A hidden state a forward can return, `[num_rows, hidden_size]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tap {
    /// The residual stream after this many blocks (0 = the embedding; see the module header).
    Residual(usize),
    /// The last hidden state after the final norm.
    FinalNorm,
}

/// One sequence's part of a forward, as a session plans it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRows {
    /// `[n]` new tokens.
    pub tokens: Vec<u32>,
    /// `[n]` the parent of each new token within these rows, -1 for the cache. Parents come
    /// before their children.
    pub parents: Vec<i32>,
    /// Indices into `tokens` (increasing) whose logits the caller needs.
    pub logit_rows: Vec<usize>,
}

impl SeqRows {
    /// `tokens` as a chain after the cache, with logits for `logits` rows.
    pub fn chain(tokens: Vec<u32>, logits: LogitRows) -> Self {
        let n = tokens.len();
        let logit_rows = match logits {
            LogitRows::All => (0..n).collect(),
            LogitRows::Last => n.checked_sub(1).into_iter().collect(),
            LogitRows::None => Vec::new(),
        };
        Self { parents: (0..n as i32).map(|i| i - 1).collect(), tokens, logit_rows }
    }

    /// `tokens` as a tree given by `parents`, with logits for every node.
    pub fn tree(tokens: Vec<u32>, parents: Vec<i32>) -> Self {
        let logit_rows = (0..tokens.len()).collect();
        Self { tokens, parents, logit_rows }
    }

    /// Depth of each row below the cache (0 for a row whose parent is the cache). Errors when a
    /// parent does not come before its child.
    pub fn depths(&self) -> Result<Vec<usize>> {
        if self.parents.len() != self.tokens.len() {
            return Err(Error::config(format!(
                "{} parents for {} tokens; give one parent index per token (-1 for the cache)",
                self.parents.len(),
                self.tokens.len()
            )));
        }
        crate::proposer::tree::try_depths(&self.parents).map_err(|(row, p)| {
            Error::config(format!("token {row} has parent {p}; a parent is -1 (the cache) or an earlier token's index"))
        })
    }
}

/// Which positions of a single-sequence chain forward get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Every new position: verification.
    All,
    /// Only the last new position: prefill and plain decoding (skips the LM head elsewhere).
    Last,
    /// None: a prefill whose logits nobody reads (a draft catching up), or hidden states only.
    None,
}

/// A validated forward over several sequences (see the module header).
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    /// `[num_rows]`
    pub tokens: Vec<u32>,
    /// `[num_rows]`
    pub positions: Vec<usize>,
    /// `[num_seqs + 1]`
    pub offsets: Vec<usize>,
    /// `[num_rows]` parent row within the sequence, -1 = the cache.
    pub parents: Vec<i32>,
    /// Rows (batch-wide indices, increasing) that get logits.
    pub logit_rows: Vec<usize>,
    /// Hidden states returned, in this order.
    pub taps: Vec<Tap>,
    /// Run only the first this-many blocks (early exit: the layer-skip draft); `None` = all.
    /// Keys and values are written to those layers only.
    pub exit_layer: Option<usize>,
    /// Words for work after the forward on its outputs (the step's acceptance), carried by the
    /// forward's own upload where the forward makes one (a paged step on the candle decoder:
    /// `ForwardOutput::carried`); `None`: nothing to carry.
    pub carried: Option<CarriedWords>,
}

/// Words a step's one upload carries beside the forward's own, and `room` words left after them
/// for the work that reads them (its scratch and output), so that work neither uploads nor
/// allocates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CarriedWords {
    pub words: Vec<u32>,
    pub room: usize,
}

impl ForwardBatch {
    /// One batch from each sequence's rows, for caches holding `cache_lens` positions.
    pub fn new(seqs: &[SeqRows], cache_lens: &[usize], taps: Vec<Tap>) -> Result<Self> {
        if seqs.len() != cache_lens.len() {
            return Err(Error::config(format!(
                "{} sequences for {} caches; pass one cache per sequence",
                seqs.len(),
                cache_lens.len()
            )));
        }
        let mut batch = ForwardBatch { offsets: vec![0], taps, ..Default::default() };
        for (s, (seq, &past)) in seqs.iter().zip(cache_lens).enumerate() {
            if seq.tokens.is_empty() {
                return Err(Error::config(format!(
                    "sequence {s} has no tokens; every sequence of a forward needs one"
                )));
            }
            let depths = seq.depths()?;
            let first = batch.tokens.len();
            if let Some(bad) = seq.logit_rows.windows(2).find(|w| w[0] >= w[1]) {
                return Err(Error::config(format!(
                    "sequence {s}: logit rows must increase (got {} then {})",
                    bad[0], bad[1]
                )));
            }
            if let Some(&bad) = seq.logit_rows.iter().find(|&&r| r >= seq.tokens.len()) {
                return Err(Error::config(format!(
                    "sequence {s}: logit row {bad} is past its {} tokens",
                    seq.tokens.len()
                )));
            }
            batch.tokens.extend_from_slice(&seq.tokens);
            batch.parents.extend_from_slice(&seq.parents);
            batch.positions.extend(depths.iter().map(|d| past + d));
            batch.logit_rows.extend(seq.logit_rows.iter().map(|r| first + r));
            batch.offsets.push(batch.tokens.len());
        }
        Ok(batch)
    }

    /// One chain for one cache: what `CausalLm::forward_rows` runs.
    pub fn chain(tokens: &[u32], past: usize, logits: LogitRows) -> Result<Self> {
        Self::new(&[SeqRows::chain(tokens.to_vec(), logits)], &[past], Vec::new())
    }

    pub fn num_rows(&self) -> usize {
        self.tokens.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Rows of sequence `s`.
    pub fn seq_range(&self, s: usize) -> std::ops::Range<usize> {
        self.offsets[s]..self.offsets[s + 1]
    }

    /// Whether sequence `s` is a chain (row i's parent is i - 1): the backends' fast path.
    pub fn is_chain(&self, s: usize) -> bool {
        self.parents[self.seq_range(s)].iter().enumerate().all(|(i, &p)| p == i as i32 - 1)
    }

    /// Ancestors of `row` (batch-wide index) within its sequence `s`, root first, itself last, as
    /// indices from the sequence's first row.
    pub fn path(&self, s: usize, row: usize) -> Vec<usize> {
        let start = self.offsets[s];
        let mut path = Vec::new();
        let mut at = (row - start) as i32;
        while at >= 0 {
            path.push(at as usize);
            at = self.parents[start + at as usize];
        }
        path.reverse();
        path
    }

    /// Checks what the backends index unchecked, against the model and the caches: the taps and
    /// exit layer exist, the positions follow the tree, the caches have room.
    pub fn check(&self, num_layers: usize, vocab_size: usize, cache_lens: &[usize]) -> Result<()> {
        check_token_ids(&self.tokens, vocab_size)?;
        if cache_lens.len() != self.num_seqs() {
            return Err(Error::config(format!(
                "{} caches for {} sequences; pass one cache per sequence",
                cache_lens.len(),
                self.num_seqs()
            )));
        }
        let blocks = self.exit_layer.unwrap_or(num_layers);
        if let Some(exit) = self.exit_layer {
            check_exit_layer(exit, num_layers)?;
        }
        for tap in &self.taps {
            if let Tap::Residual(i) = tap {
                if *i > blocks {
                    return Err(Error::config(format!(
                        "hidden-state layer {i} does not exist here; this forward runs {blocks} blocks, so layers are 0..={blocks}"
                    )));
                }
            }
        }
        if let Some(bad) = self.logit_rows.windows(2).find(|w| w[0] >= w[1]) {
            return Err(Error::Internal(format!("logit rows must increase (got {} then {})", bad[0], bad[1])));
        }
        if self.logit_rows.last().is_some_and(|&r| r >= self.num_rows()) {
            return Err(Error::Internal("a logit row past the batch".into()));
        }
        for (s, &past) in cache_lens.iter().enumerate() {
            let range = self.seq_range(s);
            if range.is_empty() {
                return Err(Error::Internal(format!("sequence {s} has no rows")));
            }
            let mut depths: Vec<usize> = Vec::with_capacity(range.len());
            for (i, row) in range.enumerate() {
                let depth = match self.parents[row] {
                    -1 => 0,
                    p if p >= 0 && (p as usize) < i => depths[p as usize] + 1,
                    p => {
                        return Err(Error::Internal(format!("sequence {s} row {i}: parent {p} is not an earlier row")))
                    }
                };
                if self.positions[row] != past + depth {
                    return Err(Error::Internal(format!(
                        "sequence {s} row {i}: position {} but its cache holds {past} and its depth is {depth}",
                        self.positions[row]
                    )));
                }
                depths.push(depth);
            }
        }
        Ok(())
    }
}

/// Refuses token ids outside the vocabulary before they index the embedding table (out of range
/// on the CPU, undefined on a GPU). Every entry point checks its ids; this is the last guard, for
/// ids that reach a model another way (a draft model with a smaller vocabulary than its target's).
pub(crate) fn check_token_ids(tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        None => Ok(()),
        Some(bad) => Err(Error::config(format!(
            "token id {bad} is outside the model's vocabulary (size {vocab_size}); pass ids below {vocab_size}"
        ))),
    }
}

/// `forward_early_exit`'s bound: at least one block, at most all `num_blocks`.
pub(crate) fn check_exit_layer(num_layers: usize, num_blocks: usize) -> Result<()> {
    if num_layers == 0 || num_layers > num_blocks {
        return Err(Error::config(format!("exit_layer must be in 1..={num_blocks} for this model (got {num_layers})")));
    }
    Ok(())
}

/// What a forward returns.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[logit_rows.len(), vocab_size]` f32
    pub logits: candle_core::Tensor,
    /// One per requested tap, `[num_rows, hidden_size]` f32.
    pub hidden: Vec<candle_core::Tensor>,
    /// The batch's `carried` words where the forward's upload put them; `None` where the forward
    /// carried nothing (the caller uploads them itself).
    pub carried: Option<Carried>,
}

/// Carried words on the forward's device: `words` `[words + room]` u32, a view of the step's
/// buffer, which stays the step's (out of its free list) until this is dropped.
pub struct Carried {
    pub words: candle_core::Tensor,
    pub(crate) _buffer: Box<dyn std::any::Any + Send + Sync>,
}

impl std::fmt::Debug for Carried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Carried").field("words", &self.words).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_follow_depths_and_rows_flatten() {
        let seqs = [SeqRows::chain(vec![1, 2, 3], LogitRows::Last), SeqRows::tree(vec![4, 5, 6, 7], vec![-1, 0, 0, 1])];
        let batch = ForwardBatch::new(&seqs, &[10, 2], vec![Tap::FinalNorm]).unwrap();
        assert_eq!(batch.positions, [10, 11, 12, 2, 3, 3, 4]);
        assert_eq!(batch.offsets, [0, 3, 7]);
        assert_eq!(batch.logit_rows, [2, 3, 4, 5, 6]);
        assert!(batch.is_chain(0) && !batch.is_chain(1));
        assert_eq!(batch.path(1, 6), [0, 1, 3]);
        batch.check(4, 100, &[10, 2]).unwrap();
        assert!(batch.check(4, 100, &[10, 3]).unwrap_err().to_string().contains("position 2"));
    }

    #[test]
    fn bad_trees_and_taps_are_refused_with_what_to_change() {
        let err = ForwardBatch::new(&[SeqRows::tree(vec![1, 2], vec![-1, 1])], &[0], vec![]).unwrap_err();
        assert!(err.to_string().contains("earlier token"), "{err}");
        let err = ForwardBatch::new(&[SeqRows::tree(vec![], vec![])], &[0], vec![]).unwrap_err();
        assert!(err.to_string().contains("no tokens"), "{err}");
        let batch =
            ForwardBatch::new(&[SeqRows::chain(vec![1], LogitRows::All)], &[0], vec![Tap::Residual(5)]).unwrap();
        assert!(batch.check(4, 100, &[0]).unwrap_err().to_string().contains("0..=4"));
        assert!(batch.check(8, 100, &[0]).is_ok());
        assert!(batch.check(8, 1, &[0]).unwrap_err().to_string().contains("vocabulary"));
    }
}
