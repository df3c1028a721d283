//! Teacher-forced forwards outside any request: logits, hidden states at taps (what head
//! training reads), one forward over several sequences (tests and benches), and a head's greedy
//! draft with its logits (the heads' golden tests).
//!
//! Invariant: each call builds its own caches and leaves no state behind.

use super::Engine;
use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{ForwardBatch, LogitRows, SeqRows, Tap};
use crate::proposer::draft_model::DraftDrawing;
use crate::proposer::heads::HeadProposer;
use crate::proposer::Proposer;
use crate::spec_config::{HeadMethod, Method, SpeculativeConfig};

/// A head's draft tokens and the logits `[steps][vocab]` it recorded (`Engine::head_draft`).
pub type HeadDraft = (Vec<u32>, Vec<Vec<f32>>);

impl Engine {
    /// Teacher-forced logits `[ids.len(), vocab_size]` (row-major) from one forward over `ids`.
    pub fn logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.logits_in_steps(ids, &[ids.len()])
    }

    /// `logits` computed as consecutive forwards of `steps[i]` tokens over one cache: a prefill
    /// then cached multi-token steps, whose rows must equal one forward's.
    pub fn logits_in_steps(&self, ids: &[u32], steps: &[usize]) -> Result<Vec<f32>> {
        if ids.is_empty() || steps.iter().sum::<usize>() != ids.len() || steps.contains(&0) {
            return Err(Error::config(format!(
                "logits() needs at least one token, and steps of at least one token summing to {} (got {steps:?})",
                ids.len()
            )));
        }
        let vocab = self.model.info().vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::config(format!(
                "logits(): token id {bad} is outside the vocabulary (size {vocab}); pass ids below {vocab}"
            )));
        }
        let mut cache = self.model.new_cache(ids.len())?;
        let mut rows = Vec::with_capacity(ids.len() * self.model.info().vocab_size);
        let mut start = 0;
        for &step in steps {
            rows.extend(self.model.forward(&ids[start..start + step], &mut cache)?.flatten_all()?.to_vec1::<f32>()?);
            start += step;
        }
        Ok(rows)
    }
}

/// One sequence's share of `Engine::forward_batch`.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqForward {
    /// `[num_logit_rows, vocab_size]` row-major.
    pub logits: Vec<f32>,
    pub num_logit_rows: usize,
    /// Per tap, `[num_rows, hidden_size]` row-major.
    pub hidden: Vec<Vec<f32>>,
}

impl Engine {
    /// Hidden states of one teacher-forced forward over `ids`, per tap `[ids.len(), hidden_size]`
    /// row-major (the input head training reads; see model/forward.rs for the tap convention).
    pub fn hidden_states(&self, ids: &[u32], taps: &[Tap]) -> Result<Vec<Vec<f32>>> {
        if ids.is_empty() {
            return Err(Error::config("hidden_states() needs at least one token"));
        }
        let mut out = self.forward_batch(&[(Vec::new(), SeqRows::chain(ids.to_vec(), LogitRows::None))], taps)?;
        Ok(out.remove(0).hidden)
    }

    /// One forward over several sequences: each `(prefix, rows)` gets a fresh cache in the
    /// engine's KV layout holding `prefix` (run by a forward of its own), then every sequence's
    /// `rows` (a chain or a tree) run in ONE forward (on a paged pool, captured or replayed as
    /// the engine's steps are). Returns each sequence's logits and hidden rows.
    pub fn forward_batch(&self, seqs: &[(Vec<u32>, SeqRows)], taps: &[Tap]) -> Result<Vec<SeqForward>> {
        if seqs.is_empty() {
            return Err(Error::config("forward_batch() needs at least one sequence"));
        }
        let context = self.model.info().context_length;
        let mut caches = Vec::with_capacity(seqs.len());
        for (s, (prefix, rows)) in seqs.iter().enumerate() {
            let needed = prefix.len() + rows.tokens.len();
            if needed > context {
                return Err(Error::ContextLength(format!(
                    "sequence {s} needs {needed} positions but the model's context is {context} tokens; shorten it"
                )));
            }
            let mut cache = self.new_target_cache(needed)?;
            if !prefix.is_empty() {
                self.model.forward_rows(prefix, &mut cache, LogitRows::None)?;
            }
            caches.push(cache);
        }
        let rows: Vec<SeqRows> = seqs.iter().map(|(_, rows)| rows.clone()).collect();
        let lens: Vec<usize> = caches.iter().map(KvCache::len).collect();
        let batch = ForwardBatch::new(&rows, &lens, taps.to_vec())?;
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let out = self.model.forward_batch(&batch, &mut refs)?;
        let vocab = self.model.info().vocab_size;
        let logits: Vec<f32> = out.logits.flatten_all()?.to_vec1()?;
        let hidden: Vec<Vec<f32>> =
            out.hidden.iter().map(|h| Ok(h.flatten_all()?.to_vec1()?)).collect::<Result<_>>()?;
        let width = self.model.info().hidden_size;
        let mut logit_start = 0;
        Ok((0..batch.num_seqs())
            .map(|s| {
                let num_logit_rows = rows[s].logit_rows.len();
                let seq_logits = logits[logit_start * vocab..(logit_start + num_logit_rows) * vocab].to_vec();
                logit_start += num_logit_rows;
                let range = batch.seq_range(s);
                let seq_hidden = hidden.iter().map(|h| h[range.start * width..range.end * width].to_vec()).collect();
                SeqForward { logits: seq_logits, num_logit_rows, hidden: seq_hidden }
            })
            .collect())
    }

    /// The greedy draft of `num_tokens` tokens that `config`'s head proposes after `prompt_ids`,
    /// with its logits at each step (`[num_tokens][vocab_size]`, -inf outside a draft
    /// vocabulary): the target runs over the prompt but its newest token, as in a request, and the
    /// head drafts from its hidden states (a draft shorter than `num_tokens` where the config's
    /// `draft_confidence_threshold` ends it). The heads' golden tests compare these with the
    /// reference implementations.
    pub fn head_draft(&self, config: &SpeculativeConfig, prompt_ids: &[u32], num_tokens: usize) -> Result<HeadDraft> {
        let mut steps = self.head_draft_steps(config, &[prompt_ids.to_vec()], num_tokens)?;
        Ok(steps.remove(0))
    }

    /// `head_draft` at each of `contexts` in turn, as one request's steps: each context extends
    /// the one before it (accepted drafts and the target's token), and the target and the head
    /// read only the positions that are new, so the head's own cache carries over between steps.
    pub fn head_draft_steps(
        &self,
        config: &SpeculativeConfig,
        contexts: &[Vec<u32>],
        num_tokens: usize,
    ) -> Result<Vec<HeadDraft>> {
        let Method::Head { method, model, quantization } = &config.method else {
            return Err(Error::config(format!(
                "head_draft needs a head method ({}), not '{}'",
                HeadMethod::ALL.map(HeadMethod::name).join(", "),
                config.method_name()
            )));
        };
        let (Some(first), Some(last)) = (contexts.first(), contexts.last()) else {
            return Err(Error::config("head_draft_steps needs at least one context"));
        };
        if first.len() < 2 || num_tokens == 0 {
            return Err(Error::config("head_draft needs a prompt of at least 2 tokens and num_tokens >= 1"));
        }
        if contexts.windows(2).any(|w| w[1].len() <= w[0].len() || !w[1].starts_with(&w[0])) {
            return Err(Error::config("head_draft_steps: each context must extend the one before it"));
        }
        let head = self.head(*method, model.as_deref(), quantization.as_deref())?.head;
        let vocab = self.model.info().vocab_size;
        // Coupled, as the greedy draft is; the config's confidence threshold applies.
        let drawing = DraftDrawing { confidence_threshold: config.draft_confidence_threshold, ..DraftDrawing::COUPLED };
        let mut proposer = HeadProposer::new(head, method.name(), vocab, drawing, self.draft_kv.clone());
        proposer.record_logits();
        let params = SamplingParams { max_tokens: num_tokens + 1, temperature: 0.0, ..SamplingParams::default() };
        proposer.begin(last, &params)?;
        let mut cache = self.model.new_cache(last.len())?;
        let mut read = 0;
        let mut steps = Vec::with_capacity(contexts.len());
        for context in contexts {
            // The target reads every token but the newest, as in a request.
            let mut batch = ForwardBatch::chain(&context[read..context.len() - 1], read, LogitRows::None)?;
            batch.taps = proposer.taps();
            let hidden = self.model.forward_batch(&batch, &mut [&mut cache])?.hidden;
            proposer.observe_hidden(read, &hidden)?;
            read = context.len() - 1;
            let draft = proposer.propose(context, num_tokens)?;
            steps.push((draft.token_ids, proposer.take_recorded()));
        }
        Ok(steps)
    }
}
