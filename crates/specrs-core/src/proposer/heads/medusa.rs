//! Medusa heads (Cai et al. 2024, arXiv 2401.10774): head i drafts the token i + 2 places after the
//! position of the target's last hidden state (the target's own LM head gives the first), from that
//! hidden state alone: `num_layers` residual blocks `x + SiLU(W x + b)` and a linear LM head (the
//! head's own, or one shared `lm_head` with vLLM's `original_lm_head`). A head with a truncated
//! vocabulary maps its rows to target ids through `token_map`.
//!
//! In a token tree every node of depth i therefore gets the same children, head i's top-k: the
//! classic Medusa tree (Cai et al.'s Cartesian product of each head's top-k), cut to the best
//! nodes by cumulative probability.
//!
//! Invariant: no cache; head i reads only the target's final-normed last hidden state, so the
//! drafted tokens do not condition on each other (each q_i is still a proper distribution, which
//! is all rejection sampling needs).

use candle_core::Tensor;

use super::weights::Linear;
use super::{scatter_vocab, ParallelHead};
use crate::error::Result;
use crate::model::Tap;

pub struct MedusaHead {
    /// Residual blocks of each head.
    pub blocks: Vec<Vec<Linear>>,
    /// One LM head per head (or one shared by all).
    pub lm_heads: Vec<Linear>,
    /// `[truncated_vocab]` u32 target ids of a truncated vocabulary.
    pub token_map: Option<Tensor>,
    pub target_vocab: usize,
    /// vLLM's `logit_scale`: the LM heads' output is multiplied by it.
    pub logit_scale: f64,
}

impl ParallelHead for MedusaHead {
    fn tap(&self) -> Tap {
        Tap::FinalNorm
    }

    fn num_heads(&self) -> usize {
        self.blocks.len()
    }

    fn step(&self, i: usize, state: &Tensor, token: u32) -> Result<(Tensor, Tensor)> {
        self.step_rows(i, state, &[token])
    }

    /// Every row at once (`states` `[m, hidden]`, all the target's state in a tree): the tokens
    /// are not read.
    fn step_rows(&self, i: usize, state: &Tensor, _tokens: &[u32]) -> Result<(Tensor, Tensor)> {
        let mut x = state.clone();
        for block in &self.blocks[i] {
            x = (&x + block.forward(&x)?.silu()?)?;
        }
        let lm_head = &self.lm_heads[i.min(self.lm_heads.len() - 1)];
        let mut logits = lm_head.forward(&x)?;
        if self.logit_scale != 1.0 {
            logits = (logits * self.logit_scale)?;
        }
        let logits = match &self.token_map {
            Some(map) => scatter_vocab(&logits, map, self.target_vocab, state.device())?,
            None => logits,
        };
        // Every head reads the target's hidden state, not the previous head's.
        Ok((logits, state.clone()))
    }
}
