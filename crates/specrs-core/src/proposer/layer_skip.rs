//! Self-speculative drafts from the target's own first N layers (`"method": "layer_skip"`, as in
//! LayerSkip and Draft & Verify): embed -> blocks 0..N -> final norm -> LM head.
//!
//! No extra weights and no extra KV cache: the draft reads and writes the target's cache for
//! layers 0..N. Every block is row-independent, so the keys and values the draft writes for a
//! token in those layers are exactly what the target's verify forward writes for it; the context
//! needs no draft prefill at all.
//!
//! Invariant: `propose_with` returns the target cache at the length it found it (the
//! draft tokens' positions are dropped; the verify forward rewrites them in every layer).
//! Acceptance depends on how well the early layers already predict the next token: models trained
//! with early-exit loss (LayerSkip checkpoints) do well, others (SmolLM2) poorly.

use std::sync::Arc;

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::model::{CausalLm, LogitRows};
use crate::proposer::draft_model::{DraftBuilder, DraftDrawing, DraftSampler};
use crate::proposer::{Draft, ProposeInput, Proposer};

pub struct LayerSkipProposer {
    target: Arc<dyn CausalLm>,
    exit_layer: usize,
    drawing: DraftDrawing,
    sampler: Option<DraftSampler>,
}

impl LayerSkipProposer {
    pub fn new(target: Arc<dyn CausalLm>, exit_layer: usize, drawing: DraftDrawing) -> Result<Self> {
        let num_layers = target.info().num_layers;
        if exit_layer == 0 || exit_layer >= num_layers {
            return Err(Error::config(format!(
                "exit_layer must be in 1..{num_layers} for this {num_layers}-layer model (got {exit_layer}); \
                 try {}",
                (num_layers / 4).max(1)
            )));
        }
        Ok(Self { target, exit_layer, drawing, sampler: None })
    }
}

impl Proposer for LayerSkipProposer {
    fn begin(&mut self, _prompt: &[u32], params: &SamplingParams) -> Result<()> {
        let vocab = self.target.info().vocab_size;
        self.sampler = Some(DraftSampler::new(params, vocab, vocab, self.drawing));
        Ok(())
    }

    fn propose(&mut self, _context: &[u32], _max_tokens: usize) -> Result<Draft> {
        Err(Error::Internal("layer_skip drafts run on the target's cache; call propose_with".into()))
    }

    fn propose_with(&mut self, input: ProposeInput<'_>) -> Result<Draft> {
        let ProposeInput { context, max_tokens, target_cache, .. } = input;
        let sampler =
            self.sampler.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let start = target_cache.len();
        if max_tokens == 0 || start >= context.len() {
            return Ok(Draft::default());
        }
        let mut draft = DraftBuilder::after(context.len());
        let mut input = context[start..].to_vec();
        let result = (|| -> Result<()> {
            loop {
                let logits = self.target.forward_early_exit(&input, target_cache, self.exit_layer, LogitRows::Last)?;
                let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?; // [draft_vocab]
                let go_on = draft.push(sampler.draw(&logits, draft.next_position()));
                if !go_on || draft.len() >= max_tokens {
                    return Ok(());
                }
                input = vec![draft.last()];
            }
        })();
        target_cache.truncate(start);
        result?;
        Ok(draft.build())
    }
}
