//! EAGLE-1/2 (Li et al. 2024, arXiv 2401.15077; EAGLE-2 drafts trees with the same weights) and
//! EAGLE-3 (Li et al. 2025, arXiv 2503.01840) heads.
//!
//! EAGLE-1: `fc` over `[embedding(x_{j+1}); h_j]`, `h_j` the target's last hidden state (after its
//! final norm: what its LM head reads), then one decoder layer without an input norm; the layer's
//! output goes straight to the target's LM head (no norm), and is fed back as `h` at later steps.
//!
//! EAGLE-3: `fc` over the target's residual stream at three tapped layers (low | mid | high,
//! `[3 * target_hidden]` -> `[hidden]`), then one decoder layer whose attention reads
//! `[input_norm(embedding); hidden_norm(fc out)]` (2H wide) and whose residual is the fc output
//! (its `hidden_norm`ed value with `norm_before_residual`); its output, normed by the head's own
//! `norm`, goes to the head's LM head over a draft vocabulary, mapped to target ids by `d2t`
//! (target id = draft id + d2t[draft id]). Later steps feed the layer's output (before `norm`)
//! back in place of the fc output. speculators' options: `fc_norm` RMS-norms each tapped state
//! before fc, `norm_before_fc` the concatenation, `norm_output` feeds back the normed output.
//!
//! EAGLE-2's dynamic tree runs the same steps batched over a depth's frontier (`step_tree`): each
//! row attends to the context rows and its own ancestors' rows only (`layer::TreeRows`).
//!
//! Invariant: the head's cache holds one row per context position it read; `step` appends one
//! row (`step_tree` one per frontier node) that the proposer truncates after drafting.

use std::sync::Arc;

use candle_core::Tensor;

use super::layer::{HeadLayer, Rows, TreeRows};
use super::weights::Linear;
use super::{embed_rows, lm_head_logits, rms, row_share, scatter_vocab, RecurrentHead};
use crate::error::Result;
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::{CausalLm, Tap};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EagleVersion {
    One,
    Three,
}

pub struct EagleHead {
    pub version: EagleVersion,
    /// Target hidden states read, concatenated low | mid | high (EAGLE-3) or the final-normed
    /// last hidden state (EAGLE-1).
    pub taps: Vec<Tap>,
    /// EAGLE-1: `[hidden, 2 * hidden]` over [embedding; hidden]. EAGLE-3: `[hidden, 3 * target_hidden]`.
    pub fc: Linear,
    /// speculators' `fc_norm`: one RMSNorm `[target_hidden]` per tap before `fc` (empty: none).
    pub fc_norms: Vec<Tensor>,
    /// speculators' `norm_before_fc`: one RMSNorm `[num_taps * target_hidden]` before `fc`.
    pub fc_input_norm: Option<Tensor>,
    /// speculators' `norm_output` ("EAGLE 3.1"): later steps are fed the normed output.
    pub norm_output: bool,
    /// EAGLE-3's norms of the layer's two attention inputs, `[hidden]` each.
    pub input_norm: Option<Tensor>,
    pub hidden_norm: Option<Tensor>,
    pub norm_before_residual: bool,
    pub layer: HeadLayer,
    /// EAGLE-3's `norm` before its LM head.
    pub final_norm: Option<Tensor>,
    /// The head's own LM head (`[draft_vocab, hidden]`); None: the target's.
    pub lm_head: Option<Linear>,
    /// `[draft_vocab]` u32 target ids of the draft vocabulary; None: the target's vocabulary.
    pub draft_to_target: Option<Tensor>,
    /// The head's own embedding `[vocab, hidden]`; None: the target's (as vLLM shares it).
    pub embed: Option<Tensor>,
    pub target: Arc<dyn CausalLm>,
    pub rms_eps: f32,
    /// vLLM's `logit_scale`: the LM head's output is multiplied by it.
    pub logit_scale: f64,
}

impl EagleHead {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        embed_rows(self.embed.as_ref(), self.target.as_ref(), tokens)
    }

    /// The layer over `embeds` `[n, hidden]` and `hidden` `[n, hidden]` (EAGLE-1: the target's
    /// hidden state or the last output; EAGLE-3: the fc output or the last output).
    fn layer(&self, cache: &mut KvCache, embeds: &Tensor, hidden: &Tensor, rows: Rows) -> Result<Tensor> {
        match self.version {
            EagleVersion::One => {
                let fused = self.fc.forward(&Tensor::cat(&[embeds, hidden], 1)?)?;
                self.layer.forward(&fused, &fused, cache, rows)
            }
            EagleVersion::Three => {
                let (Some(input_norm), Some(hidden_norm)) = (&self.input_norm, &self.hidden_norm) else {
                    unreachable!("EAGLE-3 heads are built with both norms (load.rs)")
                };
                let normed_hidden = rms(hidden, hidden_norm, self.rms_eps)?;
                let attn_input = Tensor::cat(&[&rms(embeds, input_norm, self.rms_eps)?, &normed_hidden], 1)?;
                let residual = if self.norm_before_residual { &normed_hidden } else { hidden };
                let out = self.layer.forward(&attn_input, residual, cache, rows)?;
                match (&self.final_norm, self.norm_output) {
                    (Some(norm), true) => rms(&out, norm, self.rms_eps),
                    _ => Ok(out),
                }
            }
        }
    }
}

impl RecurrentHead for EagleHead {
    fn taps(&self) -> Vec<Tap> {
        self.taps.clone()
    }

    fn new_caches(&self, capacity: usize, kv_bytes: &Arc<KvBytes>) -> Result<Vec<KvCache>> {
        Ok(vec![self.layer.new_cache(capacity, kv_bytes)?])
    }

    fn extend(
        &self,
        caches: &mut [KvCache],
        target_hidden: &Tensor,
        next_tokens: &[u32],
        start: usize,
    ) -> Result<Tensor> {
        let embeds = self.embed(next_tokens)?; // [n, hidden]
        let hidden = match self.version {
            EagleVersion::One => target_hidden.clone(),
            EagleVersion::Three => {
                let x = if let Some(norm) = &self.fc_input_norm {
                    rms(target_hidden, norm, self.rms_eps)?
                } else if self.fc_norms.is_empty() {
                    target_hidden.clone()
                } else {
                    let width = target_hidden.dim(1)? / self.fc_norms.len();
                    let parts = self
                        .fc_norms
                        .iter()
                        .enumerate()
                        .map(|(i, norm)| rms(&target_hidden.narrow(1, i * width, width)?, norm, self.rms_eps))
                        .collect::<Result<Vec<_>>>()?;
                    Tensor::cat(&parts, 1)?
                };
                self.fc.forward(&x)? // [n, 3 * target_hidden] -> [n, hidden]
            }
        };
        self.layer(&mut caches[0], &embeds, &hidden, Rows::Chain(start))
    }

    fn step(
        &self,
        caches: &mut [KvCache],
        hidden: &Tensor,
        token: u32,
        _step: usize,
        position: usize,
    ) -> Result<Tensor> {
        self.layer(&mut caches[0], &self.embed(&[token])?, hidden, Rows::Chain(position))
    }

    fn drafts_trees(&self) -> bool {
        true
    }

    fn step_tree(
        &self,
        caches: &mut [KvCache],
        hidden: &Tensor,
        tokens: &[u32],
        _step: usize,
        rows: &TreeRows,
    ) -> Result<Tensor> {
        self.layer(&mut caches[0], &self.embed(tokens)?, hidden, Rows::Tree(rows))
    }

    /// A context row runs `fc` and the layer; a draft step the layer (EAGLE-3 feeds its output
    /// back past `fc`; EAGLE-1's `fc` reads every step's embedding) and the LM head.
    fn context_row_share(&self) -> f64 {
        let row = self.fc.num_weights() + self.layer.num_weights();
        let step = match self.version {
            EagleVersion::One => row,
            EagleVersion::Three => self.layer.num_weights(),
        };
        row_share(row, step, self.lm_head.as_ref(), self.target.as_ref())
    }

    fn logits(&self, hidden: &Tensor, _step: usize) -> Result<Tensor> {
        let normed = match &self.final_norm {
            Some(norm) if !self.norm_output => rms(hidden, norm, self.rms_eps)?,
            _ => hidden.clone(),
        };
        let mut logits = lm_head_logits(self.lm_head.as_ref(), self.target.as_ref(), &normed)?;
        if self.logit_scale != 1.0 {
            logits = (logits * self.logit_scale)?;
        }
        match &self.draft_to_target {
            Some(ids) => scatter_vocab(&logits, ids, self.target.info().vocab_size, hidden.device()),
            None => Ok(logits),
        }
    }
}
