//! `Engine` (a loaded model and its tokenizer) and `Session` (one request's decoding state).
//!
//! `Session::step` runs ONE target forward and appends the token(s) it yields; `generate` and the
//! Python stream are loops over it.
//!
//! Invariant: after every step, the cache holds exactly the prompt plus every generated token but
//! the newest one (which the next forward consumes), so `cache.len() == all_ids.len() - 1`.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;

use crate::chat_template::ChatMessage;
use crate::config::SamplingParams;
use crate::detokenizer::IncrementalDetokenizer;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;
use crate::metrics::{RequestMetrics, RequestTimer};
use crate::model::{self, CausalLm, LogitRows};
use crate::sampler::Sampler;
use crate::tokenizer::TextTokenizer;

/// Parses a device string: "cpu", "cuda" or "cuda:N".
pub fn parse_device(device: &str) -> Result<Device> {
    match device {
        "cpu" => Ok(Device::Cpu),
        d if d == "cuda" || d.starts_with("cuda:") => Err(Error::Device(format!(
            "device '{d}' needs a CUDA build of specrs, and this one is CPU-only; use device='cpu'"
        ))),
        other => Err(Error::config(format!("unknown device '{other}'; use 'cpu' or 'cuda[:N]'"))),
    }
}

pub struct Engine {
    model: Arc<dyn CausalLm>,
    tokenizer: Arc<TextTokenizer>,
}

impl Engine {
    pub fn load(path: impl AsRef<Path>, device: &str) -> Result<Self> {
        let device = parse_device(device)?;
        let mut gguf = GgufFile::open(path)?;
        let model: Arc<dyn CausalLm> = Arc::from(model::load(&mut gguf, &device)?);
        let tokenizer = TextTokenizer::from_gguf(&gguf)?;
        if tokenizer.vocab_size() > model.info().vocab_size {
            return Err(Error::model_load(format!(
                "{}: the tokenizer has {} tokens but the embedding only {} rows; the file is corrupt",
                gguf.path.display(),
                tokenizer.vocab_size(),
                model.info().vocab_size
            )));
        }
        Ok(Self { model, tokenizer: Arc::new(tokenizer) })
    }

    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.model
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }

    /// Prompt text for chat `messages` from the model's own template.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self.tokenizer.chat_template().ok_or_else(|| {
            Error::config(
                "this model has no chat template (tokenizer.chat_template); pass the prompt as a plain string",
            )
        })?;
        template.render(messages, true)
    }

    /// Starts a request. Fails with `ContextLength` when prompt + max_tokens exceeds the context.
    pub fn start(&self, prompt_ids: Vec<u32>, params: SamplingParams) -> Result<Session> {
        params.validate()?;
        if prompt_ids.is_empty() {
            return Err(Error::config("the prompt is empty; pass at least one token"));
        }
        let vocab = self.model.info().vocab_size;
        if let Some(bad) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::config(format!("prompt token id {bad} is outside the vocabulary (size {vocab})")));
        }
        let context = self.model.info().context_length;
        let needed = prompt_ids.len() + params.max_tokens;
        if needed > context {
            return Err(Error::ContextLength(format!(
                "this model's maximum context length is {context} tokens, but {needed} were requested \
                 ({} in the prompt, {} max_tokens); shorten the prompt or lower max_tokens",
                prompt_ids.len(),
                params.max_tokens
            )));
        }
        let cache = self.model.new_cache(needed)?;
        Ok(Session {
            model: self.model.clone(),
            tokenizer: self.tokenizer.clone(),
            cache,
            prompt_len: prompt_ids.len(),
            detokenizer: IncrementalDetokenizer::new(prompt_ids.len()),
            all_ids: prompt_ids,
            sampler: Sampler::new(params.seed),
            params,
            timer: RequestTimer::new(),
            num_forward_passes: 0,
            text: String::new(),
            finish_reason: None,
        })
    }

    /// Runs a request to completion.
    pub fn generate(&self, prompt_ids: Vec<u32>, params: SamplingParams) -> Result<Generation> {
        let mut session = self.start(prompt_ids, params)?;
        while !session.is_finished() {
            session.step()?;
        }
        Ok(session.result())
    }

    /// Teacher-forced logits `[ids.len(), vocab_size]` (row-major) from one forward over `ids`.
    pub fn logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::config("logits() needs at least one token"));
        }
        let mut cache = self.model.new_cache(ids.len())?;
        Ok(self.model.forward(ids, &mut cache)?.flatten_all()?.to_vec1()?)
    }

    /// Verification cost curve: median seconds of one forward over `n` new tokens on top of a
    /// cache holding `context_ids`, for each `n` in `ns`. The `n` values are interleaved within
    /// each repeat so slow drift of the machine affects them alike.
    pub fn forward_cost(&self, context_ids: &[u32], ns: &[usize], repeats: usize) -> Result<Vec<(usize, f64)>> {
        let max_n = ns.iter().copied().max().unwrap_or(1);
        let mut cache: KvCache = self.model.new_cache(context_ids.len() + max_n)?;
        self.model.forward_rows(context_ids, &mut cache, LogitRows::Last)?;
        let probe: Vec<u32> = context_ids.iter().rev().take(max_n).copied().collect();
        if probe.len() < max_n {
            return Err(Error::config(format!("forward_cost needs at least {max_n} context tokens")));
        }
        let mut times = vec![Vec::with_capacity(repeats); ns.len()];
        for _ in 0..repeats.max(1) {
            for (slot, &n) in ns.iter().enumerate() {
                cache.truncate(context_ids.len());
                let t0 = Instant::now();
                self.model.forward(&probe[..n], &mut cache)?;
                times[slot].push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(ns
            .iter()
            .zip(times)
            .map(|(&n, mut t)| {
                t.sort_by(f64::total_cmp);
                (n, t[t.len() / 2])
            })
            .collect())
    }
}

/// Why a request stopped, with vLLM's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated.
    Stop,
    /// max_tokens was reached.
    Length,
    /// The caller stopped the request (a cancelled stream).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What one step produced.
pub struct StepOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
}

/// A finished (or stopped) request.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    pub metrics: RequestMetrics,
}

pub struct Session {
    model: Arc<dyn CausalLm>,
    tokenizer: Arc<TextTokenizer>,
    cache: KvCache,
    /// Prompt followed by every generated token.
    all_ids: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    sampler: Sampler,
    detokenizer: IncrementalDetokenizer,
    timer: RequestTimer,
    num_forward_passes: usize,
    text: String,
    finish_reason: Option<FinishReason>,
}

impl Session {
    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    pub fn generated_ids(&self) -> &[u32] {
        &self.all_ids[self.prompt_len..]
    }

    /// One target forward (the whole prompt on the first call) and the token it yields.
    pub fn step(&mut self) -> Result<StepOutput> {
        if self.is_finished() {
            return Ok(StepOutput { token_ids: Vec::new(), text: String::new() });
        }
        let unseen = &self.all_ids[self.cache.len()..];
        let logits = self.model.forward_rows(unseen, &mut self.cache, LogitRows::Last)?; // [1, vocab]
        self.num_forward_passes += 1;
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let token = self.sampler.sample(&logits, &self.params);
        self.all_ids.push(token);
        self.timer.tokens_arrived(1);
        let new_ids = vec![token];

        let is_eos = self.tokenizer.eos_token_ids().contains(&token);
        if is_eos && !self.params.ignore_eos {
            self.finish_reason = Some(FinishReason::Stop);
        } else if self.generated_ids().len() >= self.params.max_tokens {
            self.finish_reason = Some(FinishReason::Length);
        }
        let mut text = self.detokenizer.next(&self.tokenizer, &self.all_ids)?;
        if self.is_finished() {
            text.push_str(&self.detokenizer.finish(&self.tokenizer, &self.all_ids)?);
        }
        self.text.push_str(&text);
        Ok(StepOutput { token_ids: new_ids, text })
    }

    /// Stops the request early (a cancelled stream); its result keeps what was generated.
    pub fn abort(&mut self) {
        if self.finish_reason.is_none() {
            self.finish_reason = Some(FinishReason::Abort);
        }
    }

    pub fn metrics(&self) -> RequestMetrics {
        self.timer.metrics(self.prompt_len, self.num_forward_passes)
    }

    pub fn result(&self) -> Generation {
        Generation {
            prompt_token_ids: self.all_ids[..self.prompt_len].to_vec(),
            token_ids: self.generated_ids().to_vec(),
            text: self.text.clone(),
            finish_reason: self.finish_reason,
            metrics: self.metrics(),
        }
    }
}
