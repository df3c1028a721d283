//! Proposers: cheap guesses of the next tokens, which the target model then verifies.
//!
//! Invariant: a proposer only ever guesses; it never decides output. Whatever it returns is checked
//! by the verifier against the target model, so a bad guess costs speed, never correctness. Within
//! one request, `context` only grows by appending between calls (rejected guesses never enter it),
//! which lets proposers index it incrementally.

pub mod ngram;
pub mod suffix;

use crate::error::Result;

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
}

/// One request's proposer.
pub trait Proposer: Send {
    /// Guesses up to `max_tokens` tokens that follow `context` (the prompt and every token
    /// generated so far).
    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft>;

    /// How many tokens of the last draft the target accepted.
    fn observe(&mut self, _num_accepted: usize) -> Result<()> {
        Ok(())
    }

    /// The request ended with `generated` after its prompt; proposers that learn across requests
    /// (suffix decoding's global tree) keep it.
    fn finish(&mut self, _generated: &[u32]) {}
}
