//! Hidden-state heads: small networks trained on the target's hidden states that draft from them.
//! EAGLE-1/2 and EAGLE-3 (`eagle.rs`), MTP layers (`mtp.rs`), IBM's MLP speculator
//! (`mlp_speculator.rs`) and Medusa (`medusa.rs`), loaded from the checkpoints the field publishes
//! (`load.rs`).
//!
//! Two shapes of head share one proposer (`HeadProposer`):
//! - recurrent heads (EAGLE, EAGLE-3, MTP) run a decoder layer with their own KV cache over the
//!   context, pairing the target's hidden state at position j with the token at j + 1, then draft
//!   autoregressively, feeding their own output hidden state back;
//! - parallel heads (MLP speculator, Medusa) draft token i from the target's last hidden state
//!   (and, for the MLP speculator, from the tokens drawn before it) with their i-th head.
//!
//! Every drafted token is drawn from the head's own distribution q after the request's sampling
//! settings and goes to the same verifier as every other draft, with q, so greedy output equals
//! plain decoding and sampling is exact rejection sampling.
//!
//! Invariant: a head writes no target cache. Its own cache holds one position per context
//! position whose target hidden state it has read (`fed`), and nothing past it between drafts:
//! positions written while drafting are truncated away before `propose` returns, and the accepted
//! tokens' positions are recomputed from the target's own hidden states at the next draft.

pub mod eagle;
pub mod layer;
pub mod load;
pub mod medusa;
pub mod mlp_speculator;
pub mod mtp;
pub mod weights;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::config::SamplingParams;
use crate::error::{Error, Result};
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::{CausalLm, Tap};
use crate::proposer::draft_model::{DraftBuilder, DraftSampler, DraftedToken};
use crate::proposer::{Draft, Proposer};
use weights::Linear;

/// A head that drafts autoregressively with its own decoder layer(s) and KV cache.
pub trait RecurrentHead: Send + Sync {
    /// The target hidden states it reads, concatenated in this order into one row per position.
    fn taps(&self) -> Vec<Tap>;
    /// One empty cache per decoder layer of the head.
    fn new_caches(&self, capacity: usize, kv_bytes: &Arc<KvBytes>) -> Result<Vec<KvCache>>;
    /// Reads context rows: `target_hidden` `[n, taps width]` of positions `start..start + n` and
    /// `next_tokens` `[n]` (the token after each). Returns the head's output hidden states
    /// `[n, hidden_size]`; the last row drafts the first token.
    fn extend(
        &self,
        caches: &mut [KvCache],
        target_hidden: &Tensor,
        next_tokens: &[u32],
        start: usize,
    ) -> Result<Tensor>;
    /// Draft step `step` (1 for the second draft token) at `position` (the drawn token's position
    /// minus one, as for context rows): from the previous output hidden `[1, hidden_size]` and the
    /// token drawn from it, the next output hidden `[1, hidden_size]`.
    fn step(&self, caches: &mut [KvCache], hidden: &Tensor, token: u32, step: usize, position: usize)
        -> Result<Tensor>;
    /// Logits `[n, target_vocab]` f32 of output hidden states `[n, hidden_size]` made by draft
    /// step `step` (0: `extend`), since heads with several layers have one LM head each. A head
    /// with a draft vocabulary puts -inf on every target token outside it.
    fn logits(&self, hidden: &Tensor, step: usize) -> Result<Tensor>;
}

/// A head that drafts token i with its i-th sub-head from the target's last hidden state.
pub trait ParallelHead: Send + Sync {
    /// The target hidden state it reads (one tap).
    fn tap(&self) -> Tap;
    /// How many tokens it can draft per step.
    fn num_heads(&self) -> usize;
    /// Sub-head `i`: from `state` `[1, width]` (the target's hidden state for `i == 0`) and the
    /// token before the one it drafts, logits `[1, target_vocab]` and the state sub-head `i + 1`
    /// reads.
    fn step(&self, i: usize, state: &Tensor, token: u32) -> Result<(Tensor, Tensor)>;
}

/// A loaded head, shared by every request of an engine.
#[derive(Clone)]
pub enum Head {
    Recurrent(Arc<dyn RecurrentHead>),
    Parallel(Arc<dyn ParallelHead>),
}

impl Head {
    pub fn taps(&self) -> Vec<Tap> {
        match self {
            Head::Recurrent(h) => h.taps(),
            Head::Parallel(h) => vec![h.tap()],
        }
    }

    /// The most tokens one draft may hold (a parallel head has one sub-head per token).
    pub fn max_draft_tokens(&self) -> Option<usize> {
        match self {
            Head::Recurrent(_) => None,
            Head::Parallel(h) => Some(h.num_heads()),
        }
    }
}

/// One request's head proposer.
pub struct HeadProposer {
    head: Head,
    method: &'static str,
    target_vocab: usize,
    confidence_threshold: f32,
    kv_bytes: Arc<KvBytes>,
    sampler: Option<DraftSampler>,
    /// Recurrent heads' caches (one per head layer).
    caches: Vec<KvCache>,
    /// Context positions whose target hidden states the head has read into its caches.
    fed: usize,
    /// Target hidden rows not read yet: positions `fed..fed + pending rows`, taps concatenated.
    pending: Vec<Tensor>,
    pending_rows: usize,
    /// Each draft step's logits `[target_vocab]`, when recording (`Engine::head_draft`).
    recorded: Option<Vec<Vec<f32>>>,
}

impl HeadProposer {
    pub fn new(
        head: Head,
        method: &'static str,
        target_vocab: usize,
        confidence_threshold: f32,
        kv_bytes: Arc<KvBytes>,
    ) -> Self {
        Self {
            head,
            method,
            target_vocab,
            confidence_threshold,
            kv_bytes,
            sampler: None,
            caches: Vec::new(),
            fed: 0,
            pending: Vec::new(),
            pending_rows: 0,
            recorded: None,
        }
    }

    /// Keeps every draft step's logits from now on (`take_recorded`): what the golden tests
    /// compare with the reference implementations.
    pub fn record_logits(&mut self) {
        self.recorded = Some(Vec::new());
    }

    pub fn take_recorded(&mut self) -> Vec<Vec<f32>> {
        self.recorded.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// A draft token from `logits` (`[1, target_vocab]`), recorded when recording.
    fn draw(&mut self, logits: &Tensor) -> Result<DraftedToken> {
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let sampler =
            self.sampler.as_mut().ok_or_else(|| Error::Internal("head proposer used before begin()".into()))?;
        let token = sampler.draw(&logits);
        if let Some(recorded) = self.recorded.as_mut() {
            recorded.push(logits);
        }
        Ok(token)
    }

    fn internal(&self, what: &str) -> Error {
        Error::Internal(format!("the {} head {what}", self.method))
    }

    /// The pending target rows `[n, width]` with their first position, taken out of `pending`.
    fn take_pending(&mut self, context_len: usize) -> Result<(Tensor, usize)> {
        // The target has read every context token but the newest: its rows cover 0..len - 1.
        if self.fed + self.pending_rows != context_len - 1 || self.pending_rows == 0 {
            return Err(self.internal(&format!(
                "has target hidden states up to position {} for a context of {context_len} tokens",
                self.fed + self.pending_rows
            )));
        }
        let rows = if self.pending.len() == 1 { self.pending.remove(0) } else { Tensor::cat(&self.pending, 0)? };
        self.pending.clear();
        let start = self.fed;
        self.pending_rows = 0;
        Ok((rows, start))
    }

    fn draft_recurrent(&mut self, head: &Arc<dyn RecurrentHead>, context: &[u32], max_tokens: usize) -> Result<Draft> {
        let (target_hidden, start) = self.take_pending(context.len())?;
        let n = target_hidden.dim(0)?;
        let out = head.extend(&mut self.caches, &target_hidden, &context[start + 1..start + 1 + n], start)?; // [n, hidden]
        self.fed = start + n;
        let mut hidden = out.narrow(0, n - 1, 1)?;
        let cache_lens: Vec<usize> = self.caches.iter().map(KvCache::len).collect();
        let mut draft = DraftBuilder::default();
        let mut step = 0;
        loop {
            let token = self.draw(&head.logits(&hidden, step)?)?;
            if !draft.push(token) || draft.len() >= max_tokens {
                break;
            }
            step += 1;
            // As a context row pairs position j's hidden state with token j + 1, the row of draft
            // token `step` is at the position before it: fed + step - 1.
            hidden = head.step(&mut self.caches, &hidden, draft.last(), step, self.fed + step - 1)?;
        }
        // Positions written while drafting came from the head's own guesses: drop them.
        for (cache, len) in self.caches.iter_mut().zip(cache_lens) {
            cache.truncate(len);
        }
        Ok(draft.build())
    }

    fn draft_parallel(&mut self, head: &Arc<dyn ParallelHead>, context: &[u32], max_tokens: usize) -> Result<Draft> {
        let (target_hidden, start) = self.take_pending(context.len())?;
        self.fed = start + target_hidden.dim(0)?;
        // The hidden state of the newest token's predecessor: it predicted the newest token.
        let mut state = target_hidden.narrow(0, target_hidden.dim(0)? - 1, 1)?;
        let mut token = context[context.len() - 1];
        let mut draft = DraftBuilder::default();
        for i in 0..max_tokens.min(head.num_heads()) {
            let (logits, next_state) = head.step(i, &state, token)?;
            let confident = draft.push(self.draw(&logits)?);
            token = draft.last();
            state = next_state;
            if !confident {
                break;
            }
        }
        Ok(draft.build())
    }
}

impl Proposer for HeadProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        self.sampler = Some(DraftSampler::new(params, self.target_vocab, self.target_vocab, self.confidence_threshold));
        self.caches = match &self.head {
            Head::Recurrent(head) => head.new_caches(prompt.len() + params.max_tokens, &self.kv_bytes)?,
            Head::Parallel(_) => Vec::new(),
        };
        self.fed = 0;
        self.pending.clear();
        self.pending_rows = 0;
        Ok(())
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if max_tokens == 0 {
            return Ok(Draft::default());
        }
        match self.head.clone() {
            Head::Recurrent(head) => self.draft_recurrent(&head, context, max_tokens),
            Head::Parallel(head) => self.draft_parallel(&head, context, max_tokens),
        }
    }

    fn taps(&self) -> Vec<Tap> {
        self.head.taps()
    }

    fn target_context_dropped(&mut self) {
        // Its own caches follow the target's hidden rows position by position: refed from 0 too.
        for cache in &mut self.caches {
            cache.truncate(0);
        }
        self.fed = 0;
        self.pending.clear();
        self.pending_rows = 0;
    }

    fn observe_hidden(&mut self, start: usize, hidden: &[Tensor]) -> Result<()> {
        if start != self.fed + self.pending_rows {
            return Err(self.internal(&format!(
                "was handed target hidden states from position {start}, but expected {}",
                self.fed + self.pending_rows
            )));
        }
        let rows = if hidden.len() == 1 { hidden[0].clone() } else { Tensor::cat(hidden, 1)? }; // [n, taps width]
        let n = rows.dim(0)?;
        if let Head::Parallel(_) = self.head {
            // Only the newest row is ever read.
            self.fed += self.pending_rows + n - 1;
            self.pending = vec![rows.narrow(0, n - 1, 1)?];
            self.pending_rows = 1;
            return Ok(());
        }
        self.pending.push(rows);
        self.pending_rows += n;
        Ok(())
    }

    fn finish(&mut self, _generated: &[u32]) {
        self.caches.clear();
        self.pending.clear();
    }

    fn kv_len(&self) -> Option<usize> {
        self.caches.first().map(KvCache::len)
    }
}

/// Embedding rows `[tokens.len(), hidden]` f32 from the head's own table, or the target's.
pub(crate) fn embed_rows(own: Option<&Tensor>, target: &dyn CausalLm, tokens: &[u32]) -> Result<Tensor> {
    match own {
        Some(table) => Ok(table.index_select(&Tensor::new(tokens, table.device())?, 0)?),
        None => Ok(target.embed(tokens)?.to_dtype(DType::F32)?),
    }
}

/// Logits `[n, vocab]` f32 of `normed` `[n, hidden]` from the head's own LM head, or the target's.
pub(crate) fn lm_head_logits(own: Option<&Linear>, target: &dyn CausalLm, normed: &Tensor) -> Result<Tensor> {
    match own {
        Some(head) => head.forward(normed),
        None => Ok(target.lm_head(normed, None)?.to_dtype(DType::F32)?),
    }
}

/// RMSNorm over the last dimension.
pub(crate) fn rms(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps)?)
}

/// Scatters draft-vocabulary logits `[n, draft_vocab]` into target-vocabulary rows
/// `[n, target_vocab]` through `draft_to_target` (`[draft_vocab]` u32 target ids), -inf elsewhere.
pub(crate) fn scatter_vocab(
    logits: &Tensor,
    draft_to_target: &Tensor,
    target_vocab: usize,
    device: &Device,
) -> Result<Tensor> {
    let n = logits.dim(0)?;
    let full = Tensor::full(f32::NEG_INFINITY, (n, target_vocab), device)?;
    let index = draft_to_target.unsqueeze(0)?.repeat((n, 1))?.contiguous()?;
    Ok(full.scatter(&index, &logits.contiguous()?, 1)?)
}
