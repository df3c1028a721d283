//! Hidden-state heads: small networks trained on the target's hidden states that draft from them.
//! EAGLE-1/2 and EAGLE-3 (`eagle.rs`), MTP layers (`mtp.rs`), IBM's MLP speculator
//! (`mlp_speculator.rs`), Medusa (`medusa.rs`), DFlash block drafters (`dflash.rs`) and DSpark's
//! (`dspark.rs`), loaded from the checkpoints the field publishes (`load.rs`).
//!
//! Three shapes of head share one proposer (`HeadProposer`):
//! - recurrent heads (EAGLE, EAGLE-3, MTP) run a decoder layer with their own KV cache over the
//!   context, pairing the target's hidden state at position j with the token at j + 1, then draft
//!   autoregressively, feeding their own output hidden state back;
//! - parallel heads (MLP speculator, Medusa) draft token i from the target's last hidden state
//!   (and, for the MLP speculator, from the tokens drawn before it) with their i-th head;
//! - block heads (DFlash, DSpark) keep a KV cache of the context's target hidden states and draft
//!   a whole block in one forward: the newest token followed by mask tokens, one output row per
//!   drafted position (whose logits, with DSpark's Markov head, also read the token before it).
//!
//! Every drafted token of a chain is drawn from the head's own distribution q after the request's
//! sampling settings and goes to the same verifier as every other draft, with q, so greedy output
//! equals plain decoding and sampling is exact rejection sampling.
//!
//! Token trees (`propose_tree`) are EAGLE-2's dynamic trees (`draft_model::DynamicTree`): each
//! node's children are its top-k tokens under q, the best nodes of each depth are expanded in one
//! batched step (recurrent heads: `RecurrentHead::step_tree`, each row attending to the context
//! and its own ancestors only; parallel heads: `ParallelHead::step_rows`), and the best nodes by
//! cumulative q are kept (block heads: every node of depth d gets its children from the block's
//! row d, so the tree costs no forward beyond the block). Tree drafts are deterministic (no q),
//! which the verifier checks exactly by drawing the target's token and accepting the child equal
//! to it.
//!
//! Invariant: a head writes no target cache. Its own cache holds one position per context
//! position whose target hidden state it has read (`fed`), and nothing past it between drafts:
//! positions written while drafting (chain or tree) are truncated away before `propose` /
//! `propose_tree` returns, and the accepted tokens' positions are recomputed from the target's own
//! hidden states at the next draft.

pub mod dflash;
pub mod dspark;
pub mod eagle;
pub mod layer;
pub mod load;
pub mod medusa;
pub mod mlp_speculator;
pub mod mtp;
pub mod weights;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::{CausalLm, Tap};
use crate::proposer::draft_model::{DraftBuilder, DraftDrawing, DraftSampler, DraftedToken, DynamicTree};
use crate::proposer::{Draft, Proposer, TreeLimits};
use layer::TreeRows;
use weights::Linear;

/// A head that drafts autoregressively with its own decoder layer(s) and KV cache.
pub trait RecurrentHead: Send + Sync {
    /// The target hidden states it reads, concatenated in this order into one row per position.
    fn taps(&self) -> Vec<Tap>;
    /// One empty cache per decoder layer of the head.
    fn new_caches(&self, capacity: usize, kv_bytes: &Arc<KvBytes>) -> Result<Vec<KvCache>>;
    /// Reads context rows: `target_hidden` `[n, taps width]` of positions `start..start + n` and
    /// `next_tokens` `[n]` (the token after each). Returns the head's output hidden states
    /// `[n, hidden_size]`; the last row drafts the first token.
    fn extend(
        &self,
        caches: &mut [KvCache],
        target_hidden: &Tensor,
        next_tokens: &[u32],
        start: usize,
    ) -> Result<Tensor>;
    /// Draft step `step` (1 for the second draft token) at `position` (the drawn token's position
    /// minus one, as for context rows): from the previous output hidden `[1, hidden_size]` and the
    /// token drawn from it, the next output hidden `[1, hidden_size]`.
    fn step(&self, caches: &mut [KvCache], hidden: &Tensor, token: u32, step: usize, position: usize)
        -> Result<Tensor>;
    /// Whether `step_tree` is implemented; a head that says no gets a chain when a tree is asked
    /// for.
    fn drafts_trees(&self) -> bool {
        false
    }
    /// The cache (index into `new_caches`' list) draft step `step` appends its rows to: the
    /// head's one layer, or the MTP layer that step cycles to.
    fn step_cache(&self, _step: usize) -> usize {
        0
    }
    /// Draft step `step` for several tree nodes at once: from their parents' output hiddens
    /// `[m, hidden_size]` and their `tokens` `[m]`, their output hiddens `[m, hidden_size]`,
    /// appending m rows to cache `step_cache(step)`. Row i attends as `rows` says (the context
    /// rows, its ancestors' rows, itself), so it equals what `step` gives at the end of a chain
    /// run of its path, up to summation order.
    fn step_tree(
        &self,
        _caches: &mut [KvCache],
        _hidden: &Tensor,
        _tokens: &[u32],
        _step: usize,
        _rows: &TreeRows,
    ) -> Result<Tensor> {
        Err(Error::Internal("this head drafts chains only (drafts_trees is false)".into()))
    }
    /// Logits `[n, target_vocab]` f32 of output hidden states `[n, hidden_size]` made by draft
    /// step `step` (0: `extend`), since heads with several layers have one LM head each. A head
    /// with a draft vocabulary puts -inf on every target token outside it.
    fn logits(&self, hidden: &Tensor, step: usize) -> Result<Tensor>;
    /// What a context row read by `extend` costs as a share of a draft step, by the weights each
    /// multiplies: a row runs the layer but not the LM head, which only the row drafted from
    /// reads (for a small model's head, most of a step's weights).
    fn context_row_share(&self) -> f64;
}

/// `RecurrentHead::context_row_share` of a head whose context row multiplies `row_weights` and
/// whose draft step multiplies `step_weights` and then an LM head: `own_lm_head`, or the
/// target's (`[vocab, hidden]`).
pub(crate) fn row_share(
    row_weights: usize,
    step_weights: usize,
    own_lm_head: Option<&Linear>,
    target: &dyn CausalLm,
) -> f64 {
    let info = target.info();
    let lm_head = own_lm_head.map_or(info.vocab_size * info.hidden_size, Linear::num_weights);
    row_weights as f64 / (step_weights + lm_head).max(1) as f64
}

/// A head that drafts token i with its i-th sub-head from the target's last hidden state.
pub trait ParallelHead: Send + Sync {
    /// The target hidden state it reads (one tap).
    fn tap(&self) -> Tap;
    /// How many tokens it can draft per step.
    fn num_heads(&self) -> usize;
    /// Sub-head `i`: from `state` `[1, width]` (the target's hidden state for `i == 0`) and the
    /// token before the one it drafts, logits `[1, target_vocab]` and the state sub-head `i + 1`
    /// reads.
    fn step(&self, i: usize, state: &Tensor, token: u32) -> Result<(Tensor, Tensor)>;
    /// `step` over several rows at once (tree nodes of one depth): `states` `[m, width]`,
    /// `tokens` `[m]`; logits `[m, target_vocab]` and next states `[m, width']`. Row by row
    /// unless the head batches it.
    fn step_rows(&self, i: usize, states: &Tensor, tokens: &[u32]) -> Result<(Tensor, Tensor)> {
        let mut logits = Vec::with_capacity(tokens.len());
        let mut next = Vec::with_capacity(tokens.len());
        for (r, &token) in tokens.iter().enumerate() {
            let (l, s) = self.step(i, &states.narrow(0, r, 1)?, token)?;
            logits.push(l);
            next.push(s);
        }
        Ok((Tensor::cat(&logits, 0)?, Tensor::cat(&next, 0)?))
    }
}

/// A head that drafts a whole block of positions in one forward (DFlash, DSpark).
pub trait BlockHead: Send + Sync {
    /// The target hidden states it reads, concatenated in this order into one row per position.
    fn taps(&self) -> Vec<Tap>;
    /// One empty cache per layer of the head.
    fn new_caches(&self, capacity: usize, kv_bytes: &Arc<KvBytes>) -> Result<Vec<KvCache>>;
    /// Reads context rows: `target_hidden` `[n, taps width]` of positions `start..start + n`.
    fn extend(&self, caches: &mut [KvCache], target_hidden: &Tensor, start: usize) -> Result<()>;
    /// How many tokens one block drafts.
    fn block_len(&self) -> usize;
    /// One block from the newest context token `anchor` at `position`: the output rows
    /// `[block_len, hidden]` that draft positions `position + 1..`, in order. Leaves the caches
    /// as they were.
    fn block(&self, caches: &[KvCache], anchor: u32, position: usize) -> Result<Tensor>;
    /// Logits `[n, target_vocab]` f32 of drafting rows `rows` `[n, hidden]`, each after the token
    /// `previous[i]` (the token drafted before it, or the anchor), which only a Markov head reads.
    fn logits(&self, rows: &Tensor, previous: &[u32]) -> Result<Tensor>;
    /// Whether `logits` reads `previous` (DSpark's Markov head): then row i's logits wait for
    /// token i - 1 to be drawn, and a tree's nodes of one depth get different children.
    fn reads_previous(&self) -> bool {
        false
    }
    /// DSpark's confidence head: for each of `rows` `[n, hidden]` after `previous[i]`, the
    /// probability that its draft is accepted; None for heads without one.
    fn confidence(&self, _rows: &Tensor, _previous: &[u32]) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
    /// What a context row read by `extend` costs as a share of one block (one draft, what a
    /// block drafter's cost c is charged for).
    fn context_row_share(&self) -> f64;
}

/// A loaded head, shared by every request of an engine.
#[derive(Clone)]
pub enum Head {
    Recurrent(Arc<dyn RecurrentHead>),
    Parallel(Arc<dyn ParallelHead>),
    Block(Arc<dyn BlockHead>),
}

impl Head {
    pub fn taps(&self) -> Vec<Tap> {
        match self {
            Head::Recurrent(h) => h.taps(),
            Head::Parallel(h) => vec![h.tap()],
            Head::Block(h) => h.taps(),
        }
    }

    /// The most tokens one draft may hold (a parallel head has one sub-head per token, a block
    /// head drafts its block), and why.
    pub fn max_draft_tokens(&self) -> Option<(usize, String)> {
        match self {
            Head::Recurrent(_) => None,
            Head::Parallel(h) => Some((h.num_heads(), "one per sub-head".into())),
            Head::Block(h) => Some((
                h.block_len(),
                format!("it was trained on blocks of {}: the newest token and the drafts", h.block_len() + 1),
            )),
        }
    }
}

/// One request's head proposer.
pub struct HeadProposer {
    head: Head,
    method: &'static str,
    target_vocab: usize,
    drawing: DraftDrawing,
    kv_bytes: Arc<KvBytes>,
    sampler: Option<DraftSampler>,
    /// Recurrent and block heads' caches (one per head layer).
    caches: Vec<KvCache>,
    /// Context positions whose target hidden states the head has read into its caches.
    fed: usize,
    /// Target hidden rows not read yet: positions `fed..fed + pending rows`, taps concatenated.
    pending: Vec<Tensor>,
    pending_rows: usize,
    /// Each draft step's logits `[target_vocab]`, when recording (`Engine::head_draft`).
    recorded: Option<Vec<Vec<f32>>>,
}

impl HeadProposer {
    pub fn new(
        head: Head,
        method: &'static str,
        target_vocab: usize,
        drawing: DraftDrawing,
        kv_bytes: Arc<KvBytes>,
    ) -> Self {
        Self {
            head,
            method,
            target_vocab,
            drawing,
            kv_bytes,
            sampler: None,
            caches: Vec::new(),
            fed: 0,
            pending: Vec::new(),
            pending_rows: 0,
            recorded: None,
        }
    }

    /// Keeps every draft step's logits from now on (`take_recorded`): what the golden tests
    /// compare with the reference implementations. A tree records every expanded node's, the
    /// root's first, then depth by depth in frontier order; a block head without a Markov head
    /// records the rows a chain may draw from (the first `max_tokens`), one per depth of a tree.
    pub fn record_logits(&mut self) {
        self.recorded = Some(Vec::new());
    }

    pub fn take_recorded(&mut self) -> Vec<Vec<f32>> {
        self.recorded.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// A draft token from `logits` (`[1, target_vocab]`) for output `position`, recorded when
    /// recording.
    fn draw(&mut self, logits: &Tensor, position: usize) -> Result<DraftedToken> {
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let sampler =
            self.sampler.as_mut().ok_or_else(|| Error::Internal("head proposer used before begin()".into()))?;
        let token = sampler.draw(&logits, position);
        if let Some(recorded) = self.recorded.as_mut() {
            recorded.push(logits);
        }
        Ok(token)
    }

    /// Logit rows `[n][target_vocab]` of `logits` (`[n, target_vocab]`), each recorded when
    /// recording.
    fn logit_rows(&mut self, logits: &Tensor) -> Result<Vec<Vec<f32>>> {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        if let Some(recorded) = self.recorded.as_mut() {
            recorded.extend(rows.iter().cloned());
        }
        Ok(rows)
    }

    fn sampler(&self) -> Result<&DraftSampler> {
        self.sampler.as_ref().ok_or_else(|| Error::Internal("head proposer used before begin()".into()))
    }

    fn internal(&self, what: &str) -> Error {
        Error::Internal(format!("the {} head {what}", self.method))
    }

    /// The pending target rows `[n, width]` with their first position, taken out of `pending`.
    fn take_pending(&mut self, context_len: usize) -> Result<(Tensor, usize)> {
        // The target has read every context token but the newest: its rows cover 0..len - 1.
        if self.fed + self.pending_rows != context_len - 1 || self.pending_rows == 0 {
            return Err(self.internal(&format!(
                "has target hidden states up to position {} for a context of {context_len} tokens",
                self.fed + self.pending_rows
            )));
        }
        let rows = if self.pending.len() == 1 { self.pending.remove(0) } else { Tensor::cat(&self.pending, 0)? };
        self.pending.clear();
        let start = self.fed;
        self.pending_rows = 0;
        Ok((rows, start))
    }

    fn draft_recurrent(&mut self, head: &Arc<dyn RecurrentHead>, context: &[u32], max_tokens: usize) -> Result<Draft> {
        let (target_hidden, start) = self.take_pending(context.len())?;
        let n = target_hidden.dim(0)?;
        let out = head.extend(&mut self.caches, &target_hidden, &context[start + 1..start + 1 + n], start)?; // [n, hidden]
        self.fed = start + n;
        let mut hidden = out.narrow(0, n - 1, 1)?;
        let cache_lens: Vec<usize> = self.caches.iter().map(KvCache::len).collect();
        let mut draft = DraftBuilder::after(context.len());
        let mut step = 0;
        loop {
            let token = self.draw(&head.logits(&hidden, step)?, draft.next_position())?;
            if !draft.push(token) || draft.len() >= max_tokens {
                break;
            }
            step += 1;
            // As a context row pairs position j's hidden state with token j + 1, the row of draft
            // token `step` is at the position before it: fed + step - 1.
            hidden = head.step(&mut self.caches, &hidden, draft.last(), step, self.fed + step - 1)?;
        }
        // Positions written while drafting came from the head's own guesses: drop them.
        for (cache, len) in self.caches.iter_mut().zip(cache_lens) {
            cache.truncate(len);
        }
        Ok(draft.build())
    }

    /// EAGLE-2's tree with a recurrent head: the root's children from the last context row's
    /// output, then per depth one `step_tree` over the frontier (row i at the position a chain
    /// would give its node, attending to the context and to the rows of its ancestors that the
    /// same cache holds). The caches are cut back to the context afterwards, as for a chain.
    fn tree_recurrent(
        &mut self,
        head: &Arc<dyn RecurrentHead>,
        context: &[u32],
        max_depth: usize,
        limits: TreeLimits,
    ) -> Result<Draft> {
        let (target_hidden, start) = self.take_pending(context.len())?;
        let n = target_hidden.dim(0)?;
        let out = head.extend(&mut self.caches, &target_hidden, &context[start + 1..start + 1 + n], start)?; // [n, hidden]
        self.fed = start + n;
        let cache_lens: Vec<usize> = self.caches.iter().map(KvCache::len).collect();
        let tree = self.grow_recurrent_tree(head, out.narrow(0, n - 1, 1)?, max_depth, limits, &cache_lens);
        // Rows written while drafting came from the head's own guesses: drop them, even on error.
        for (cache, &len) in self.caches.iter_mut().zip(&cache_lens) {
            cache.truncate(len);
        }
        let tree = tree?;
        Ok(tree.draft(&tree.select()))
    }

    fn grow_recurrent_tree(
        &mut self,
        head: &Arc<dyn RecurrentHead>,
        root_hidden: Tensor, // [1, hidden]
        max_depth: usize,
        limits: TreeLimits,
        cache_lens: &[usize],
    ) -> Result<DynamicTree> {
        let mut tree = DynamicTree::new(max_depth, limits);
        let root_logits = self.logit_rows(&head.logits(&root_hidden, 0)?)?;
        tree.add_children(self.sampler()?, -1, &root_logits[0]);
        // The last depth's outputs `[m, hidden]`, and each expanded node's row in them.
        let mut outputs = root_hidden;
        let mut output_row: Vec<usize> = Vec::new();
        // Each expanded node's row in its step's cache.
        let mut cache_row: Vec<usize> = Vec::new();
        for depth in 0.. {
            let frontier = tree.frontier(depth);
            if frontier.is_empty() {
                break;
            }
            // As in a chain, draft step `depth + 1` feeds a depth-`depth` token at position
            // fed + depth.
            let step = depth + 1;
            let layer = head.step_cache(step);
            if self.caches[layer].len() + frontier.len() > self.caches[layer].max_len() {
                break; // near the end of the context: a shallower tree, not an error
            }
            let parent_rows = parent_rows(&tree, &frontier, &output_row);
            let hidden = outputs.index_select(&Tensor::new(parent_rows.as_slice(), outputs.device())?, 0)?; // [m, hidden]
            let tokens: Vec<u32> = frontier.iter().map(|&x| tree.nodes[x].token_id).collect();
            // A node's ancestors were all expanded; those whose step used this cache are the rows
            // a chain run of the path would have put there.
            let ancestors: Vec<Vec<usize>> = frontier
                .iter()
                .map(|&x| {
                    let path = tree.path(x);
                    path[..path.len() - 1]
                        .iter()
                        .filter(|&&a| head.step_cache(tree.nodes[a].depth + 1) == layer)
                        .map(|&a| cache_row[a])
                        .collect()
                })
                .collect();
            let positions = vec![self.fed + depth; frontier.len()];
            let first_row = self.caches[layer].len();
            let rows = TreeRows { context: cache_lens[layer], positions: &positions, ancestors: &ancestors };
            outputs = head.step_tree(&mut self.caches, &hidden, &tokens, step, &rows)?; // [m, hidden]
            output_row.resize(tree.nodes.len(), 0);
            cache_row.resize(tree.nodes.len(), usize::MAX);
            for (i, &x) in frontier.iter().enumerate() {
                output_row[x] = i;
                cache_row[x] = first_row + i;
            }
            let logits = self.logit_rows(&head.logits(&outputs, step)?)?;
            let sampler = self.sampler()?;
            for (&x, row) in frontier.iter().zip(&logits) {
                tree.add_children(sampler, x as i32, row);
            }
        }
        Ok(tree)
    }

    /// EAGLE-2's tree with a parallel head: sub-head i expands the depth-(i - 1) frontier, each
    /// node from its parent's output state and its own token (Medusa's sub-heads read neither,
    /// so every node of a depth gets the same children: Medusa's own trees), at most
    /// `num_heads` deep.
    fn tree_parallel(
        &mut self,
        head: &Arc<dyn ParallelHead>,
        context: &[u32],
        max_depth: usize,
        limits: TreeLimits,
    ) -> Result<Draft> {
        let (target_hidden, start) = self.take_pending(context.len())?;
        self.fed = start + target_hidden.dim(0)?;
        let state = target_hidden.narrow(0, target_hidden.dim(0)? - 1, 1)?; // [1, width]
        let mut tree = DynamicTree::new(max_depth.min(head.num_heads()), limits);
        let (logits, mut outputs) = head.step_rows(0, &state, &context[context.len() - 1..])?;
        let root_logits = self.logit_rows(&logits)?;
        tree.add_children(self.sampler()?, -1, &root_logits[0]);
        // Each expanded node's row in `outputs` (the root's: 0).
        let mut output_row: Vec<usize> = Vec::new();
        for depth in 0.. {
            let frontier = tree.frontier(depth);
            if frontier.is_empty() {
                break;
            }
            let parent_rows = parent_rows(&tree, &frontier, &output_row);
            let states = outputs.index_select(&Tensor::new(parent_rows.as_slice(), outputs.device())?, 0)?; // [m, width]
            let tokens: Vec<u32> = frontier.iter().map(|&x| tree.nodes[x].token_id).collect();
            let (logits, next) = head.step_rows(depth + 1, &states, &tokens)?;
            outputs = next;
            output_row.resize(tree.nodes.len(), 0);
            frontier.iter().enumerate().for_each(|(i, &x)| output_row[x] = i);
            let logits = self.logit_rows(&logits)?;
            let sampler = self.sampler()?;
            for (&x, row) in frontier.iter().zip(&logits) {
                tree.add_children(sampler, x as i32, row);
            }
        }
        Ok(tree.draft(&tree.select()))
    }

    /// A block head's output rows `[block_len, hidden]` for the positions after `context`, once
    /// it has read the pending context rows.
    fn block_rows(&mut self, head: &Arc<dyn BlockHead>, context: &[u32]) -> Result<Tensor> {
        let (target_hidden, start) = self.take_pending(context.len())?;
        head.extend(&mut self.caches, &target_hidden, start)?;
        self.fed = start + target_hidden.dim(0)?;
        head.block(&self.caches, context[context.len() - 1], context.len() - 1)
    }

    /// A chain from one block: token i drawn from row i (after token i - 1, for a Markov head),
    /// for as long as the drafts are confident against `draft_confidence_threshold`: by the
    /// sampler's q (the token below it is kept, the draft ends after it), or with a confidence head
    /// by DSpark's rule (the leading rows whose running product of confidences reaches it, at
    /// least one).
    fn draft_block(&mut self, head: &Arc<dyn BlockHead>, context: &[u32], max_tokens: usize) -> Result<Draft> {
        let rows = self.block_rows(head, context)?; // [block_len, hidden]
        let n = rows.dim(0)?.min(max_tokens);
        let anchor = context[context.len() - 1];
        // Without a Markov head every row's logits are known at once: one LM head pass.
        let all_logits = if head.reads_previous() {
            None
        } else {
            Some(self.logit_rows(&head.logits(&rows.narrow(0, 0, n)?, &vec![anchor; n])?)?)
        };
        let threshold = self.drawing.confidence_threshold;
        let mut running_confidence = 1.0f32;
        let mut draft = DraftBuilder::after(context.len());
        let mut previous = anchor;
        for i in 0..n {
            let row = rows.narrow(0, i, 1)?;
            let logits = match &all_logits {
                Some(all) => all[i].clone(),
                None => self.logit_rows(&head.logits(&row, &[previous])?)?.remove(0),
            };
            let confidence = head.confidence(&row, &[previous])?;
            let mut last = false;
            if let Some(confidence) = &confidence {
                running_confidence *= confidence[0];
                if threshold > 0.0 && running_confidence < threshold {
                    if draft.len() > 0 {
                        break;
                    }
                    last = true; // DSpark always drafts one token
                }
            }
            let sampler =
                self.sampler.as_mut().ok_or_else(|| Error::Internal("head proposer used before begin()".into()))?;
            let mut token = sampler.draw(&logits, draft.next_position());
            if confidence.is_some() {
                token.confident = !last;
            }
            previous = token.token_id;
            if !draft.push(token) {
                break;
            }
        }
        Ok(draft.build())
    }

    /// EAGLE-2's tree from one block: every node of depth d gets its children from row d + 1 (the
    /// root's from row 0), as Medusa's heads give every node of a depth the same children; with a
    /// Markov head each node's row is read after the node's own token.
    fn tree_block(
        &mut self,
        head: &Arc<dyn BlockHead>,
        context: &[u32],
        max_depth: usize,
        limits: TreeLimits,
    ) -> Result<Draft> {
        let rows = self.block_rows(head, context)?; // [block_len, hidden]
        let block_len = rows.dim(0)?;
        let anchor = context[context.len() - 1];
        let mut tree = DynamicTree::new(max_depth.min(block_len), limits);
        let root = self.logit_rows(&head.logits(&rows.narrow(0, 0, 1)?, &[anchor])?)?;
        tree.add_children(self.sampler()?, -1, &root[0]);
        for depth in 1..block_len {
            let frontier = tree.frontier(depth - 1);
            if frontier.is_empty() {
                break;
            }
            let row = rows.narrow(0, depth, 1)?;
            let logits = if head.reads_previous() {
                let previous: Vec<u32> = frontier.iter().map(|&x| tree.nodes[x].token_id).collect();
                let repeated = row.broadcast_as((frontier.len(), row.dim(1)?))?.contiguous()?;
                self.logit_rows(&head.logits(&repeated, &previous)?)?
            } else {
                let one = self.logit_rows(&head.logits(&row, &[anchor])?)?.remove(0);
                vec![one; frontier.len()]
            };
            let sampler = self.sampler()?;
            for (&x, row) in frontier.iter().zip(&logits) {
                tree.add_children(sampler, x as i32, row);
            }
        }
        Ok(tree.draft(&tree.select()))
    }

    fn draft_parallel(&mut self, head: &Arc<dyn ParallelHead>, context: &[u32], max_tokens: usize) -> Result<Draft> {
        let (target_hidden, start) = self.take_pending(context.len())?;
        self.fed = start + target_hidden.dim(0)?;
        // The hidden state of the newest token's predecessor: it predicted the newest token.
        let mut state = target_hidden.narrow(0, target_hidden.dim(0)? - 1, 1)?;
        let mut token = context[context.len() - 1];
        let mut draft = DraftBuilder::after(context.len());
        for i in 0..max_tokens.min(head.num_heads()) {
            let (logits, next_state) = head.step(i, &state, token)?;
            let confident = draft.push(self.draw(&logits, draft.next_position())?);
            token = draft.last();
            state = next_state;
            if !confident {
                break;
            }
        }
        Ok(draft.build())
    }
}

impl Proposer for HeadProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        self.sampler = Some(DraftSampler::new(params, self.target_vocab, self.target_vocab, self.drawing));
        let capacity = prompt.len() + params.max_tokens;
        self.caches = match &self.head {
            Head::Recurrent(head) => head.new_caches(capacity, &self.kv_bytes)?,
            Head::Block(head) => head.new_caches(capacity, &self.kv_bytes)?,
            Head::Parallel(_) => Vec::new(),
        };
        self.fed = 0;
        self.pending.clear();
        self.pending_rows = 0;
        Ok(())
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if max_tokens == 0 {
            return Ok(Draft::default());
        }
        match self.head.clone() {
            Head::Recurrent(head) => self.draft_recurrent(&head, context, max_tokens),
            Head::Parallel(head) => self.draft_parallel(&head, context, max_tokens),
            Head::Block(head) => self.draft_block(&head, context, max_tokens),
        }
    }

    fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
        if max_depth == 0 || limits.max_nodes == 0 || limits.max_children == 0 {
            return Ok(Draft::default());
        }
        match self.head.clone() {
            Head::Recurrent(head) if head.drafts_trees() => self.tree_recurrent(&head, context, max_depth, limits),
            Head::Recurrent(_) => self.propose(context, max_depth.min(limits.max_nodes)),
            Head::Parallel(head) => self.tree_parallel(&head, context, max_depth, limits),
            Head::Block(head) => self.tree_block(&head, context, max_depth, limits),
        }
    }

    fn taps(&self) -> Vec<Tap> {
        self.head.taps()
    }

    fn context_row_share(&self) -> f64 {
        match &self.head {
            Head::Recurrent(head) => head.context_row_share(),
            Head::Block(head) => head.context_row_share(),
            Head::Parallel(_) => 1.0, // keeps no context rows (`kv_len` is None)
        }
    }

    fn target_context_dropped(&mut self) {
        // Its own caches follow the target's hidden rows position by position: refed from 0 too.
        for cache in &mut self.caches {
            cache.truncate(0);
        }
        self.fed = 0;
        self.pending.clear();
        self.pending_rows = 0;
    }

    fn observe_hidden(&mut self, start: usize, hidden: &[Tensor]) -> Result<()> {
        if start != self.fed + self.pending_rows {
            return Err(self.internal(&format!(
                "was handed target hidden states from position {start}, but expected {}",
                self.fed + self.pending_rows
            )));
        }
        let rows = if hidden.len() == 1 { hidden[0].clone() } else { Tensor::cat(hidden, 1)? }; // [n, taps width]
        let n = rows.dim(0)?;
        if let Head::Parallel(_) = self.head {
            // Only the newest row is ever read.
            self.fed += self.pending_rows + n - 1;
            self.pending = vec![rows.narrow(0, n - 1, 1)?];
            self.pending_rows = 1;
            return Ok(());
        }
        self.pending.push(rows);
        self.pending_rows += n;
        Ok(())
    }

    fn finish(&mut self, _generated: &[u32]) {
        self.caches.clear();
        self.pending.clear();
    }

    fn kv_len(&self) -> Option<usize> {
        self.caches.first().map(KvCache::len)
    }
}

/// `[frontier.len()]` each frontier node's parent's row in the previous tree step's outputs
/// (`output_row`, by node), 0 for the root's single row.
fn parent_rows(tree: &DynamicTree, frontier: &[usize], output_row: &[usize]) -> Vec<u32> {
    frontier
        .iter()
        .map(|&x| match tree.nodes[x].parent {
            -1 => 0,
            p => output_row[p as usize] as u32,
        })
        .collect()
}

/// Embedding rows `[tokens.len(), hidden]` f32 from the head's own table, or the target's.
pub(crate) fn embed_rows(own: Option<&Tensor>, target: &dyn CausalLm, tokens: &[u32]) -> Result<Tensor> {
    match own {
        Some(table) => Ok(table.index_select(&Tensor::new(tokens, table.device())?, 0)?),
        None => Ok(target.embed(tokens)?.to_dtype(DType::F32)?),
    }
}

/// Logits `[n, vocab]` f32 of `normed` `[n, hidden]` from the head's own LM head, or the target's.
pub(crate) fn lm_head_logits(own: Option<&Linear>, target: &dyn CausalLm, normed: &Tensor) -> Result<Tensor> {
    match own {
        Some(head) => head.forward(normed),
        None => Ok(target.lm_head(normed, None)?.to_dtype(DType::F32)?),
    }
}

/// RMSNorm over the last dimension.
pub(crate) fn rms(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps)?)
}

/// Scatters draft-vocabulary logits `[n, draft_vocab]` into target-vocabulary rows
/// `[n, target_vocab]` through `draft_to_target` (`[draft_vocab]` u32 target ids), -inf elsewhere.
pub(crate) fn scatter_vocab(
    logits: &Tensor,
    draft_to_target: &Tensor,
    target_vocab: usize,
    device: &Device,
) -> Result<Tensor> {
    let n = logits.dim(0)?;
    let full = Tensor::full(f32::NEG_INFINITY, (n, target_vocab), device)?;
    let index = draft_to_target.unsqueeze(0)?.repeat((n, 1))?.contiguous()?;
    Ok(full.scatter(&index, &logits.contiguous()?, 1)?)
}
