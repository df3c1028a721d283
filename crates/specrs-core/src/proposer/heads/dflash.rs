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
//! DSpark drafters (`dspark.rs`) are this drafter plus a Markov head and a confidence head, and
//! may draft from the anchor's row too (`logits_start` 0), ship their own embedding and LM head
//! (over a draft vocabulary mapped by `d2t`): the same struct with those parts filled in.
//!
//! Invariant: each layer's cache holds the keys and values of exactly the context positions the
//! head has read (`extend`); a block is never written to it.

use std::sync::Arc;

use candle_core::Tensor;

use super::dspark::{ConfidenceHead, MarkovHead};
use super::layer::HeadLayer;
use super::weights::Linear;
use super::{embed_rows, lm_head_logits, rms, row_share, scatter_vocab, BlockHead};
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
    /// `[hidden]`, before the LM head.
    pub norm: Tensor,
    /// Rows of one block: the newest context token and `block_size - 1` masks.
    pub block_size: usize,
    /// The first row whose output drafts: 1 for DFlash (the anchor's row only carries it), 0
    /// for DSpark heads that also draft from the anchor's row (`logits_start`).
    pub first_drafting_row: usize,
    pub mask_token_id: u32,
    /// The drafter's own embedding `[vocab, hidden]` (DSpark may ship one); None: the target's.
    pub embed: Option<Tensor>,
    /// What the block's embedding rows are multiplied by (DFlash's `input_embedding_scale`).
    pub input_embedding_scale: f64,
    /// The drafter's own LM head `[V_out, hidden]` (DSpark may ship one); None: the target's.
    pub lm_head: Option<Linear>,
    /// `[V_out]` u32 target ids of the drafter's vocabulary (DSpark's `d2t`); None: the target's.
    pub draft_to_target: Option<Tensor>,
    pub output_multiplier: f64,
    pub final_logit_softcapping: Option<f64>,
    /// Block rows attend causally among themselves (`is_causal`); by default both ways.
    pub causal: bool,
    /// DSpark's heads.
    pub markov: Option<MarkovHead>,
    pub confidence: Option<ConfidenceHead>,
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
        self.block_size - self.first_drafting_row
    }

    fn block(&self, caches: &[KvCache], anchor: u32, position: usize) -> Result<Tensor> {
        let mut tokens = vec![self.mask_token_id; self.block_size];
        tokens[0] = anchor;
        let mut hidden = embed_rows(self.embed.as_ref(), self.target.as_ref(), &tokens)?; // [block, hidden]
        if self.input_embedding_scale != 1.0 {
            hidden = (hidden * self.input_embedding_scale)?;
        }
        for (layer, cache) in self.layers.iter().zip(caches) {
            let normed = rms(&hidden, &layer.input_norm, self.rms_eps)?;
            hidden = layer.layer.forward_block(&normed, &hidden, cache, position, self.causal)?;
        }
        let drafting = hidden.narrow(0, self.first_drafting_row, self.block_len())?;
        rms(&drafting, &self.norm, self.rms_eps) // [block_len, hidden]
    }

    fn logits(&self, rows: &Tensor, previous: &[u32]) -> Result<Tensor> {
        let mut logits = lm_head_logits(self.lm_head.as_ref(), self.target.as_ref(), rows)?; // [n, V_out]
        if self.output_multiplier != 1.0 {
            logits = (logits * self.output_multiplier)?;
        }
        if let Some(cap) = self.final_logit_softcapping {
            logits = softcap(&logits, cap as f32)?;
        }
        if let Some(markov) = &self.markov {
            logits = (logits + markov.bias(previous)?)?;
        }
        match &self.draft_to_target {
            Some(ids) => scatter_vocab(&logits, ids, self.target.info().vocab_size, rows.device()),
            None => Ok(logits),
        }
    }

    fn reads_previous(&self) -> bool {
        self.markov.is_some()
    }

    fn confidence(&self, rows: &Tensor, previous: &[u32]) -> Result<Option<Vec<f32>>> {
        self.confidence.as_ref().map(|c| c.confidence(rows, previous, self.markov.as_ref())).transpose()
    }

    /// A context row runs `fc` and every layer's key and value projections; a block (one draft,
    /// what its cost c is charged for: `costs::DraftCost`) runs every layer over `block_size`
    /// rows and the LM head over its `block_len` drafting rows. The share is the row's weights
    /// over the block's: per drafted token's, over `block_len`.
    fn context_row_share(&self) -> f64 {
        let row = self.fc.num_weights() + self.layers.iter().map(|l| l.layer.num_kv_weights()).sum::<usize>();
        let layers: usize = self.layers.iter().map(|l| l.layer.num_weights()).sum();
        let per_token = (self.block_size * layers) as f64 / self.block_len() as f64;
        row_share(row, per_token.round() as usize, self.lm_head.as_ref(), self.target.as_ref())
            / self.block_len() as f64
    }
}
