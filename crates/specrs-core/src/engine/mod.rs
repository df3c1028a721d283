//! `Engine`: a loaded model, its tokenizer, and what its requests share (metrics, the cost
//! table, draft models, suffix trees, KV byte counters). One file per concept:
//! - `device.rs`: the device string and the cache directory;
//! - `proposers.rs`: the proposer factory (`Speculation` for a config) and draft models;
//! - `cost_model.rs`: the verify-cost curve, the draft cost, the expected speedup;
//! - `cost_worker.rs`: the cost figures and the background thread that measures them;
//! - `session.rs`: one request's decoding state, stepped as plan -> forward -> commit;
//! - `logits_processor.rs`: grammar masks, allowed_token_ids, bad_words, logit_bias, min_tokens
//!   and penalties on verified rows;
//! - `output_text.rs`: a request's text as tokens are committed, stop strings, what a stream shows;
//! - `step_together.rs`: steps of several sessions gathered into one forward;
//! - `scheduler.rs`: continuous batching: requests admitted, batched, budgeted, preempted;
//! - `direct.rs`: teacher-forced forwards (logits, hidden states, a multi-sequence batch);
//! - `suffix_persistence.rs`: the engine-wide suffix caches saved to and loaded from a file;
//! - `suffix_sharing.rs`: suffix caches fed from, and read out for, other engines (Ray replicas);
//! - `tree_chooser.rs`: chain or tree, and how big, per step from costs and acceptance.
//!
//! Invariant: the engine's shared state is only ever read or replaced whole under its locks
//! (`lock`), so one request's panic never leaves another a half-updated state.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::DType;

use self::acceptance_prior::AcceptanceFigures;
use self::cost_worker::CostBook;
use crate::chat_template::ChatMessage;
use crate::constraint::{Constraint, ConstraintCompiler, GrammarCache, GrammarSource, GrammarSpec};
use crate::costs::DiskCache;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::{KvBytes, KvCache, KvLayout, PagedPool};
use crate::metrics::EngineMetrics;
use crate::model::candle::decoder::{Decoder, WeightFormat};
use crate::model::llama_config::LlamaConfig;
use crate::model::{self, CausalLm, GraphMode, GraphStatus};
use crate::proposer::heads::load::LoadedHead;
use crate::proposer::suffix::SuffixCache;
use crate::quantize::parse_quant_type;
use crate::spec_config::HeadMethod;
use crate::tokenizer::TextTokenizer;

pub mod acceptance_prior;
pub mod cost_model;
pub mod cost_worker;
pub mod device;
pub mod direct;
mod kv_account;
pub mod logits_processor;
pub mod output_text;
pub mod proposers;
pub mod scheduler;
pub mod session;
pub mod step_together;
pub mod suffix_persistence;
pub mod suffix_sharing;
pub mod tree_chooser;

pub use cost_model::{ExpectedSpeedup, PolicyCosts};
pub use cost_worker::CostStatus;
pub use device::{cache_dir, parse_device};
pub use proposers::{Speculation, MAX_SUFFIX_CACHES};
pub use session::{FinishReason, Generation, PlanLimits, Session, StepOutput, StepPlan, StopReason, TokenLogprobs};

/// Bytes the target's captured steps may hold by default (`Engine::set_step_graphs`): their
/// activation estimates summed.
pub const DEFAULT_GRAPH_MEMORY: usize = 4 << 30;

/// Bytes of weights and KV caches, for `Engine::memory`. KV figures count the caches of requests
/// in flight now, and the most held at once since the engine loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    pub target_weight_bytes: usize,
    /// Every draft model and head loaded so far (layer_skip drafts share the target's weights,
    /// heads its embedding and, except EAGLE-3, its LM head).
    pub draft_weight_bytes: usize,
    pub target_kv_bytes: usize,
    pub draft_kv_bytes: usize,
    pub peak_target_kv_bytes: usize,
    pub peak_draft_kv_bytes: usize,
    /// The engine-wide suffix caches (at most `MAX_SUFFIX_CACHES`): how many, and their bytes.
    pub num_suffix_caches: usize,
    pub suffix_cache_bytes: usize,
}

/// A loaded head's identity: its method, its path, and the quantization of its linear weights.
type HeadKey = (HeadMethod, PathBuf, Option<String>);

pub struct Engine {
    /// The target's GGUF file (None for a model built in memory).
    path: Option<PathBuf>,
    model: Arc<dyn CausalLm>,
    tokenizer: Arc<TextTokenizer>,
    metrics: Arc<Mutex<EngineMetrics>>,
    /// Suffix decoding's global trees, one per distinct suffix config (so benchmark runs of
    /// different configs never see each other's responses), least recently used first; at most
    /// `MAX_SUFFIX_CACHES`.
    suffix_caches: Mutex<Vec<(String, Arc<Mutex<SuffixCache>>)>>,
    /// The suffix config `prepare` was given (the engine's default), never evicted.
    pinned_suffix_config: Mutex<Option<String>>,
    /// Verification curves and draft costs (costs.rs), shared by every request, kept on disk
    /// across processes, and measured by a background thread while no request runs
    /// (cost_worker.rs).
    costs: Arc<CostBook>,
    /// Each model-based draft's per-token acceptance, measured once from its first requests
    /// (acceptance_prior.rs).
    acceptance: Arc<AcceptanceFigures>,
    /// Draft models by file path, loaded once and shared by every request.
    drafts: Mutex<HashMap<PathBuf, proposers::LoadedDraft>>,
    /// Hidden-state heads by method, path and quantization, loaded once and shared by every request.
    heads: Mutex<HashMap<HeadKey, LoadedHead>>,
    /// The file or directory the target was loaded from (an MTP head's default checkpoint).
    checkpoint: Option<PathBuf>,
    target_kv: Arc<KvBytes>,
    draft_kv: Arc<KvBytes>,
    /// The target's sequences' shared block pool under `KvLayout::Paged`; `None`: contiguous.
    kv_pool: Option<Arc<PagedPool>>,
    /// Grammars' token environment, built on the first constrained request (it walks the whole
    /// vocabulary once) and shared by every later one.
    constraint_compiler: Mutex<Option<Arc<ConstraintCompiler>>>,
    /// The grammars `constraint_compiler` compiled, kept so that one asked for again (the
    /// server's check, then the request's start; the same schema on many requests) is not
    /// compiled again. It locks itself (`GrammarCache::lock`).
    grammar_cache: GrammarCache,
}

impl Engine {
    /// A GGUF file, or a Hugging Face directory (config.json, *.safetensors, tokenizer.json).
    pub fn load(path: impl AsRef<Path>, device: &str) -> Result<Self> {
        Self::load_capped(path, device, None)
    }

    /// `load`, with the context capped at `max_model_len` tokens (vLLM's `--max-model-len`;
    /// `model::loader::cap_context`): prompts and KV caches never pass it.
    pub fn load_capped(path: impl AsRef<Path>, device: &str, max_model_len: Option<usize>) -> Result<Self> {
        let device = parse_device(device)?;
        let path = path.as_ref();
        if path.is_dir() {
            let (mut config, mut weights) = model::hf_dir::open(path, &device)?;
            model::loader::cap_context(&mut config, max_model_len, &path.display().to_string())?;
            let model = Decoder::from_hf(&mut weights, config)?;
            let mut engine = Self::from_model(Arc::new(model), TextTokenizer::from_hf_dir(path)?, None)?;
            engine.checkpoint = Some(path.to_path_buf());
            return Ok(engine);
        }
        let mut gguf = GgufFile::open(path)?;
        let model: Arc<dyn CausalLm> = Arc::from(model::loader::load_capped(&mut gguf, &device, max_model_len)?);
        let tokenizer = TextTokenizer::from_gguf(&gguf)?;
        Self::from_model(model, tokenizer, Some(gguf.path.clone()))
    }

    /// A Llama of `config`'s shape with seeded random weights in `dtype` (bf16, f16, f32 or a GGUF
    /// quantization such as q8_0) on `device`, with the numbered tokenizer (`t0 t1 ...`): for
    /// measuring speed and numerics without a model file.
    pub fn random_llama(config: LlamaConfig, seed: u64, dtype: &str, device: &str) -> Result<Self> {
        let format = match dtype {
            "bf16" | "bfloat16" => WeightFormat::Dense(DType::BF16),
            "f16" | "float16" => WeightFormat::Dense(DType::F16),
            "f32" | "float32" => WeightFormat::Dense(DType::F32),
            quantized => WeightFormat::Quantized(parse_quant_type(quantized).map_err(|_| {
                Error::config(format!(
                    "unknown dtype '{quantized}'; use 'bf16', 'f16', 'f32' or a GGUF quantization (q8_0, q4_k, ...)"
                ))
            })?),
        };
        let tokenizer = TextTokenizer::numbered(config.vocab_size)?;
        let model = Decoder::random(&config, seed, format, &parse_device(device)?)?;
        Self::from_model(Arc::new(model), tokenizer, None)
    }

    /// An engine over a model already built; `path` is its GGUF file, if it has one.
    pub fn from_model(model: Arc<dyn CausalLm>, tokenizer: TextTokenizer, path: Option<PathBuf>) -> Result<Self> {
        if tokenizer.vocab_size() > model.info().vocab_size {
            let source = path.as_ref().map_or_else(|| "the model".to_string(), |p| p.display().to_string());
            return Err(Error::model_load(format!(
                "{source}: the tokenizer has {} tokens but the embedding only {} rows; the file is corrupt",
                tokenizer.vocab_size(),
                model.info().vocab_size
            )));
        }
        let device = format!("{:?}", model.device().location());
        let cost_cache = path.as_ref().and_then(|p| {
            let threads = candle_core::utils::get_num_threads();
            DiskCache::for_model(&cache_dir(), p, &device, model.info().kernels, threads)
        });
        let target_kv = Arc::<KvBytes>::default();
        let costs = Arc::new(CostBook::new(model.clone(), target_kv.clone(), cost_cache));
        Ok(Self {
            checkpoint: path.clone(),
            path,
            model,
            tokenizer: Arc::new(tokenizer),
            metrics: Arc::default(),
            suffix_caches: Mutex::default(),
            pinned_suffix_config: Mutex::default(),
            costs,
            acceptance: Arc::default(),
            drafts: Mutex::default(),
            heads: Mutex::default(),
            target_kv,
            draft_kv: Arc::default(),
            kv_pool: None,
            constraint_compiler: Mutex::default(),
            grammar_cache: GrammarCache::default(),
        })
    }

    /// Lays out the target's KV caches of requests started from now on as `layout`
    /// (contiguous by default). A paged pool lives where the model keeps its cache: f16 rows on
    /// the host for the CPU decoder, or tensors in the model's dtype on its candle device.
    pub fn with_kv_layout(mut self, layout: KvLayout) -> Result<Self> {
        self.kv_pool = match layout {
            KvLayout::Contiguous => None,
            KvLayout::Paged { block_size, num_blocks } => Some(self.model.new_paged_pool(block_size, num_blocks)?),
        };
        self.set_step_graphs(false, DEFAULT_GRAPH_MEMORY);
        Ok(self)
    }

    /// Captures the target's paged steps as CUDA graphs within `budget_bytes` (their
    /// activation estimates summed: `model/candle/step_graphs.rs`), or runs them eagerly
    /// (`enforce_eager`, vLLM's name). Graphs need the paged layout on a CUDA device: elsewhere
    /// steps run eagerly whatever this says. On by default there (`DEFAULT_GRAPH_MEMORY`).
    /// Graphs captured before are dropped.
    pub fn set_step_graphs(&self, enforce_eager: bool, budget_bytes: usize) {
        let on = !enforce_eager && self.kv_pool.is_some() && self.model.device().is_cuda();
        self.model.capture_steps(if on { GraphMode::Device } else { GraphMode::Off }, budget_bytes);
    }

    /// Where the target's captured steps stand (None for a model that captures none).
    pub fn step_graph_status(&self) -> Option<GraphStatus> {
        self.model.step_graph_status()
    }

    /// The target's block pool, when its KV layout is paged.
    pub fn kv_pool(&self) -> Option<&Arc<PagedPool>> {
        self.kv_pool.as_ref()
    }

    /// A cache for one request on the target, in the engine's layout, with room for `reserve`
    /// positions (contiguous; paged takes blocks as the sequence grows).
    fn new_target_cache(&self, reserve: usize) -> Result<KvCache> {
        let cache = match &self.kv_pool {
            Some(pool) => KvCache::paged(pool, self.model.info().context_length),
            None => self.model.new_cache(reserve.max(1))?,
        };
        Ok(cache.tracked_by(self.target_kv.clone()))
    }

    /// Bytes of weights and KV caches.
    pub fn memory(&self) -> Result<MemoryReport> {
        let draft_weight_bytes = lock(&self.drafts)?.values().map(|d| d.model.weight_bytes()).sum::<usize>()
            + lock(&self.heads)?.values().map(|h| h.weight_bytes).sum::<usize>();
        let suffix_caches: Vec<_> = lock(&self.suffix_caches)?.iter().map(|(_, cache)| cache.clone()).collect();
        let mut suffix_cache_bytes = 0;
        for cache in &suffix_caches {
            suffix_cache_bytes += lock(cache)?.memory_bytes();
        }
        Ok(MemoryReport {
            num_suffix_caches: suffix_caches.len(),
            suffix_cache_bytes,
            target_weight_bytes: self.model.weight_bytes(),
            draft_weight_bytes,
            target_kv_bytes: self.target_kv.live(),
            draft_kv_bytes: self.draft_kv.live(),
            peak_target_kv_bytes: self.target_kv.peak(),
            peak_draft_kv_bytes: self.draft_kv.peak(),
        })
    }

    /// Sums over every finished request since the engine loaded (or since `reset_metrics`).
    pub fn metrics(&self) -> Result<EngineMetrics> {
        Ok(lock(&self.metrics)?.clone())
    }

    pub fn reset_metrics(&self) -> Result<()> {
        *lock(&self.metrics)? = EngineMetrics::default();
        Ok(())
    }

    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.model
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }

    /// The grammar compiler for this engine's tokenizer, built on first use.
    pub fn constraint_compiler(&self) -> Result<Arc<ConstraintCompiler>> {
        let mut slot = lock(&self.constraint_compiler)?;
        if let Some(compiler) = slot.as_ref() {
            return Ok(compiler.clone());
        }
        let compiler = Arc::new(ConstraintCompiler::new(&self.tokenizer)?);
        *slot = Some(compiler.clone());
        Ok(compiler)
    }

    /// `spec`'s constraint at the start of the output, the caller's own copy: from the grammar
    /// cache, or compiled (and kept) when it is not there. A spec that fails to compile fails
    /// with `ConstraintCompiler::compile`'s error every time. Counts the compile or the cache hit
    /// in `metrics` (`num_grammar_compiles`, `num_grammar_cache_hits`).
    pub fn compile_grammar(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let found = self.grammar_cache.get_or_compile(spec, |spec| self.constraint_compiler()?.compile(spec));
        let mut metrics = lock(&self.metrics)?;
        match &found {
            Ok((_, GrammarSource::Cache)) => metrics.num_grammar_cache_hits += 1,
            Ok((_, GrammarSource::Compiled)) | Err(_) => metrics.num_grammar_compiles += 1,
        }
        found.map(|(constraint, _)| constraint)
    }

    /// Prompt text for chat `messages` from the model's own template, with OpenAI's `tools` in
    /// the template's `tools` variable when given.
    pub fn render_chat(&self, messages: &[ChatMessage], tools: Option<&serde_json::Value>) -> Result<String> {
        self.tokenizer.require_chat_template()?.render_with_tools(messages, true, tools)
    }

    /// Prompt token ids for chat `messages` (`TextTokenizer::encode_chat`): special-token text in
    /// the messages and tools is plain text unless `allow_special_tokens_in_content`.
    pub fn chat_prompt_ids(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        allow_special_tokens_in_content: bool,
    ) -> Result<Vec<u32>> {
        self.tokenizer.encode_chat(messages, tools, allow_special_tokens_in_content)
    }

    /// Whether the model's chat template renders a request's tools itself.
    pub fn chat_template_renders_tools(&self) -> Result<bool> {
        Ok(self.tokenizer.require_chat_template()?.renders_tools())
    }
}

impl Drop for Engine {
    /// The cost thread stops at its next try (it holds only the book and the model).
    fn drop(&mut self) {
        self.costs.shutdown();
    }
}

/// Locks one of the engine's shared states, recovering it when an earlier panic (caught at the
/// FFI, so the process lives on) poisoned the lock: refusing every later request instead would let
/// one bad request take the engine down. That is safe for each state this guards, because none
/// is left inconsistent by a panic part way through its critical section:
/// - `metrics`: sums of finished requests; at worst one request is counted in part (statistics
///   only, never a request's output);
/// - `drafts`, `heads`: maps whose entries are inserted whole; `pinned_suffix_config` and
///   `constraint_compiler`: replaced whole;
/// - the cost table (cost_worker.rs, which locks it the same way): a curve is extended, and a
///   draft cost inserted, only after its measurement finished (a panic while measuring leaves the
///   figures it had);
/// - `suffix_caches`: a list whose entry is moved to the back by a remove and a push; a panic
///   between the two drops that cache, which is then rebuilt empty (drafts only cost speed);
/// - the shared suffix trees behind `suffix_caches` are not locked here: `SuffixProposer` locks
///   them itself and empties a poisoned one, since a tree can be left half-updated.
///
/// It still returns a `Result` so callers keep their `?` (it never fails).
fn lock<T>(mutex: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    Ok(mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
}

#[cfg(test)]
mod lock_tests {
    #[test]
    fn a_poisoned_lock_is_recovered_with_its_value() {
        let mutex = std::sync::Arc::new(std::sync::Mutex::new(7));
        let poisoner = mutex.clone();
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().unwrap();
            panic!("poison the lock");
        })
        .join();
        assert!(mutex.is_poisoned());
        assert_eq!(*super::lock(&mutex).unwrap(), 7);
    }
}
