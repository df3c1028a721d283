//! Proposers: cheap guesses of the next tokens, which the target model then verifies.
//!
//! Invariant: a proposer only ever guesses; it never decides output. Whatever it returns is checked
//! by the verifier against the target model, so a bad guess costs speed, never correctness. Within
//! one request, `context` only grows by appending between calls (rejected guesses never enter it),
//! which lets proposers index it incrementally.
//!
//! Model-based proposers (`draft_model`, `layer_skip`, `pard`) sample their drafts from their own
//! distribution q after the request's temperature / top-k / top-p, and return q so the verifier
//! can run exact rejection sampling.

pub mod auto;
pub mod chains_together;
pub mod cross_tokenizer;
pub mod draft_model;
pub mod heads;
pub mod layer_skip;
pub mod ngram;
pub mod ngram_together;
pub mod pard;
pub mod suffix;
pub mod suffix_store;
pub mod suffix_together;
pub mod tree;

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::metrics::DrafterCounts;
use crate::model::Tap;
use candle_core::Tensor;
use draft_model::DraftModelProposer;
pub use tree::TreeLimits;

/// Guessed tokens, as a chain (up to k tokens) or a token tree (`tree.rs`), with the draft
/// distribution each was drawn from when the proposer has one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub token_ids: Vec<u32>,
    /// `[token_ids.len(), vocab_size]` row-major draft probabilities q; None means each token was
    /// chosen deterministically (q is one-hot on it). In a tree, row i is the distribution token
    /// i was drawn from, which its siblings share: they are drawn from it in order, without
    /// replacement (verify.rs).
    pub probs: Option<Vec<f32>>,
    /// `[token_ids.len()]` a token tree: each token's parent among the draft tokens, -1 for the
    /// newest context token. None: a chain.
    pub parents: Option<Vec<i32>>,
}

impl Draft {
    pub fn tokens(token_ids: Vec<u32>) -> Self {
        Self { token_ids, probs: None, parents: None }
    }

    /// A deterministic token tree; a tree that is a chain is stored as one.
    pub fn tree(token_ids: Vec<u32>, parents: Vec<i32>) -> Self {
        let mut draft = Self { token_ids, probs: None, parents: Some(parents) };
        draft.normalize_chain();
        draft
    }

    /// Each token's parent (-1: the newest context token); a chain's are `i - 1`.
    pub fn parents(&self) -> Vec<i32> {
        match &self.parents {
            Some(parents) => parents.clone(),
            None => (0..self.token_ids.len() as i32).map(|i| i - 1).collect(),
        }
    }

    /// Whether some token has a sibling (a tree that is not a chain).
    pub fn is_tree(&self) -> bool {
        self.parents.as_ref().is_some_and(|parents| parents.iter().enumerate().any(|(i, &p)| p != i as i32 - 1))
    }

    /// Tree depth: the most tokens one verification can accept.
    pub fn depth(&self) -> usize {
        match &self.parents {
            Some(parents) => tree::depths(parents).map_or(0, |d| d.iter().max().map_or(0, |m| m + 1)),
            None => self.token_ids.len(),
        }
    }

    /// Stores a tree whose parents are `i - 1` as a chain.
    fn normalize_chain(&mut self) {
        if self.parents.is_some() && !self.is_tree() {
            self.parents = None;
        }
    }

    /// Keeps the first `len` tokens (and their probability rows of width `vocab_size`); in a tree,
    /// the first `len` tokens are a subtree (parents come first).
    pub fn truncate(&mut self, len: usize, vocab_size: usize) {
        self.token_ids.truncate(len);
        if let Some(probs) = self.probs.as_mut() {
            probs.truncate(len * vocab_size);
        }
        if let Some(parents) = self.parents.as_mut() {
            parents.truncate(len);
        }
        self.normalize_chain();
    }

    /// Keeps the tokens at `keep` (increasing, closed under parents: `tree::is_closed`).
    pub fn keep_nodes(&mut self, keep: &[usize], vocab_size: usize) {
        let parents = tree::subset_parents(&self.parents(), keep);
        self.token_ids = keep.iter().map(|&k| self.token_ids[k]).collect();
        if let Some(probs) = self.probs.as_mut() {
            *probs = keep.iter().flat_map(|&k| probs[k * vocab_size..(k + 1) * vocab_size].to_vec()).collect();
        }
        self.parents = Some(parents);
        self.normalize_chain();
    }

    /// Drops the tokens deeper than `max_depth` (a chain keeps its first `max_depth`); a draft
    /// whose parents are malformed is left for `validate` to refuse.
    pub fn cut_to_depth(&mut self, max_depth: usize) {
        let n = self.token_ids.len();
        let vocab_size = self.probs.as_ref().map_or(0, |probs| probs.len() / n.max(1));
        let Some(parents) = &self.parents else {
            if n > max_depth {
                self.truncate(max_depth, vocab_size);
            }
            return;
        };
        let Ok(depths) = tree::try_depths(parents) else { return };
        if depths.len() != n || depths.iter().all(|&d| d < max_depth) {
            return;
        }
        let keep: Vec<usize> = (0..n).filter(|&i| depths[i] < max_depth).collect();
        self.keep_nodes(&keep, vocab_size);
    }

    /// Refuses a draft the verifier cannot use: more than `max_draft` tokens, ids outside the
    /// vocabulary, or probabilities that are not `[num_draft_tokens, vocab_size]` rows of
    /// distributions with q(x) > 0 for each drafted x. `method` names the proposer in the error.
    /// A tree must also have one parent per token, parents before children, distinct siblings,
    /// depth at most `max_draft`, and at most `tree.max_nodes` tokens and `tree.max_children`
    /// children per node when the proposer was asked for a tree (`tree` None: a chain was asked
    /// for, and a tree is refused).
    pub fn validate(&self, max_draft: usize, tree: Option<TreeLimits>, vocab: usize, method: &str) -> Result<()> {
        // The draft's shape first: a tree returned for a chain is refused for that, whatever its size.
        if let Some(parents) = &self.parents {
            self.validate_tree(parents, max_draft, tree, method)?;
        }
        let n = self.token_ids.len();
        let max_nodes = tree.map_or(max_draft, |t| t.max_nodes);
        if n > max_nodes {
            return Err(Error::Proposer(format!(
                "the {method} proposer returned {n} tokens but was asked for at most {max_nodes}; return at most max_tokens"
            )));
        }
        if let Some(bad) = self.token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Proposer(format!(
                "the {method} proposer returned token id {bad}, outside the vocabulary (size {vocab})"
            )));
        }
        let Some(probs) = &self.probs else { return Ok(()) };
        if probs.len() != n * vocab {
            return Err(Error::Proposer(format!(
                "the {method} proposer's draft probabilities have {} values; expected [{n}, {vocab}] \
                 (one row per draft token, one column per vocabulary entry)",
                probs.len()
            )));
        }
        for (i, (row, &x)) in probs.chunks(vocab.max(1)).zip(&self.token_ids).enumerate() {
            if row.iter().any(|q| !q.is_finite() || *q < 0.0) || (row.iter().sum::<f32>() - 1.0).abs() > 1e-3 {
                return Err(Error::Proposer(format!(
                    "the {method} proposer's draft probabilities in row {i} are not a distribution \
                     (non-negative, finite, summing to 1)"
                )));
            }
            if row[x as usize] <= 0.0 {
                return Err(Error::Proposer(format!(
                    "the {method} proposer drafted token {x} at position {i} with draft probability 0; \
                     a drafted token must have q > 0 under its own distribution"
                )));
            }
        }
        Ok(())
    }
}

impl Draft {
    fn validate_tree(&self, parents: &[i32], max_depth: usize, limits: Option<TreeLimits>, method: &str) -> Result<()> {
        if parents.len() != self.token_ids.len() {
            return Err(Error::Proposer(format!(
                "the {method} proposer returned {} parents for {} tokens; give one parent per token (-1 for the newest context token)",
                parents.len(),
                self.token_ids.len()
            )));
        }
        let depths =
            tree::depths(parents).map_err(|e| Error::Proposer(format!("the {method} proposer's tree: {e}")))?;
        let Some(limits) = limits else {
            if self.is_tree() {
                return Err(Error::Proposer(format!(
                    "the {method} proposer returned a token tree, but this request verifies chains; set \"tree\" in the speculative config to verify trees"
                )));
            }
            return Ok(());
        };
        if let Some(deepest) = depths.iter().max().filter(|&&d| d + 1 > max_depth) {
            return Err(Error::Proposer(format!(
                "the {method} proposer returned a tree {} tokens deep but was asked for at most {max_depth}",
                deepest + 1
            )));
        }
        for (parent, kids) in tree::children(parents).iter().enumerate() {
            if kids.len() > limits.max_children {
                return Err(Error::Proposer(format!(
                    "the {method} proposer gave node {} {} children; at most {} were asked for",
                    parent as i64 - 1,
                    kids.len(),
                    limits.max_children
                )));
            }
            let mut tokens: Vec<u32> = kids.iter().map(|&k| self.token_ids[k]).collect();
            tokens.sort_unstable();
            if tokens.windows(2).any(|w| w[0] == w[1]) {
                return Err(Error::Proposer(format!(
                    "the {method} proposer gave node {} the same token twice among its children; siblings must differ",
                    parent as i64 - 1
                )));
            }
        }
        Ok(())
    }
}

/// What a proposer is given for one draft.
pub struct ProposeInput<'a> {
    /// The prompt and every token generated so far.
    pub context: &'a [u32],
    /// Draft at most this many tokens (in a tree: at most this deep).
    pub max_tokens: usize,
    /// Some: a token tree may be returned, within these limits (`tree.rs`); None: a chain.
    pub tree: Option<TreeLimits>,
    /// The target's cache, holding `context` but its last token and the unverified ones.
    pub target_cache: &'a mut KvCache,
    /// The last tokens of `context` nobody verified yet (a grammar's forced run): 0 but for
    /// proposers that say `drafts_after_unverified_tokens`.
    pub num_unverified: usize,
}

/// The target's verdict on one draft, with what hidden-state heads continue from.
#[derive(Debug, Clone, Copy)]
pub struct Feedback<'a> {
    /// Draft tokens the target accepted (a chain's leading tokens, or a tree's path).
    pub num_accepted_tokens: usize,
    /// Indices of the accepted tokens in the draft as verified, root's child first:
    /// `0..num_accepted_tokens` for a chain, the accepted root-to-node path for a tree. The
    /// session may have pruned the proposer's tree (a static shape, the tree chooser) before
    /// verifying it, so a proposer that keeps its own tree finds the path by `token_ids` (siblings
    /// are distinct tokens).
    pub accepted_path: &'a [usize],
    /// The tokens this step appended: the accepted draft tokens, then the target's own (the
    /// recovered token at the first rejection, or the bonus token when every draft token passed).
    pub token_ids: &'a [u32],
    /// The target's hidden states at this proposer's `taps`, each `[num_rows, hidden_size]` over
    /// the verify forward's rows ([newest token, draft...]); the first `num_accepted_tokens + 1`
    /// rows are those of the tokens that stay.
    pub hidden: &'a [(Tap, Tensor)],
}

impl Feedback<'_> {
    /// A verdict without hidden states (model-free callers, cost measurements).
    pub fn accepted<'a>(num_accepted_tokens: usize, token_ids: &'a [u32], accepted_path: &'a [usize]) -> Feedback<'a> {
        Feedback { num_accepted_tokens, accepted_path, token_ids, hidden: &[] }
    }
}

/// The newest tokens of the context a model-free proposer indexed. The session may show such a
/// proposer tokens nobody verified yet (a grammar's forced run, `drafts_after_unverified_tokens`) and
/// then take them back when the target rejects them; a context that disagrees with them tells
/// the proposer to index from scratch rather than keep tokens the output does not hold.
#[derive(Debug, Default)]
pub(crate) struct IndexedTail {
    start: usize,
    tokens: Vec<u32>,
}

impl IndexedTail {
    /// More than the longest forced run the session shows (engine/session.rs).
    const LEN: usize = 32;

    /// Whether `context` holds the recorded tokens where it overlaps them.
    pub(crate) fn agrees(&self, context: &[u32]) -> bool {
        let end = (self.start + self.tokens.len()).min(context.len());
        self.start >= end || context[self.start..end] == self.tokens[..end - self.start]
    }

    pub(crate) fn record(&mut self, context: &[u32]) {
        self.start = context.len().saturating_sub(Self::LEN);
        self.tokens.clear();
        self.tokens.extend_from_slice(&context[self.start..]);
    }
}

/// One request's proposer.
pub trait Proposer: Send {
    /// Called once before the request's first step with its prompt and sampling parameters (with
    /// the seed the request's verifier draws with, when seeded or coupled). Draft models create
    /// their cache here; they read the prompt at their first `propose`.
    fn begin(&mut self, _prompt: &[u32], _params: &SamplingParams) -> Result<()> {
        Ok(())
    }

    /// Guesses up to `max_tokens` tokens that follow `context` (the prompt and every token
    /// generated so far).
    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft>;

    /// `propose` with what else the step can offer: the target's cache, for drafts computed by
    /// the target's own early layers (`layer_skip`). A proposer may write positions past
    /// `target_cache.len()` but must leave the length as it found it. The session calls this.
    fn propose_with(&mut self, input: ProposeInput<'_>) -> Result<Draft> {
        match input.tree {
            Some(limits) => self.propose_tree(input.context, input.max_tokens, limits),
            None => self.propose(input.context, input.max_tokens),
        }
    }

    /// A token tree (`tree.rs`) at most `max_depth` deep within `limits`, siblings best first.
    /// Proposers that know one guess only return a chain.
    fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
        self.propose(context, max_depth.min(limits.max_nodes))
    }

    /// The draft model's chain that `propose(context, max_tokens)` would draft next, so a
    /// scheduler can draft it together with other requests' chains (`chains_together.rs`): the
    /// draft model's proposer and the chain's length. The session then calls `propose(context,
    /// max_tokens)`, which returns that chain. None (the default) for proposers that draft no
    /// model chain there.
    fn model_chain(
        &mut self,
        _context: &[u32],
        _max_tokens: usize,
    ) -> Result<Option<(&mut DraftModelProposer, usize)>> {
        Ok(None)
    }

    /// The n-gram proposer whose next chain a scheduler may look up together with other
    /// requests' on the device (`ngram_together.rs`); the session then calls `propose(context,
    /// max_tokens)`, which returns that chain. None (the default) for other proposers.
    fn ngram_chain(&mut self) -> Option<&mut ngram::NgramProposer> {
        None
    }

    /// The suffix-decoding proposer whose next chain a scheduler may look up together with other
    /// requests' on the device (`suffix_together.rs`), as `ngram_chain`. None (the default) for
    /// other proposers.
    fn suffix_chain(&mut self) -> Option<&mut suffix::SuffixProposer> {
        None
    }

    /// Whether the session may ask it to continue a context extended by tokens nobody verified
    /// yet (a grammar's forced run; `ProposeInput::num_unverified` says how many): the proposers
    /// that draft from their `context` argument alone (n-gram, suffix decoding), and "auto", which
    /// then drafts from its lookups only. Proposers that keep state per verified position (draft
    /// models, heads) say no.
    fn drafts_after_unverified_tokens(&self) -> bool {
        false
    }

    /// Hidden states of the target this proposer reads (EAGLE, MTP, MLP speculator, Medusa):
    /// every forward of the request returns them, and `observe` receives them.
    fn taps(&self) -> Vec<Tap> {
        Vec::new()
    }

    /// The target's hidden states at `taps()` (in that order, each `[n, hidden_size]`) of the
    /// context positions `start..start + n` that stay in the cache, after every forward of the
    /// request: prompt chunks, the prompt, and each verification, with or without a draft.
    /// Successive calls cover the context without gaps or overlap, except after
    /// `target_context_dropped`, when they start again from position 0.
    fn observe_hidden(&mut self, _start: usize, _hidden: &[Tensor]) -> Result<()> {
        Ok(())
    }

    /// The target's KV cache was freed (the request was preempted) and the context will be fed
    /// again from position 0: a proposer holding state per target position (a head's hidden
    /// rows) drops it.
    fn target_context_dropped(&mut self) {}

    /// What reading one context row costs as a share of what its draft cost c is charged for
    /// (`kv_len`'s positions behind the context are read before the next draft): one drafted
    /// token, or a block drafter's whole block (`costs::DraftCost`). 1 for a draft model (a row is
    /// a one-row forward, as c is; about that for PARD's forward too), less for a head
    /// (`RecurrentHead::context_row_share`, `BlockHead::context_row_share`).
    fn context_row_share(&self) -> f64 {
        1.0
    }

    /// What the target made of the last draft.
    fn observe(&mut self, _feedback: &Feedback<'_>) -> Result<()> {
        Ok(())
    }

    /// The request ended with `generated` after its prompt; proposers that learn across requests
    /// (suffix decoding's global tree) keep it.
    fn finish(&mut self, _generated: &[u32]) {}

    /// Positions held by the proposer's own KV cache, for proposers with one (rollback checks).
    fn kv_len(&self) -> Option<usize> {
        None
    }

    /// Each of its drafters' counts, for a proposer that chooses among several ("auto"); empty
    /// for the others.
    fn drafter_counts(&self) -> Vec<DrafterCounts> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_to_depth_keeps_the_shallow_subtree_and_its_probability_rows() {
        // 10 -> {11 -> 13, 12}: depths 0, 1, 1, 2.
        let mut draft = Draft { token_ids: vec![10, 11, 12, 13], probs: None, parents: Some(vec![-1, 0, 0, 1]) };
        draft.probs = Some((0..4).flat_map(|i| [i as f32, 1.0 - i as f32]).collect());
        draft.cut_to_depth(2);
        assert_eq!(draft.token_ids, vec![10, 11, 12]);
        assert_eq!(draft.parents, Some(vec![-1, 0, 0]));
        assert_eq!(draft.probs, Some(vec![0.0, 1.0, 1.0, 0.0, 2.0, -1.0]));
        // Cut to one level, a single token is a chain.
        draft.cut_to_depth(1);
        assert_eq!((draft.token_ids.clone(), draft.parents.clone()), (vec![10], None));
        let mut chain = Draft::tokens(vec![1, 2, 3]);
        chain.cut_to_depth(2);
        assert_eq!(chain.token_ids, vec![1, 2]);
        // Malformed parents are left for validate to name.
        let mut bad = Draft { token_ids: vec![1, 2], probs: None, parents: Some(vec![-1, 5]) };
        bad.cut_to_depth(1);
        assert_eq!(bad.token_ids, vec![1, 2]);
        let mut short = Draft { token_ids: vec![1, 2, 3], probs: None, parents: Some(vec![-1, 0]) };
        short.cut_to_depth(1);
        assert_eq!(short.token_ids, vec![1, 2, 3]);
    }
}
