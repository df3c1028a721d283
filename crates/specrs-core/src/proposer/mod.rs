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

pub mod draft_model;
pub mod heads;
pub mod layer_skip;
pub mod ngram;
pub mod pard;
pub mod suffix;
pub mod suffix_store;

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::Tap;
use candle_core::Tensor;

/// Up to k guessed tokens, with the draft distribution each was drawn from when the proposer has
/// one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub token_ids: Vec<u32>,
    /// `[token_ids.len(), vocab_size]` row-major draft probabilities q; None means each token was
    /// chosen deterministically (q is one-hot on it).
    pub probs: Option<Vec<f32>>,
}

impl Draft {
    pub fn tokens(token_ids: Vec<u32>) -> Self {
        Self { token_ids, probs: None }
    }

    /// Keeps the first `len` tokens (and their probability rows of width `vocab_size`).
    pub fn truncate(&mut self, len: usize, vocab_size: usize) {
        self.token_ids.truncate(len);
        if let Some(probs) = self.probs.as_mut() {
            probs.truncate(len * vocab_size);
        }
    }

    /// Refuses a draft the verifier cannot use: more than `max_draft` tokens, ids outside the
    /// vocabulary, or probabilities that are not `[num_draft_tokens, vocab_size]` rows of
    /// distributions with q(x) > 0 for each drafted x. `method` names the proposer in the error.
    pub fn validate(&self, max_draft: usize, vocab: usize, method: &str) -> Result<()> {
        let n = self.token_ids.len();
        if n > max_draft {
            return Err(Error::Proposer(format!(
                "the {method} proposer returned {n} tokens but was asked for at most {max_draft}; return at most max_tokens"
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

/// What a proposer is given for one draft.
pub struct ProposeInput<'a> {
    /// The prompt and every token generated so far.
    pub context: &'a [u32],
    /// Draft at most this many tokens.
    pub max_tokens: usize,
    /// The target's cache, holding `context` but its last token.
    pub target_cache: &'a mut KvCache,
}

/// The target's verdict on one draft, with what hidden-state heads continue from.
#[derive(Debug, Clone, Copy)]
pub struct Feedback<'a> {
    /// Leading draft tokens the target accepted.
    pub num_accepted_tokens: usize,
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
    pub fn accepted(num_accepted_tokens: usize, token_ids: &[u32]) -> Feedback<'_> {
        Feedback { num_accepted_tokens, token_ids, hidden: &[] }
    }
}

/// One request's proposer.
pub trait Proposer: Send {
    /// Called once before the request's first step with its prompt and sampling parameters (draft
    /// models prefill their cache here, so `propose` times only drafting).
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
        self.propose(input.context, input.max_tokens)
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
}
