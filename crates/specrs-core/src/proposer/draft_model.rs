//! The classic draft model (`"method": "draft_model"`, also used by `quantized_self`): a smaller
//! or cheaper model with the target's tokenizer drafts k tokens autoregressively, each drawn from
//! its own distribution q after the request's sampling settings; or, when a token tree is asked
//! for, EAGLE-2's dynamic tree (`DynamicTree`) over its own top-k tokens, one draft forward per
//! depth.
//!
//! Also home to the pieces the other model-based drafts share: `DraftSampler` (logits -> a draft
//! token, its q row and its confidence; or a node's top-k children), `DraftCache` (the draft
//! model's KV cache and the tokens it holds) and `DynamicTree` (the EAGLE-2 tree search the
//! hidden-state heads run too).
//!
//! A sampled chain is drawn in one of two ways (`DraftDrawing::verification`, the config's
//! "verification"; "auto" couples seeded requests): coupled, each token by inverse CDF over q
//! with the uniform the target samples that output position with (`Sampler::uniform_at` under
//! the request's seed), and verified without q, so the output is plain sampling's token for
//! token; or from the draft's own random stream, with q rows for rejection sampling.
//!
//! Tree drafts are deterministic (no q rows, for greedy and sampled requests alike): the verifier
//! then draws the target's token from p and accepts the child equal to it, which is exact for any
//! fixed tree, so the children can be chosen by value (the most likely ones).
//!
//! Invariant: after `observe`, the draft cache holds at most the context plus the accepted draft
//! tokens, the same prefix the target keeps (for a tree: the accepted path's rows, moved into
//! place with `KvCache::keep`); the next `propose` feeds only what the draft has not seen. A
//! request longer than the draft's `max_model_len` gets no drafts past that length (as in vLLM);
//! the metrics show it as steps without drafts.

use std::cmp::Ordering;
use std::sync::Arc;

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::{CausalLm, ForwardBatch, LogitRows, SeqRows};
use crate::proposer::{Draft, Feedback, Proposer, TreeLimits};
use crate::sampler::{argmax, draw_with, probabilities, Sampler};
use crate::spec_config::Verification;

/// Mixed into the request seed so the draft's random stream differs from the verifier's.
const DRAFT_SEED_SALT: u64 = 0x5eed_d4af_7000_0001;

/// How a model-based proposer draws its sampled chain tokens, from the speculative config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftDrawing {
    /// A chain stops after a token whose q is below this (0: off).
    pub confidence_threshold: f32,
    /// Coupled: draw with the target's positional uniforms and leave q out; rejection: draw
    /// from the draft's own stream and keep q; auto: coupled when the request has a seed.
    pub verification: Verification,
}

impl DraftDrawing {
    /// Coupled, no confidence threshold: what the engine's own greedy drafts (cost measuring,
    /// `head_draft`) and the tests use.
    pub const COUPLED: Self = Self { confidence_threshold: 0.0, verification: Verification::Coupled };
}

/// Turns draft logits into a draft token and its q row.
#[derive(Clone)]
pub(crate) struct DraftSampler {
    params: SamplingParams,
    /// The draft's own stream (rejection sampling), salted so it differs from the verifier's.
    sampler: Sampler,
    /// Coupled drawing: the request's own sampler (its seed), whose positional uniforms the
    /// verifier draws the target's tokens with.
    coupled_to: Option<Sampler>,
    /// Size of the target's vocabulary: the width of every q row.
    target_vocab: usize,
    /// Draft ids at or above this are never drafted (padded draft embeddings, or a draft
    /// vocabulary larger than the target's).
    usable_vocab: usize,
    confidence_threshold: f32,
}

/// One drafted token.
pub(crate) struct DraftedToken {
    pub token_id: u32,
    /// `[target_vocab]` q row; None for greedy requests (q is one-hot on the argmax).
    pub probs: Option<Vec<f32>>,
    /// False when the draft's probability of this token is below the confidence threshold: the
    /// token is kept and drafting stops after it (transformers' `assistant_confidence_threshold`).
    pub confident: bool,
}

impl DraftSampler {
    /// `params.seed`: the seed the request's verifier samples with, which a coupled draft draws
    /// with; None for an unseeded request under "auto" (it draws from its own stream: rejection).
    /// The session passes an unseeded request's drawn seed where the config says "coupled".
    pub fn new(params: &SamplingParams, draft_vocab: usize, target_vocab: usize, drawing: DraftDrawing) -> Self {
        let coupled = drawing.verification.couples(params.seed.is_some());
        Self {
            params: params.clone(),
            sampler: Sampler::new(params.seed.map(|s| s ^ DRAFT_SEED_SALT)),
            coupled_to: coupled.then(|| Sampler::new(params.seed)),
            target_vocab,
            usable_vocab: draft_vocab.min(target_vocab),
            confidence_threshold: drawing.confidence_threshold,
        }
    }

    /// `logits`: `[draft_vocab]` for the token emitted at output `position` (its index in prompt +
    /// output).
    pub fn draw(&mut self, logits: &[f32], position: usize) -> DraftedToken {
        let logits = &logits[..self.usable_vocab];
        if self.params.is_greedy() {
            let token_id = argmax(logits);
            let confident = self.confidence_threshold <= 0.0 || {
                // softmax(logits)[argmax] = 1 / sum(exp(l - l_max))
                let max = logits[token_id as usize];
                let total: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
                1.0 / total >= self.confidence_threshold
            };
            return DraftedToken { token_id, probs: None, confident };
        }
        let mut q = probabilities(logits, &self.params);
        let token_id = match &self.coupled_to {
            // The target's token at this position is draw_with(p, the same uniform): the two
            // agree wherever q's and p's cumulative sums put this uniform in the same token.
            Some(target) => draw_with(&q, target.uniform_at(position)),
            None => self.sampler.draw(&q),
        };
        let confident = q[token_id as usize] >= self.confidence_threshold;
        // A coupled draft is verified without q (one-hot in coupled form).
        let probs = self.coupled_to.is_none().then(|| {
            q.resize(self.target_vocab, 0.0);
            q
        });
        DraftedToken { token_id, probs, confident }
    }

    /// A deterministic tree node's children from its `logits` (`[draft_vocab]`): the `k` most
    /// likely tokens under the request's settings, best first (ties: the lower id), each with
    /// its log q and whether q reaches the confidence threshold (a node below it gets no
    /// children, as a chain stops after such a token). Tokens with q = 0 are left out, so a node
    /// may get fewer than `k`. A greedy request ranks by the logits (q = softmax at temperature
    /// 1), so its rank 0 is the token `draw` picks; a sampled one by q after temperature / top-k
    /// / top-p, the distribution `draw` samples from.
    pub fn top_k(&self, logits: &[f32], k: usize) -> Vec<TreeChild> {
        let logits = &logits[..self.usable_vocab];
        if self.params.is_greedy() {
            let best = best_k(logits, k, |l| l == f32::NEG_INFINITY);
            let Some(&first) = best.first() else { return Vec::new() };
            // log softmax(l) = l - max - ln(sum(exp(l - max))), the max being the rank-0 logit.
            let max = logits[first as usize];
            let log_total = logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
            return best.into_iter().map(|t| self.child(t, logits[t as usize] - max - log_total)).collect();
        }
        let q = probabilities(logits, &self.params);
        best_k(&q, k, |p| p <= 0.0).into_iter().map(|t| self.child(t, q[t as usize].ln())).collect()
    }

    fn child(&self, token_id: u32, log_q: f32) -> TreeChild {
        TreeChild { token_id, log_q, confident: log_q.exp() >= self.confidence_threshold }
    }
}

/// One child of a tree node (`DraftSampler::top_k`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TreeChild {
    pub token_id: u32,
    /// ln q(token) under the node's distribution.
    pub log_q: f32,
    /// q reaches the confidence threshold: the child may get children of its own.
    pub confident: bool,
}

/// Indices of the `k` largest `values`, largest first, ties to the lower index (as `argmax`);
/// values for which `skip` holds (and NaN) are never picked. One pass, O(vocab * k) at worst.
fn best_k(values: &[f32], k: usize, skip: impl Fn(f32) -> bool) -> Vec<u32> {
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    if k == 0 {
        return best;
    }
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() || skip(v) || (best.len() == k && v <= values[best[k - 1] as usize]) {
            continue;
        }
        // After every kept value at least as large: an equal value keeps the lower index first.
        let at = best.partition_point(|&b| values[b as usize] >= v);
        best.insert(at, i as u32);
        best.truncate(k);
    }
    best
}

/// One candidate of a dynamic draft tree.
#[derive(Debug, Clone)]
pub(crate) struct TreeNode {
    pub token_id: u32,
    /// The parent candidate's index, -1 for the root (the newest context token).
    pub parent: i32,
    /// 0 for a child of the root.
    pub depth: usize,
    /// Rank among its parent's children (0: the most likely).
    pub rank: usize,
    /// Sum of ln q along the path from the root: the draft's estimate of ln P(the text follows
    /// this path).
    pub score: f64,
    /// Whether it may get children (its q reached the confidence threshold).
    pub expandable: bool,
}

/// EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858), independent of the model
/// that scores it: the root's children are its top `max_children` tokens; at each depth the
/// `max_children` best nodes of that depth by cumulative log q (the frontier) are expanded, each
/// into its top `max_children` tokens (the caller runs the model over the frontier, one batched
/// step per depth); finally every candidate is reranked by cumulative log q and the best
/// `max_nodes` are kept.
///
/// Invariant: the kept set is closed under parents and keeps sibling prefixes (a node is kept
/// only when its parent and its better siblings are), so it is a tree of the top-k children. The
/// order "score descending, then depth, then creation" guarantees it on its own: a child's score
/// is its parent's plus ln q <= 0 (rounding is monotone, so never above the parent's) and
/// siblings are created best first; `select` checks it anyway.
pub(crate) struct DynamicTree {
    pub nodes: Vec<TreeNode>,
    max_depth: usize,
    limits: TreeLimits,
}

impl DynamicTree {
    pub fn new(max_depth: usize, limits: TreeLimits) -> Self {
        Self { nodes: Vec::new(), max_depth, limits }
    }

    /// Adds the children of `parent` (-1: the root) from the logits `[draft_vocab]` of its
    /// distribution.
    pub fn add_children(&mut self, sampler: &DraftSampler, parent: i32, logits: &[f32]) {
        let (depth, base) = match parent {
            -1 => (0, 0.0),
            p => (self.nodes[p as usize].depth + 1, self.nodes[p as usize].score),
        };
        for (rank, child) in sampler.top_k(logits, self.limits.max_children).into_iter().enumerate() {
            self.nodes.push(TreeNode {
                token_id: child.token_id,
                parent,
                depth,
                rank,
                score: base + f64::from(child.log_q),
                expandable: child.confident,
            });
        }
    }

    /// The rank order of nodes `a` and `b` (see the type's invariant): a total order.
    fn order(&self, a: usize, b: usize) -> Ordering {
        let (x, y) = (&self.nodes[a], &self.nodes[b]);
        y.score.total_cmp(&x.score).then(x.depth.cmp(&y.depth)).then(a.cmp(&b))
    }

    /// The nodes of `depth` to expand next, best first: the `max_children` best that may get
    /// children, none when their children would be deeper than `max_depth`. A node with
    /// `max_nodes - 1` nodes or more ranked before it is skipped: its children rank after it and
    /// after all of those, so none could be kept (and the nodes that take its place in the
    /// frontier rank after them too), which saves steps without changing the kept tree.
    pub fn frontier(&self, depth: usize) -> Vec<usize> {
        if depth + 1 >= self.max_depth {
            return Vec::new();
        }
        self.ranked()
            .into_iter()
            .take(self.limits.max_nodes.saturating_sub(1))
            .filter(|&x| self.nodes[x].depth == depth && self.nodes[x].expandable)
            .take(self.limits.max_children)
            .collect()
    }

    /// Every node, best first.
    fn ranked(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.nodes.len()).collect();
        order.sort_unstable_by(|&a, &b| self.order(a, b));
        order
    }

    /// The nodes from the root's child to `node`, `node` last.
    pub fn path(&self, node: usize) -> Vec<usize> {
        let mut path = vec![node];
        let mut at = self.nodes[node].parent;
        while at >= 0 {
            path.push(at as usize);
            at = self.nodes[at as usize].parent;
        }
        path.reverse();
        path
    }

    /// The child of `parent` (-1: the root) holding `token`, if drafted (siblings differ).
    pub fn child(&self, parent: i32, token: u32) -> Option<usize> {
        self.nodes.iter().position(|n| n.parent == parent && n.token_id == token)
    }

    /// The kept nodes, best first (parents before children, siblings best first): the
    /// `max_nodes` best by cumulative log q.
    pub fn select(&self) -> Vec<usize> {
        // Per slot (0: the root, x + 1: node x) how many of its children are kept; None: not kept.
        let mut kept_children: Vec<Option<usize>> = vec![None; self.nodes.len() + 1];
        kept_children[0] = Some(0);
        let mut kept = Vec::new();
        for x in self.ranked() {
            if kept.len() == self.limits.max_nodes {
                break;
            }
            let slot = (self.nodes[x].parent + 1) as usize;
            if kept_children[slot] == Some(self.nodes[x].rank) {
                kept_children[slot] = Some(self.nodes[x].rank + 1);
                kept_children[x + 1] = Some(0);
                kept.push(x);
            }
        }
        kept
    }

    /// The deterministic tree draft of the `kept` nodes (in `select`'s order).
    pub fn draft(&self, kept: &[usize]) -> Draft {
        let mut index = vec![-1i32; self.nodes.len()];
        kept.iter().enumerate().for_each(|(i, &x)| index[x] = i as i32);
        let parents =
            kept.iter().map(|&x| if self.nodes[x].parent < 0 { -1 } else { index[self.nodes[x].parent as usize] });
        Draft::tree(kept.iter().map(|&x| self.nodes[x].token_id).collect(), parents.collect())
    }
}

/// Collects drafted tokens into a `Draft`.
pub(crate) struct DraftBuilder {
    /// The output position of the first token: the context's length.
    start: usize,
    token_ids: Vec<u32>,
    probs: Vec<f32>,
    has_probs: bool,
}

impl DraftBuilder {
    /// A chain drafted after a context of `context_len` tokens.
    pub fn after(context_len: usize) -> Self {
        Self { start: context_len, token_ids: Vec::new(), probs: Vec::new(), has_probs: false }
    }

    /// The length of the context the chain follows: its first token's output position.
    pub fn context_len(&self) -> usize {
        self.start
    }

    /// The output position the next token is emitted at (`DraftSampler::draw`'s `position`).
    pub fn next_position(&self) -> usize {
        self.start + self.token_ids.len()
    }

    /// Adds a token; returns whether drafting may continue (it was confident).
    pub fn push(&mut self, token: DraftedToken) -> bool {
        self.token_ids.push(token.token_id);
        if let Some(q) = token.probs {
            self.has_probs = true;
            self.probs.extend_from_slice(&q);
        }
        token.confident
    }

    /// The newest token (call after a push).
    pub fn last(&self) -> u32 {
        self.token_ids[self.token_ids.len() - 1]
    }

    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    pub fn build(self) -> Draft {
        Draft { token_ids: self.token_ids, probs: self.has_probs.then_some(self.probs), parents: None }
    }
}

/// A draft model's KV cache and the tokens it holds, rolled back with the target's.
pub(crate) struct DraftCache {
    pub model: Arc<dyn CausalLm>,
    cache: Option<KvCache>,
    /// `cache.len()` tokens: what the cache holds.
    cached_ids: Vec<u32>,
    max_model_len: usize,
    kv_bytes: Arc<KvBytes>,
    /// Context length at the last propose; `observe` keeps this many plus the accepted tokens.
    proposed_at: usize,
}

impl DraftCache {
    pub fn new(model: Arc<dyn CausalLm>, max_model_len: Option<usize>, kv_bytes: Arc<KvBytes>) -> Self {
        let context = model.info().context_length;
        Self {
            model,
            cache: None,
            cached_ids: Vec::new(),
            max_model_len: max_model_len.unwrap_or(context).min(context),
            kv_bytes,
            proposed_at: 0,
        }
    }

    /// Allocates the cache for a request that may reach `max_len` tokens. The prompt is not
    /// prefilled here: the first propose feeds everything the draft has not seen (`catch_up`), so a
    /// request whose draft length policy never drafts never pays for the draft's prefill.
    pub fn begin(&mut self, max_len: usize) -> Result<()> {
        // The model's own cache kind (host for cpu/decoder.rs, device for candle/decoder.rs, which runs
        // drafts on CUDA); `fits` keeps it within max_model_len.
        let cache = self.model.new_cache(max_len.min(self.max_model_len))?;
        self.cache = Some(cache.tracked_by(self.kv_bytes.clone()));
        self.cached_ids.clear();
        Ok(())
    }

    /// Whether the draft can hold `len` positions.
    pub fn fits(&self, len: usize) -> bool {
        len <= self.max_model_len
    }

    /// Rolls back to the longest prefix shared with `context`, keeping the last context token
    /// unseen so the next forward has something to consume; returns where the unseen part of
    /// `context` starts.
    pub fn catch_up(&mut self, context: &[u32]) -> usize {
        let shared = self.cached_ids.iter().zip(context).take_while(|(a, b)| a == b).count();
        let keep = shared.min(context.len().saturating_sub(1));
        self.truncate(keep);
        self.proposed_at = context.len();
        keep
    }

    /// One draft forward over `token_ids`: logits `[rows, draft_vocab]`, row-major. A draft whose
    /// vocabulary is a prefix of the target's cannot read the target's extra tokens (ids past its
    /// own embedding): it reads token 0 in their place, which can only make its guesses worse,
    /// never the output, since every guess is verified. `cached_ids` keeps the real ids.
    pub fn forward(&mut self, token_ids: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        let cache = self.cache.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let logits = self.model.forward_rows(&readable(token_ids, self.model.info().vocab_size), cache, rows)?;
        self.cached_ids.extend_from_slice(token_ids);
        Ok(logits.flatten_all()?.to_vec1()?)
    }

    /// `forward(feeds[i], LogitRows::Last)` of every cache in `caches` (all of one draft model)
    /// as one forward, which reads the model's weights once for all of them: each cache's
    /// last-row logits `[draft_vocab]`, in order. A row's logits do not depend on the other
    /// sequences of a forward (model/forward.rs), so each equals its forward alone.
    pub fn forward_together(caches: &mut [&mut DraftCache], feeds: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let Some(first) = caches.first() else { return Ok(Vec::new()) };
        let model = first.model.clone();
        let vocab = model.info().vocab_size;
        let rows: Vec<SeqRows> =
            feeds.iter().map(|feed| SeqRows::chain(readable(feed, vocab), LogitRows::Last)).collect();
        let mut kv: Vec<&mut KvCache> = caches
            .iter_mut()
            .map(|c| c.cache.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into())))
            .collect::<Result<_>>()?;
        let lens: Vec<usize> = kv.iter().map(|cache| cache.len()).collect();
        let logits = model.forward_batch(&ForwardBatch::new(&rows, &lens, Vec::new())?, &mut kv)?.logits;
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?; // [caches, draft_vocab]
        for (cache, feed) in caches.iter_mut().zip(feeds) {
            cache.cached_ids.extend_from_slice(feed);
        }
        Ok(logits.chunks(vocab).map(<[f32]>::to_vec).collect())
    }

    /// One draft forward over token-tree rows after the cache (`SeqRows::tree`: each row sees the
    /// cache and its own ancestors among `tokens`): logits `[logit_rows.len(), draft_vocab]`,
    /// row-major. The rows are not tokens of one text, so `cached_ids` does not cover them: until
    /// `keep_path` (or a truncation) the cache holds `cached_ids` plus these rows.
    pub fn forward_tree(&mut self, tokens: &[u32], parents: Vec<i32>, logit_rows: Vec<usize>) -> Result<Vec<f32>> {
        let cache = self.cache.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let rows = SeqRows { tokens: readable(tokens, self.model.info().vocab_size), parents, logit_rows };
        let batch = ForwardBatch::new(&[rows], &[cache.len()], Vec::new())?;
        let logits = self.model.forward_batch(&batch, &mut [cache])?.logits;
        Ok(logits.flatten_all()?.to_vec1()?)
    }

    /// Keeps the first `start` positions and the tree rows at `offsets` past them (a path, in row
    /// order), whose tokens are `tokens`.
    pub fn keep_path(&mut self, start: usize, offsets: &[usize], tokens: &[u32]) -> Result<()> {
        if let Some(cache) = self.cache.as_mut() {
            cache.keep(start, offsets)?;
        }
        self.cached_ids.truncate(start);
        self.cached_ids.extend_from_slice(tokens);
        Ok(())
    }

    /// Drops positions past `len` (tokens a later forward appended and that must not stay).
    pub fn truncate(&mut self, len: usize) {
        if let Some(cache) = self.cache.as_mut() {
            cache.truncate(len.min(cache.len()));
        }
        self.cached_ids.truncate(len);
    }

    pub fn observe(&mut self, num_accepted: usize) {
        self.truncate(self.proposed_at + num_accepted);
    }

    pub fn len(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::len)
    }

    /// Frees the cache at the end of a request.
    pub fn release(&mut self) {
        self.cache = None;
        self.cached_ids.clear();
    }
}

/// `tokens` as a draft with `vocab` embeddings reads them: ids past its vocabulary as token 0
/// (`DraftCache::forward`).
fn readable(tokens: &[u32], vocab: usize) -> Vec<u32> {
    tokens.iter().map(|&t| if (t as usize) < vocab { t } else { 0 }).collect()
}

pub struct DraftModelProposer {
    pub(crate) cache: DraftCache,
    target_vocab: usize,
    drawing: DraftDrawing,
    sampler: Option<DraftSampler>,
    /// The last tree drafted, while its rows are in the cache (until `observe`).
    tree: Option<HeldTree>,
    /// A chain drafted ahead of `propose`, together with other requests' (`chains_together.rs`).
    ahead: Option<AheadChain>,
}

/// A chain drafted ahead of the `propose(context, max_tokens)` it is for: that call returns it;
/// any other call undoes it first (the sampler as before it; the cache catches up as usual), so
/// every draft is the one this request would have drafted alone.
struct AheadChain {
    max_tokens: usize,
    /// Knows the context length it was drafted after (`DraftBuilder::context_len`).
    draft: DraftBuilder,
    /// Still drawing (the chain is not at its length and its last token was confident).
    drawing: bool,
    sampler_before: DraftSampler,
}

/// A drafted tree whose rows the draft cache holds past the context.
struct HeldTree {
    tree: DynamicTree,
    /// Context length: where the tree rows start.
    start: usize,
    /// The tree node of each row past `start`, in row order (parents before children).
    rows: Vec<usize>,
}

impl DraftModelProposer {
    pub fn new(
        draft: Arc<dyn CausalLm>,
        max_model_len: Option<usize>,
        target_vocab: usize,
        drawing: DraftDrawing,
        kv_bytes: Arc<KvBytes>,
    ) -> Self {
        Self {
            cache: DraftCache::new(draft, max_model_len, kv_bytes),
            target_vocab,
            drawing,
            sampler: None,
            tree: None,
            ahead: None,
        }
    }

    /// Starts drafting the chain `propose(context, max_tokens)` would draft, one draw per
    /// `chain_step`: returns the tokens of its first forward (what the draft has not seen of
    /// `context`), or None where `propose` drafts nothing (the draft cannot hold the chain).
    pub(crate) fn begin_chain(&mut self, context: &[u32], max_tokens: usize) -> Option<Vec<u32>> {
        self.undo_chain();
        self.tree = None;
        let sampler = self.sampler.as_ref()?;
        if max_tokens == 0 || !self.cache.fits(context.len() + max_tokens - 1) {
            return None;
        }
        let sampler_before = sampler.clone();
        let unseen = self.cache.catch_up(context);
        let draft = DraftBuilder::after(context.len());
        self.ahead = Some(AheadChain { max_tokens, draft, drawing: true, sampler_before });
        Some(context[unseen..].to_vec())
    }

    /// Draws the chain's next token from `logits` (`[draft_vocab]`, the last forward's last row):
    /// the token to feed next, or None once the chain is complete.
    pub(crate) fn chain_step(&mut self, logits: &[f32]) -> Option<u32> {
        let (ahead, sampler) = (self.ahead.as_mut()?, self.sampler.as_mut()?);
        let position = ahead.draft.next_position();
        ahead.drawing = ahead.draft.push(sampler.draw(logits, position)) && ahead.draft.len() < ahead.max_tokens;
        ahead.drawing.then(|| ahead.draft.last())
    }

    /// Forgets a chain drafted ahead (a failed shared forward, or a `propose` it is not for): the
    /// sampler draws again from where it was; the cache catches up at the next draft.
    pub(crate) fn undo_chain(&mut self) {
        if let Some(ahead) = self.ahead.take() {
            self.sampler = Some(ahead.sampler_before);
        }
    }

    /// The chain drafted ahead for `propose(context, max_tokens)`, if complete and for these
    /// arguments; any other is undone.
    fn chain_ahead(&mut self, context: &[u32], max_tokens: usize) -> Option<Draft> {
        let ahead = self.ahead.as_ref()?;
        if ahead.drawing || ahead.draft.context_len() != context.len() || ahead.max_tokens != max_tokens {
            self.undo_chain();
            return None;
        }
        self.ahead.take().map(|ahead| ahead.draft.build())
    }

    /// EAGLE-2's tree (`DynamicTree`) with the draft model: one forward for the root (the
    /// context's unseen tokens), then one per depth over the frontier. A forward masks only among
    /// its own rows (a row sees everything the cache held before it), so the rows of earlier
    /// depths cannot stay in the cache while the next depth runs: each depth's forward runs the
    /// frontier's paths afresh after the context (at most `max_children * (depth + 1)` rows, with
    /// the same positions and ancestors as a chain run of each path). The last forward's rows stay
    /// for `observe`, which keeps the accepted path's.
    fn draft_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
        let sampler =
            self.sampler.as_ref().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let unseen = self.cache.catch_up(context);
        let root_logits = self.cache.forward(&context[unseen..], LogitRows::Last)?; // [1, draft_vocab]
        let start = self.cache.len();
        let vocab = self.cache.model.info().vocab_size;
        let mut tree = DynamicTree::new(max_depth, limits);
        tree.add_children(sampler, -1, &root_logits);
        let mut rows: Vec<usize> = Vec::new();
        for depth in 0.. {
            let frontier = tree.frontier(depth);
            if frontier.is_empty() {
                break;
            }
            // The frontier's paths, by depth then creation: parents before children, and the
            // frontier (the deepest) last, in creation order.
            let mut on_paths: Vec<usize> = frontier.iter().flat_map(|&x| tree.path(x)).collect();
            on_paths.sort_unstable_by_key(|&x| (tree.nodes[x].depth, x));
            on_paths.dedup();
            if !self.cache.fits(start + on_paths.len()) {
                break;
            }
            let mut row_of = vec![usize::MAX; tree.nodes.len()];
            on_paths.iter().enumerate().for_each(|(row, &x)| row_of[x] = row);
            let tokens: Vec<u32> = on_paths.iter().map(|&x| tree.nodes[x].token_id).collect();
            let parents: Vec<i32> = on_paths
                .iter()
                .map(|&x| match tree.nodes[x].parent {
                    -1 => -1,
                    p => row_of[p as usize] as i32,
                })
                .collect();
            let mut expanded = frontier.clone();
            expanded.sort_unstable_by_key(|&x| row_of[x]);
            let logit_rows: Vec<usize> = expanded.iter().map(|&x| row_of[x]).collect();
            self.cache.truncate(start);
            let logits = self.cache.forward_tree(&tokens, parents, logit_rows)?; // [frontier, draft_vocab]
            for (row, &x) in logits.chunks(vocab).zip(&expanded) {
                tree.add_children(sampler, x as i32, row);
            }
            rows = on_paths;
        }
        let draft = tree.draft(&tree.select());
        self.tree = Some(HeldTree { tree, start, rows });
        Ok(draft)
    }
}

impl Proposer for DraftModelProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        let vocab = self.cache.model.info().vocab_size;
        self.sampler = Some(DraftSampler::new(params, vocab, self.target_vocab, self.drawing));
        self.ahead = None;
        self.cache.begin(prompt.len() + params.max_tokens)
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if let Some(draft) = self.chain_ahead(context, max_tokens) {
            return Ok(draft);
        }
        self.tree = None;
        // The last draft token is never fed, so the draft needs context + max_tokens - 1 positions.
        if max_tokens == 0 || !self.cache.fits(context.len() + max_tokens - 1) {
            return Ok(Draft::default());
        }
        let sampler =
            self.sampler.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let unseen = self.cache.catch_up(context);
        let mut logits = self.cache.forward(&context[unseen..], LogitRows::Last)?; // [1, draft_vocab]
        let mut draft = DraftBuilder::after(context.len());
        while draft.push(sampler.draw(&logits, draft.next_position())) && draft.len() < max_tokens {
            logits = self.cache.forward(&[draft.last()], LogitRows::Last)?;
        }
        Ok(draft.build())
    }

    fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
        self.undo_chain();
        self.tree = None;
        if max_depth == 0 || limits.max_nodes == 0 || limits.max_children == 0 || !self.cache.fits(context.len()) {
            return Ok(Draft::default());
        }
        self.draft_tree(context, max_depth, limits)
    }

    fn observe(&mut self, feedback: &Feedback<'_>) -> Result<()> {
        let Some(held) = self.tree.take() else {
            self.cache.observe(feedback.num_accepted_tokens);
            return Ok(());
        };
        // The accepted tokens are followed down our own tree rather than `accepted_path`, which
        // indexes the draft as verified (the session may have pruned it); siblings differ, so the
        // tokens name the path. Rows held past the context are the paths of the last frontier,
        // so the accepted path's held rows are a prefix of it; the rest is fed at the next draft.
        let (mut parent, mut offsets, mut tokens) = (-1i32, Vec::new(), Vec::new());
        for &token in &feedback.token_ids[..feedback.num_accepted_tokens] {
            let Some(node) = held.tree.child(parent, token) else { break };
            let Some(row) = held.rows.iter().position(|&x| x == node) else { break };
            offsets.push(row);
            tokens.push(token);
            parent = node as i32;
        }
        self.cache.keep_path(held.start, &offsets, &tokens)
    }

    fn model_chain(&mut self, _context: &[u32], max_tokens: usize) -> Result<Option<(&mut DraftModelProposer, usize)>> {
        Ok(Some((self, max_tokens)))
    }

    fn finish(&mut self, _generated: &[u32]) {
        self.tree = None;
        self.ahead = None;
        self.cache.release();
    }

    fn kv_len(&self) -> Option<usize> {
        Some(self.cache.len())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::model::candle::decoder::{Decoder, WeightFormat};
    use crate::model::llama_config::LlamaConfig;

    /// EAGLE-2 by hand: root q = [.5, .3, .15, .05], two children per node. Node A (token 0) has
    /// children C (token 2, .5 * .65) and D (token 1, .5 * .2); B (token 1) has E (token 0,
    /// .3 * .9) and F (token 1, .3 * .06). Best first:
    /// A .5, C .325, B .3, E .27, D .1, F .018.
    #[test]
    fn the_dynamic_tree_expands_the_best_of_each_depth_and_keeps_the_best_nodes() {
        let params = SamplingParams::greedy(16);
        let sampler = DraftSampler::new(&params, 4, 4, DraftDrawing::COUPLED);
        let ln = |q: [f32; 4]| q.map(f32::ln);
        let grow = |max_depth: usize, max_nodes: usize| {
            let mut tree = DynamicTree::new(max_depth, TreeLimits { max_nodes, max_children: 2 });
            tree.add_children(&sampler, -1, &ln([0.5, 0.3, 0.15, 0.05]));
            assert_eq!(tree.frontier(0), [0, 1]);
            tree.add_children(&sampler, 0, &ln([0.1, 0.2, 0.65, 0.05]));
            tree.add_children(&sampler, 1, &ln([0.9, 0.06, 0.04, 0.0]));
            tree
        };
        let tree = grow(3, 5);
        assert_eq!(tree.nodes.iter().map(|n| n.token_id).collect::<Vec<_>>(), [0, 1, 2, 1, 0, 1]);
        assert_eq!(tree.frontier(1), [2, 4], "C and E, best first");
        assert!(grow(2, 5).frontier(1).is_empty(), "their children would be too deep");
        // With 3 nodes E (4 nodes before it) could not be kept, nor its children.
        assert_eq!(grow(3, 3).frontier(1), [2]);
        let draft = tree.draft(&tree.select());
        assert_eq!((draft.token_ids, draft.parents), (vec![0, 2, 1, 0, 1], Some(vec![-1, 0, -1, 2, 0])));
        let small = grow(3, 3);
        assert_eq!(small.draft(&small.select()).parents, Some(vec![-1, 0, -1]));
        // q = 0 is never a child; a confidence threshold stops expansion below it.
        let mut tree = DynamicTree::new(3, TreeLimits { max_nodes: 8, max_children: 4 });
        tree.add_children(
            &DraftSampler::new(
                &params,
                4,
                4,
                DraftDrawing { confidence_threshold: 0.2, verification: Verification::Coupled },
            ),
            -1,
            &ln([0.9, 0.1, 0.0, 0.0]),
        );
        assert_eq!(tree.nodes.len(), 2);
        assert_eq!(tree.frontier(0), [0]);
    }

    /// Coupled: each token is the inverse-CDF draw over q with the request's uniform of its
    /// output position, so a q equal to p drafts exactly the token the verifier samples there,
    /// and no q row goes with it. Rejection: the draft's own stream, with the q row.
    #[test]
    fn a_coupled_draw_uses_the_targets_positional_uniform_and_keeps_no_q_row() {
        let params = SamplingParams { temperature: 0.9, seed: Some(11), ..SamplingParams::greedy(16) };
        let logits = [0.3f32, 1.2, -0.4, 0.9, 0.0, 1.1];
        let p = probabilities(&logits, &params);
        let target = Sampler::new(Some(11));
        let mut coupled = DraftSampler::new(&params, 6, 8, DraftDrawing::COUPLED);
        let mut own_stream = DraftSampler::new(
            &params,
            6,
            8,
            DraftDrawing { confidence_threshold: 0.0, verification: Verification::Rejection },
        );
        let (mut agree, mut differ) = (0, 0);
        for position in 0..200 {
            let token = coupled.draw(&logits, position);
            assert_eq!(token.token_id, target.draw_at(&p, position), "position {position}");
            assert!(token.probs.is_none());
            let drawn = own_stream.draw(&logits, position);
            assert_eq!(drawn.probs.as_ref().map(Vec::len), Some(8), "a q row as wide as the target's vocabulary");
            if drawn.token_id == token.token_id {
                agree += 1;
            } else {
                differ += 1;
            }
        }
        // The own stream is independent of the positions: it agrees with the coupled draw only as
        // often as two independent draws do (sum p^2 ~ 0.22 here), never always.
        assert!(differ > 100 && agree > 10, "agree {agree}, differ {differ}");
        // Greedy requests draft the argmax either way.
        let greedy = SamplingParams::greedy(16);
        assert_eq!(DraftSampler::new(&greedy, 6, 8, DraftDrawing::COUPLED).draw(&logits, 3).token_id, 1);
    }

    #[test]
    fn a_draft_with_a_smaller_vocabulary_reads_the_targets_extra_tokens_as_token_0() {
        let config = LlamaConfig::from_json(
            r#"{"vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}"#,
        )
        .unwrap();
        let draft: Arc<dyn CausalLm> =
            Arc::new(Decoder::random(&config, 3, WeightFormat::Dense(candle_core::DType::F32), &Device::Cpu).unwrap());
        let target_vocab = 40;
        let mut proposer = DraftModelProposer::new(draft, None, target_vocab, DraftDrawing::COUPLED, Arc::default());
        proposer.begin(&[1, 2, 3], &SamplingParams::greedy(8)).unwrap();
        // Ids 35 and 39 exist only in the target's vocabulary: a draft, not an error.
        let with_extra = proposer.propose(&[1, 35, 2, 39], 3).unwrap();
        assert_eq!(with_extra.token_ids.len(), 3);
        assert!(with_extra.token_ids.iter().all(|&t| t < 32));
        proposer.observe(&Feedback::accepted(0, &[], &[])).unwrap();
        // The same draft as for a context holding token 0 in their place.
        let mut reference = DraftModelProposer::new(
            proposer.cache.model.clone(),
            None,
            target_vocab,
            DraftDrawing::COUPLED,
            Arc::default(),
        );
        reference.begin(&[1, 2, 3], &SamplingParams::greedy(8)).unwrap();
        assert_eq!(reference.propose(&[1, 0, 2, 0], 3).unwrap().token_ids, with_extra.token_ids);
    }
}
