//! PARD (An et al., arXiv 2504.18583): a draft model that proposes k tokens in ONE forward by
//! appending k-1 mask tokens to its input. The logits at the last real token give draft token 1;
//! the logits at mask i give draft token i+1.
//!
//! Useful acceptance past the first token needs a PARD-trained draft (trained to predict several
//! tokens ahead from mask positions); with an ordinary draft model the mechanics and losslessness
//! hold, but tokens 2..k are rarely accepted. Each draft token is drawn from its own position's q,
//! and the drafts are drawn independently of each other (that is what one forward allows), which
//! the rejection sampler handles like any other q.
//!
//! Invariant: the mask positions never stay in the draft cache; after a propose it holds exactly
//! the context, and after `observe` the context plus nothing more (the accepted draft tokens were
//! never fed, so the next propose feeds them).

use std::sync::Arc;

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::KvBytes;
use crate::model::{CausalLm, LogitRows};
use crate::proposer::draft_model::{DraftBuilder, DraftCache, DraftDrawing, DraftSampler};
use crate::proposer::{Draft, Feedback, Proposer};

pub struct PardProposer {
    cache: DraftCache,
    mask_token_id: u32,
    target_vocab: usize,
    drawing: DraftDrawing,
    sampler: Option<DraftSampler>,
}

impl PardProposer {
    pub fn new(
        draft: Arc<dyn CausalLm>,
        mask_token_id: u32,
        max_model_len: Option<usize>,
        target_vocab: usize,
        drawing: DraftDrawing,
        kv_bytes: Arc<KvBytes>,
    ) -> Result<Self> {
        let vocab = draft.info().vocab_size;
        if mask_token_id as usize >= vocab {
            return Err(Error::config(format!(
                "mask_token_id {mask_token_id} is outside the draft's vocabulary (size {vocab}); \
                 use the mask token the PARD draft was trained with"
            )));
        }
        Ok(Self {
            cache: DraftCache::new(draft, max_model_len, kv_bytes),
            mask_token_id,
            target_vocab,
            drawing,
            sampler: None,
        })
    }
}

impl Proposer for PardProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        let vocab = self.cache.model.info().vocab_size;
        self.sampler = Some(DraftSampler::new(params, vocab, self.target_vocab, self.drawing));
        // Room for the mask tokens of a 64-token draft beyond the request's own length.
        self.cache.begin(prompt.len() + params.max_tokens + crate::spec_config::MAX_SPECULATIVE_TOKENS)
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if max_tokens == 0 || !self.cache.fits(context.len() + max_tokens - 1) {
            return Ok(Draft::default());
        }
        let sampler =
            self.sampler.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let unseen = self.cache.catch_up(context);
        let mut input = context[unseen..].to_vec();
        let num_real = input.len();
        input.resize(num_real + max_tokens - 1, self.mask_token_id);
        let logits = self.cache.forward(&input, LogitRows::All)?; // [input.len(), draft_vocab]
        self.cache.truncate(context.len());
        let vocab = logits.len() / input.len();
        let mut draft = DraftBuilder::after(context.len());
        for row in logits.chunks(vocab).skip(num_real - 1) {
            if !draft.push(sampler.draw(row, draft.next_position())) {
                break;
            }
        }
        Ok(draft.build())
    }

    fn observe(&mut self, feedback: &Feedback<'_>) -> Result<()> {
        self.cache.observe(feedback.num_accepted_tokens);
        Ok(())
    }

    fn finish(&mut self, _generated: &[u32]) {
        self.cache.release();
    }

    fn kv_len(&self) -> Option<usize> {
        Some(self.cache.len())
    }
}
