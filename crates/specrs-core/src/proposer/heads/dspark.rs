//! DSpark's two heads on top of a DFlash block drafter (DeepSeek, 2026), as mlx-dspark 0.20.3
//! stores and runs them (`markov_head.*`, `confidence_head.*`; read, not copied; the golden case
//! `dspark_qwen3` is computed by mlx-dspark's own drafter).
//!
//! - Markov head: a rank-r bias on a drafting row's logits from the token drafted before it,
//!   `markov_w2 · markov_w1[previous]` (`[V_out]`), added after the soft-cap. It reads no hidden
//!   state, so a block's rows stay one forward; only their logits wait for the previous draw.
//! - Confidence head: `sigmoid(proj([row ; markov_w1[previous]]))` (or of the row alone), the
//!   probability that the row's draft is accepted; drafting goes on while the product of the
//!   confidences so far reaches the threshold (DSpark's rule; `HeadProposer::draft_block`).
//!
//! Invariant: both read only a drafting row (after the drafter's final norm) and the token before
//! it, so a draft's logits and confidences depend on nothing but the block and the drawn tokens.

use candle_core::{DType, Tensor};

use super::weights::Linear;
use crate::error::Result;

pub struct MarkovHead {
    /// `[vocab, rank]`: indexed by the previous token (a target id).
    pub w1: Tensor,
    /// `[V_out, rank]`: V_out is the drafter's output vocabulary (its own, or the target's).
    pub w2: Linear,
}

impl MarkovHead {
    /// `previous`' rows of `w1` `[n, rank]`.
    pub fn codes(&self, previous: &[u32]) -> Result<Tensor> {
        Ok(self.w1.index_select(&Tensor::new(previous, self.w1.device())?, 0)?)
    }

    /// The bias `[n, V_out]` on the logits of rows drafted after `previous`.
    pub fn bias(&self, previous: &[u32]) -> Result<Tensor> {
        self.w2.forward(&self.codes(previous)?)
    }
}

pub struct ConfidenceHead {
    /// `[1, hidden]` or `[1, hidden + rank]` (with `confidence_head_with_markov`), with its bias.
    pub proj: Linear,
    /// The input also holds the Markov head's code of the previous token.
    pub with_markov: bool,
}

impl ConfidenceHead {
    /// The confidence of each of `rows` `[n, hidden]` after `previous`, in (0, 1).
    pub fn confidence(&self, rows: &Tensor, previous: &[u32], markov: Option<&MarkovHead>) -> Result<Vec<f32>> {
        let input = match (self.with_markov, markov) {
            (true, Some(markov)) => Tensor::cat(&[rows, &markov.codes(previous)?], 1)?,
            _ => rows.clone(),
        };
        let logit = self.proj.forward(&input)?.to_dtype(DType::F32)?; // [n, 1]
        Ok(candle_nn::ops::sigmoid(&logit)?.flatten_all()?.to_vec1()?)
    }
}
