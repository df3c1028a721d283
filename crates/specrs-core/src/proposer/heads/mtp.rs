//! Multi-token prediction layers (DeepSeek-V3, arXiv 2412.19437 §2.2; GLM-4.5, MiMo and Qwen3-Next
//! ship them inside the target's checkpoint): each MTP layer predicts the token after next from
//! the target's last hidden state `h_j` and the embedding of the next token `x_{j+1}`.
//!
//! One layer: `eh_proj` over the normed pair (`[enorm(embedding); hnorm(h)]` for DeepSeek-V3,
//! GLM-4.5 and Qwen3-Next; MiMo puts the hidden state first), then a full decoder block (with its
//! input norm), then the layer's own final norm (`shared_head.norm`) and LM head (its
//! `shared_head.head`, or the target's). Later draft steps feed the block's output back as `h`
//! (before the final norm; MiMo applies its final norm inside the layer and feeds the normed
//! value). With several MTP layers, draft step s uses layer `s % num_layers`, as vLLM cycles them;
//! every layer reads the context, so each has a full cache; a layer's draft rows keep their own
//! positions (a layer skips the positions the others drafted).
//!
//! EAGLE-2's dynamic tree runs the same steps batched over a depth's frontier (`step_tree`): step
//! s's rows go to layer `s % num_layers`'s cache and attend to its context rows and to the rows
//! of their ancestors that the same layer drafted, as a chain run of their path does.
//!
//! Invariant: as for every recurrent head (heads/mod.rs), each layer's cache holds one row per
//! context position read, and draft rows are truncated after drafting.

use std::sync::Arc;

use candle_core::Tensor;

use super::layer::{HeadLayer, Rows, TreeRows};
use super::weights::Linear;
use super::{embed_rows, lm_head_logits, rms, row_share, RecurrentHead};
use crate::error::Result;
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::{CausalLm, Tap};

pub struct MtpLayer {
    /// `[hidden]` norms of the embedding and of the hidden state.
    pub enorm: Tensor,
    pub hnorm: Tensor,
    /// `[hidden, 2 * hidden]`.
    pub eh_proj: Linear,
    /// MiMo: `[hnorm(h); enorm(embedding)]`; the rest: embedding first.
    pub hidden_first: bool,
    /// The block's input norm `[hidden]`.
    pub input_norm: Tensor,
    pub block: HeadLayer,
    /// `[hidden]` norm before the LM head.
    pub final_norm: Tensor,
    /// MiMo applies `final_norm` inside the layer, so the normed state is fed back.
    pub norm_inside: bool,
    /// The layer's own LM head; None: the target's.
    pub head: Option<Linear>,
}

pub struct MtpHead {
    pub layers: Vec<MtpLayer>,
    /// The layer's own embedding table `[vocab, hidden]`; None: the target's.
    pub embed: Option<Tensor>,
    /// vLLM's DeepSeek-style and MiMo MTP layers zero the embedding at position 0 (speculators'
    /// do not).
    pub mask_position_zero: bool,
    pub target: Arc<dyn CausalLm>,
    pub rms_eps: f32,
}

impl MtpHead {
    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        embed_rows(self.embed.as_ref(), self.target.as_ref(), tokens)
    }

    /// Layer `l` over `embeds` and `hidden` (`[n, hidden]` each) as new rows of `cache`.
    fn run(&self, l: usize, cache: &mut KvCache, embeds: &Tensor, hidden: &Tensor, rows: Rows) -> Result<Tensor> {
        let layer = &self.layers[l];
        let eps = self.rms_eps;
        let mut embeds = rms(embeds, &layer.enorm, eps)?;
        let positions = rows.positions(embeds.dim(0)?);
        if self.mask_position_zero && positions.contains(&0) {
            let keep: Vec<f32> = positions.iter().map(|&p| if p == 0 { 0.0 } else { 1.0 }).collect();
            let keep = Tensor::from_vec(keep, (positions.len(), 1), embeds.device())?; // [n, 1]
            embeds = embeds.broadcast_mul(&keep)?;
        }
        let hidden = rms(hidden, &layer.hnorm, eps)?;
        let pair = if layer.hidden_first { [&hidden, &embeds] } else { [&embeds, &hidden] };
        let x = layer.eh_proj.forward(&Tensor::cat(&pair, 1)?)?; // [n, hidden]
        let out = layer.block.forward(&rms(&x, &layer.input_norm, eps)?, &x, cache, rows)?;
        if layer.norm_inside {
            return rms(&out, &layer.final_norm, eps);
        }
        Ok(out)
    }
}

impl RecurrentHead for MtpHead {
    fn taps(&self) -> Vec<Tap> {
        vec![Tap::FinalNorm]
    }

    fn new_caches(&self, capacity: usize, kv_bytes: &Arc<KvBytes>) -> Result<Vec<KvCache>> {
        self.layers.iter().map(|l| l.block.new_cache(capacity, kv_bytes)).collect()
    }

    fn extend(
        &self,
        caches: &mut [KvCache],
        target_hidden: &Tensor,
        next_tokens: &[u32],
        start: usize,
    ) -> Result<Tensor> {
        let embeds = self.embed(next_tokens)?;
        let mut first = None;
        for (l, cache) in caches.iter_mut().enumerate() {
            let out = self.run(l, cache, &embeds, target_hidden, Rows::Chain(start))?;
            first.get_or_insert(out);
        }
        Ok(first.expect("an MTP head has at least one layer (load.rs)"))
    }

    fn step(
        &self,
        caches: &mut [KvCache],
        hidden: &Tensor,
        token: u32,
        step: usize,
        position: usize,
    ) -> Result<Tensor> {
        let l = step % self.layers.len();
        self.run(l, &mut caches[l], &self.embed(&[token])?, hidden, Rows::Chain(position))
    }

    fn drafts_trees(&self) -> bool {
        true
    }

    fn step_cache(&self, step: usize) -> usize {
        step % self.layers.len()
    }

    fn step_tree(
        &self,
        caches: &mut [KvCache],
        hidden: &Tensor,
        tokens: &[u32],
        step: usize,
        rows: &TreeRows,
    ) -> Result<Tensor> {
        let l = step % self.layers.len();
        self.run(l, &mut caches[l], &self.embed(tokens)?, hidden, Rows::Tree(rows))
    }

    /// A context row runs every MTP layer (each keeps a cache of the context); a draft step one
    /// layer and its LM head.
    fn context_row_share(&self) -> f64 {
        let weights = |l: &MtpLayer| l.eh_proj.num_weights() + l.block.num_weights();
        let first = &self.layers[0];
        row_share(self.layers.iter().map(weights).sum(), weights(first), first.head.as_ref(), self.target.as_ref())
    }

    fn logits(&self, hidden: &Tensor, step: usize) -> Result<Tensor> {
        let layer = &self.layers[step % self.layers.len()];
        let normed = if layer.norm_inside { hidden.clone() } else { rms(hidden, &layer.final_norm, self.rms_eps)? };
        lm_head_logits(layer.head.as_ref(), self.target.as_ref(), &normed)
    }
}
