//! The classic draft model (`"method": "draft_model"`, also used by `quantized_self`): a smaller
//! or cheaper model with the target's tokenizer drafts k tokens autoregressively, each drawn from
//! its own distribution q after the request's sampling settings.
//!
//! Also home to the two pieces the other model-based drafts share: `DraftSampler` (logits -> a
//! draft token, its q row and its confidence) and `DraftCache` (the draft model's KV cache and the
//! tokens it holds).
//!
//! Invariant: after `observe(num_accepted)`, the draft cache holds at most the context plus the
//! accepted draft tokens, the same prefix the target keeps; the next `propose` feeds only what the
//! draft has not seen. A request longer than the draft's `max_model_len` gets no drafts past that
//! length (as in vLLM); the metrics show it as steps without drafts.

use std::sync::Arc;

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::{CausalLm, LogitRows};
use crate::proposer::{Draft, Feedback, Proposer};
use crate::sampler::{argmax, probabilities, Sampler};

/// Mixed into the request seed so the draft's random stream differs from the verifier's.
const DRAFT_SEED_SALT: u64 = 0x5eed_d4af_7000_0001;

/// Turns draft logits into a draft token and its q row.
pub(crate) struct DraftSampler {
    params: SamplingParams,
    sampler: Sampler,
    /// Size of the target's vocabulary: the width of every q row.
    target_vocab: usize,
    /// Draft ids at or above this are never drafted (padded draft embeddings, or a draft
    /// vocabulary larger than the target's).
    usable_vocab: usize,
    confidence_threshold: f32,
}

/// One drafted token.
pub(crate) struct DraftedToken {
    pub token_id: u32,
    /// `[target_vocab]` q row; None for greedy requests (q is one-hot on the argmax).
    pub probs: Option<Vec<f32>>,
    /// False when the draft's probability of this token is below the confidence threshold: the
    /// token is kept and drafting stops after it (transformers' `assistant_confidence_threshold`).
    pub confident: bool,
}

impl DraftSampler {
    pub fn new(params: &SamplingParams, draft_vocab: usize, target_vocab: usize, confidence_threshold: f32) -> Self {
        Self {
            params: params.clone(),
            sampler: Sampler::new(params.seed.map(|s| s ^ DRAFT_SEED_SALT)),
            target_vocab,
            usable_vocab: draft_vocab.min(target_vocab),
            confidence_threshold,
        }
    }

    /// `logits`: `[draft_vocab]` for one position.
    pub fn draw(&mut self, logits: &[f32]) -> DraftedToken {
        let logits = &logits[..self.usable_vocab];
        if self.params.is_greedy() {
            let token_id = argmax(logits);
            let confident = self.confidence_threshold <= 0.0 || {
                // softmax(logits)[argmax] = 1 / sum(exp(l - l_max))
                let max = logits[token_id as usize];
                let total: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
                1.0 / total >= self.confidence_threshold
            };
            return DraftedToken { token_id, probs: None, confident };
        }
        let mut q = probabilities(logits, &self.params);
        let token_id = self.sampler.draw(&q);
        let confident = q[token_id as usize] >= self.confidence_threshold;
        q.resize(self.target_vocab, 0.0);
        DraftedToken { token_id, probs: Some(q), confident }
    }
}

/// Collects drafted tokens into a `Draft`.
#[derive(Default)]
pub(crate) struct DraftBuilder {
    token_ids: Vec<u32>,
    probs: Vec<f32>,
    has_probs: bool,
}

impl DraftBuilder {
    /// Adds a token; returns whether drafting may continue (it was confident).
    pub fn push(&mut self, token: DraftedToken) -> bool {
        self.token_ids.push(token.token_id);
        if let Some(q) = token.probs {
            self.has_probs = true;
            self.probs.extend_from_slice(&q);
        }
        token.confident
    }

    /// The newest token (call after a push).
    pub fn last(&self) -> u32 {
        self.token_ids[self.token_ids.len() - 1]
    }

    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    pub fn build(self) -> Draft {
        Draft { token_ids: self.token_ids, probs: self.has_probs.then_some(self.probs), parents: None }
    }
}

/// A draft model's KV cache and the tokens it holds, rolled back with the target's.
pub(crate) struct DraftCache {
    pub model: Arc<dyn CausalLm>,
    cache: Option<KvCache>,
    /// `cache.len()` tokens: what the cache holds.
    cached_ids: Vec<u32>,
    max_model_len: usize,
    kv_bytes: Arc<KvBytes>,
    /// Context length at the last propose; `observe` keeps this many plus the accepted tokens.
    proposed_at: usize,
}

impl DraftCache {
    pub fn new(model: Arc<dyn CausalLm>, max_model_len: Option<usize>, kv_bytes: Arc<KvBytes>) -> Self {
        let context = model.info().context_length;
        Self {
            model,
            cache: None,
            cached_ids: Vec::new(),
            max_model_len: max_model_len.unwrap_or(context).min(context),
            kv_bytes,
            proposed_at: 0,
        }
    }

    /// Allocates the cache for a request that may reach `max_len` tokens. The prompt is not
    /// prefilled here: the first propose feeds everything the draft has not seen (`catch_up`), so a
    /// request whose draft length policy never drafts never pays for the draft's prefill.
    pub fn begin(&mut self, max_len: usize) -> Result<()> {
        // The model's own cache kind (host for cpu/decoder.rs, device for candle/decoder.rs, which runs
        // drafts on CUDA); `fits` keeps it within max_model_len.
        let cache = self.model.new_cache(max_len.min(self.max_model_len))?;
        self.cache = Some(cache.tracked_by(self.kv_bytes.clone()));
        self.cached_ids.clear();
        Ok(())
    }

    /// Whether the draft can hold `len` positions.
    pub fn fits(&self, len: usize) -> bool {
        len <= self.max_model_len
    }

    /// Rolls back to the longest prefix shared with `context`, keeping the last context token
    /// unseen so the next forward has something to consume; returns where the unseen part of
    /// `context` starts.
    pub fn catch_up(&mut self, context: &[u32]) -> usize {
        let shared = self.cached_ids.iter().zip(context).take_while(|(a, b)| a == b).count();
        let keep = shared.min(context.len().saturating_sub(1));
        self.truncate(keep);
        self.proposed_at = context.len();
        keep
    }

    /// One draft forward over `token_ids`: logits `[rows, draft_vocab]`, row-major. A draft whose
    /// vocabulary is a prefix of the target's cannot read the target's extra tokens (ids past its
    /// own embedding): it reads token 0 in their place, which can only make its guesses worse,
    /// never the output, since every guess is verified. `cached_ids` keeps the real ids.
    pub fn forward(&mut self, token_ids: &[u32], rows: LogitRows) -> Result<Vec<f32>> {
        let cache = self.cache.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let vocab = self.model.info().vocab_size;
        let readable: Vec<u32> = token_ids.iter().map(|&t| if (t as usize) < vocab { t } else { 0 }).collect();
        let logits = self.model.forward_rows(&readable, cache, rows)?;
        self.cached_ids.extend_from_slice(token_ids);
        Ok(logits.flatten_all()?.to_vec1()?)
    }

    /// Drops positions past `len` (tokens a later forward appended and that must not stay).
    pub fn truncate(&mut self, len: usize) {
        if let Some(cache) = self.cache.as_mut() {
            cache.truncate(len.min(cache.len()));
        }
        self.cached_ids.truncate(len);
    }

    pub fn observe(&mut self, num_accepted: usize) {
        self.truncate(self.proposed_at + num_accepted);
    }

    pub fn len(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::len)
    }

    /// Frees the cache at the end of a request.
    pub fn release(&mut self) {
        self.cache = None;
        self.cached_ids.clear();
    }
}

pub struct DraftModelProposer {
    cache: DraftCache,
    target_vocab: usize,
    confidence_threshold: f32,
    sampler: Option<DraftSampler>,
}

impl DraftModelProposer {
    pub fn new(
        draft: Arc<dyn CausalLm>,
        max_model_len: Option<usize>,
        target_vocab: usize,
        confidence_threshold: f32,
        kv_bytes: Arc<KvBytes>,
    ) -> Self {
        Self {
            cache: DraftCache::new(draft, max_model_len, kv_bytes),
            target_vocab,
            confidence_threshold,
            sampler: None,
        }
    }
}

impl Proposer for DraftModelProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        let vocab = self.cache.model.info().vocab_size;
        self.sampler = Some(DraftSampler::new(params, vocab, self.target_vocab, self.confidence_threshold));
        self.cache.begin(prompt.len() + params.max_tokens)
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        // The last draft token is never fed, so the draft needs context + max_tokens - 1 positions.
        if max_tokens == 0 || !self.cache.fits(context.len() + max_tokens - 1) {
            return Ok(Draft::default());
        }
        let sampler =
            self.sampler.as_mut().ok_or_else(|| Error::Internal("draft proposer used before begin()".into()))?;
        let unseen = self.cache.catch_up(context);
        let mut logits = self.cache.forward(&context[unseen..], LogitRows::Last)?; // [1, draft_vocab]
        let mut draft = DraftBuilder::default();
        while draft.push(sampler.draw(&logits)) && draft.len() < max_tokens {
            logits = self.cache.forward(&[draft.last()], LogitRows::Last)?;
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

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::model::candle::decoder::{Decoder, WeightFormat};
    use crate::model::llama_config::LlamaConfig;

    #[test]
    fn a_draft_with_a_smaller_vocabulary_reads_the_targets_extra_tokens_as_token_0() {
        let config = LlamaConfig::from_json(
            r#"{"vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}"#,
        )
        .unwrap();
        let draft: Arc<dyn CausalLm> =
            Arc::new(Decoder::random(&config, 3, WeightFormat::Dense(candle_core::DType::F32), &Device::Cpu).unwrap());
        let target_vocab = 40;
        let mut proposer = DraftModelProposer::new(draft, None, target_vocab, 0.0, Arc::default());
        proposer.begin(&[1, 2, 3], &SamplingParams { max_tokens: 8, ..SamplingParams::default() }).unwrap();
        // Ids 35 and 39 exist only in the target's vocabulary: a draft, not an error.
        let with_extra = proposer.propose(&[1, 35, 2, 39], 3).unwrap();
        assert_eq!(with_extra.token_ids.len(), 3);
        assert!(with_extra.token_ids.iter().all(|&t| t < 32));
        proposer.observe(&Feedback::accepted(0, &[], &[])).unwrap();
        // The same draft as for a context holding token 0 in their place.
        let mut reference =
            DraftModelProposer::new(proposer.cache.model.clone(), None, target_vocab, 0.0, Arc::default());
        reference.begin(&[1, 2, 3], &SamplingParams { max_tokens: 8, ..SamplingParams::default() }).unwrap();
        assert_eq!(reference.propose(&[1, 0, 2, 0], 3).unwrap().token_ids, with_extra.token_ids);
    }
}
