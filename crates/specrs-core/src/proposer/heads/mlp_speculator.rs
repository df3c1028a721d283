//! IBM's MLP speculator (Wertheimer et al. 2024, arXiv 2404.19124; fms-extras' `MLPSpeculator`,
//! vLLM's `mlp_speculator`): `n_predict` small sub-heads, each drafting one more token from a
//! running state and the token before it.
//!
//! Sub-head i: `s = GELU(ln_i(proj_i(s) + (emb_weight / state_weight) * emb_i(token)))`, logits
//! `head_i(s)`, with `state_weight = 0.5^(0.5 / n_predict)` and `emb_weight =
//! sqrt((1 - state_weight^2) * inner_dim / 2)`. `ln_i` is fms' `LayerNormParameterized` without
//! the mean: `x / sqrt(mean(x^2) + 1e-6) * weight + bias`; GELU is the exact (erf) one. The first
//! state is the target's final-normed last hidden state (divided by sqrt(2) after a weightless
//! `ln0` when `scale_input`), and the first token is the newest context token. With
//! `tie_weights`, every sub-head shares `emb`, `ln` and `head` of sub-head 0, and sub-heads 2..
//! share `proj` of sub-head 1.
//!
//! A token tree runs sub-head i over every frontier node of depth i - 1 at once (`step_rows`):
//! each row reads its parent's state and its own token, as a chain run of its path does.
//!
//! Invariant: no cache; a draft reads only the target's last hidden state and the drawn tokens.

use candle_core::{DType, Tensor};

use super::weights::Linear;
use super::ParallelHead;
use crate::error::Result;
use crate::model::Tap;

/// fms' LayerNormParameterized eps.
pub const LN_EPS: f64 = 1e-6;

pub struct SubHead {
    /// `[vocab, inner]`
    pub emb: Tensor,
    pub proj: Linear,
    /// `[inner]` each.
    pub ln_weight: Tensor,
    pub ln_bias: Tensor,
    pub head: Linear,
}

pub struct MlpSpeculator {
    pub heads: Vec<SubHead>,
    pub scale_input: bool,
    pub state_weight: f64,
    pub emb_weight: f64,
}

impl MlpSpeculator {
    /// Weights from the published sizes.
    pub fn weights(n_predict: usize, inner_dim: usize) -> (f64, f64) {
        let state_weight = 0.5f64.powf(0.5 / n_predict as f64);
        let emb_weight = ((1.0 - state_weight * state_weight) * inner_dim as f64 / 2.0).sqrt();
        (state_weight, emb_weight)
    }
}

/// `x / sqrt(mean(x^2) + eps)` over the last dimension.
fn rms_only(x: &Tensor) -> Result<Tensor> {
    let mean_square = x.sqr()?.mean_keepdim(1)?;
    Ok(x.broadcast_div(&(mean_square + LN_EPS)?.sqrt()?)?)
}

impl ParallelHead for MlpSpeculator {
    fn tap(&self) -> Tap {
        Tap::FinalNorm
    }

    fn num_heads(&self) -> usize {
        self.heads.len()
    }

    fn step(&self, i: usize, state: &Tensor, token: u32) -> Result<(Tensor, Tensor)> {
        self.step_rows(i, state, &[token])
    }

    /// Every row at once: the ops are row-wise (`rms_only` normalizes each row).
    fn step_rows(&self, i: usize, states: &Tensor, tokens: &[u32]) -> Result<(Tensor, Tensor)> {
        let head = &self.heads[i];
        let mut state = states.to_dtype(DType::F32)?; // [m, width]
        if i == 0 && self.scale_input {
            state = (rms_only(&state)? / 2f64.sqrt())?;
        }
        let z = head.emb.index_select(&Tensor::new(tokens, state.device())?, 0)?; // [m, inner]
        let x = (head.proj.forward(&state)? + (z * (self.emb_weight / self.state_weight))?)?;
        let x = rms_only(&x)?.broadcast_mul(&head.ln_weight)?.broadcast_add(&head.ln_bias)?;
        let state = x.gelu_erf()?; // [m, inner]
        Ok((head.head.forward(&state)?, state))
    }
}
