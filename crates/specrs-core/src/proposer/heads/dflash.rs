//! DFlash block drafters (block diffusion, arXiv 2602.06036), as PyPI `dflash` 0.1.0 writes and
//! runs them (`dflash/model.py`, `DFlashDraftModel`).
//!
//! The drafter is a stack of Qwen3 decoder layers that never sees its own keys from earlier
//! steps. Its context is the target's residual stream at a few tapped layers
//! (`target_layer_ids`; hidden state `id + 1`), concatenated, projected by `fc` and RMS-normed
//! (`hidden_norm`): one feature row per context position, which every layer turns into keys and
//! values with its own `k_proj` / `v_proj` (k-normed, rotated at the row's position). A draft is
//! ONE forward over a block of `block_size` rows at positions `p..p + block_size`: the newest
//! context token at `p` (not yet read by the target) followed by `mask_token_id`, embedded with
//! the target's table (times `input_embedding_scale`). Each block row attends to every context
//! row and to every block row (both ways; causally among the block with `is_causal`), runs the
//! layer's MLP, and after the final `norm` rows 1.. go through the target's LM head (times
//! `output_multiplier`, soft-capped by `final_logit_softcapping`): the logits of the block's
//! `block_size - 1` draft positions, each independent of the tokens drawn at the others.
//!
//! The whole block always runs, whatever k a step asks for: a row's logits depend on how many
//! mask rows follow it, and the drafter was trained on full blocks (the reference shortens the
//! block only at the end of its output buffer).
//!
//! Invariant: each layer's cache holds the keys and values of exactly the context positions the
//! head has read (`extend`); a block is never written to it.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::layer::HeadLayer;
use super::weights::Linear;
use super::{rms, row_share, BlockHead};
use crate::error::Result;
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::candle::attention::softcap;
use crate::model::{CausalLm, Tap};

/// One drafter layer: its input norm (the block rows'; context features come normed by
/// `hidden_norm`) and the Qwen3 block.
pub struct DFlashLayer {
    /// `[hidden]`
    pub input_norm: Tensor,
    pub layer: HeadLayer,
}

pub struct DFlashHead {
    /// The target's hidden states `target_layer_ids[i] + 1`, concatenated in this order.
    pub taps: Vec<Tap>,
    /// `[hidden, num_taps * hidden]`
    pub fc: Linear,
    /// `[hidden]`
    pub hidden_norm: Tensor,
    pub layers: Vec<DFlashLayer>,
    /// `[hidden]`, before the target's LM head.
    pub norm: Tensor,
    /// Rows of one block: the newest context token and `block_size - 1` masks.
    pub block_size: usize,
    pub mask_token_id: u32,
    pub input_embedding_scale: f64,
    pub output_multiplier: f64,
    pub final_logit_softcapping: Option<f64>,
    /// Block rows attend causally among themselves (`is_causal`); by default both ways.
    pub causal: bool,
    pub target: Arc<dyn CausalLm>,
    pub rms_eps: f32,
}

impl BlockHead for DFlashHead {
    fn taps(&self) -> Vec<Tap> {
        self.taps.clone()
    }

    fn new_caches(&self, capacity: usize, kv_bytes: &Arc<KvBytes>) -> Result<Vec<KvCache>> {
        self.layers.iter().map(|l| l.layer.new_cache(capacity, kv_bytes)).collect()
    }

    fn extend(&self, caches: &mut [KvCache], target_hidden: &Tensor, start: usize) -> Result<()> {
        let features = rms(&self.fc.forward(target_hidden)?, &self.hidden_norm, self.rms_eps)?; // [n, hidden]
        for (layer, cache) in self.layers.iter().zip(caches) {
            layer.layer.append_context(&features, start, cache)?;
        }
        Ok(())
    }

    fn block_len(&self) -> usize {
        self.block_size - 1
    }

    fn block(&self, caches: &[KvCache], anchor: u32, position: usize) -> Result<Tensor> {
        let mut tokens = vec![self.mask_token_id; self.block_size];
        tokens[0] = anchor;
        let mut hidden = self.target.embed(&tokens)?.to_dtype(DType::F32)?; // [block, hidden]
        if self.input_embedding_scale != 1.0 {
            hidden = (hidden * self.input_embedding_scale)?;
        }
        for (layer, cache) in self.layers.iter().zip(caches) {
            let normed = rms(&hidden, &layer.input_norm, self.rms_eps)?;
            hidden = layer.layer.forward_block(&normed, &hidden, cache, position, self.causal)?;
        }
        let drafted = rms(&hidden.narrow(0, 1, self.block_size - 1)?, &self.norm, self.rms_eps)?; // [block - 1, hidden]
        let mut logits = self.target.lm_head(&drafted, None)?.to_dtype(DType::F32)?; // [block - 1, vocab]
        if self.output_multiplier != 1.0 {
            logits = (logits * self.output_multiplier)?;
        }
        match self.final_logit_softcapping {
            Some(cap) => softcap(&logits, cap as f32),
            None => Ok(logits),
        }
    }

    /// A context row runs `fc` and every layer's key and value projections; a block runs every
    /// layer over `block_size` rows and the LM head over `block_size - 1`, shared by the tokens
    /// it drafts.
    fn context_row_share(&self) -> f64 {
        let row = self.fc.num_weights() + self.layers.iter().map(|l| l.layer.num_kv_weights()).sum::<usize>();
        let layers: usize = self.layers.iter().map(|l| l.layer.num_weights()).sum();
        let per_token = (self.block_size * layers) as f64 / (self.block_size - 1) as f64;
        row_share(row, per_token.round() as usize, None, self.target.as_ref())
    }
}
