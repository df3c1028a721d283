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
pub mod layer_skip;
pub mod ngram;
pub mod pard;
pub mod suffix;

use crate::config::SamplingParams;
use crate::error::Result;
use crate::kv_cache::KvCache;

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

    /// `propose` with access to the target's cache, for drafts computed by the target's own early
    /// layers (`layer_skip`). A proposer may write positions past `target_cache.len()` but must
    /// leave the length as it found it.
    fn propose_with_target_cache(
        &mut self,
        context: &[u32],
        max_tokens: usize,
        _target_cache: &mut KvCache,
    ) -> Result<Draft> {
        self.propose(context, max_tokens)
    }

    /// How many tokens of the last draft the target accepted.
    fn observe(&mut self, _num_accepted: usize) -> Result<()> {
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
