//! `Engine` (a loaded model and its tokenizer) and `Session` (one request's decoding state).
//!
//! `Session::step` runs ONE target forward and appends the token(s) it yields; `generate` and the
//! Python stream are loops over it. With speculation, a step is: propose up to k tokens -> one
//! forward over [last token, draft...] -> verify -> truncate the cache to what was kept ->
//! `proposer.observe` -> emit.
//!
//! Invariant: after every step of an unfinished request, the cache holds exactly the prompt plus
//! every generated token but the newest one (which the next forward consumes), so
//! `cache.len() == all_ids.len() - 1`; rejected draft tokens never stay in the cache.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::chat_template::ChatMessage;
use crate::config::SamplingParams;
use crate::costs::{extend_ratios, median_if_quiet, prior_ratios, CostSource, CostTable, DiskCache, Figure};
use crate::detokenizer::IncrementalDetokenizer;
use crate::draft_length::{DraftLengthPolicy, HeuristicSchedule};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::{KvBytes, KvCache};
use crate::metrics::{
    expected_speedup_refined, expected_speedup_textbook, verify_cost_at, EngineMetrics, RequestMetrics, RequestTimer,
    SpecDecodeMetrics,
};
use crate::model::decoder::{Decoder, WeightFormat};
use crate::model::llama_config::LlamaConfig;
use crate::model::{self, CausalLm, LogitRows};
use crate::proposer::draft_model::DraftModelProposer;
use crate::proposer::layer_skip::LayerSkipProposer;
use crate::proposer::ngram::NgramProposer;
use crate::proposer::pard::PardProposer;
use crate::proposer::suffix::{SuffixCache, SuffixProposer};
use crate::proposer::{Draft, Proposer};
use crate::quantize::{parse_quant_type, requantize_gguf};
use crate::sampler::Sampler;
use crate::spec_config::{Method, Schedule, SpeculativeConfig, MAX_SPECULATIVE_TOKENS};
use crate::tokenizer::TextTokenizer;
use crate::verify::{verify, Verification};

/// Parses a device string: "cpu", "cuda" or "cuda:N".
pub fn parse_device(device: &str) -> Result<Device> {
    let ordinal = match device {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => "0",
        d => match d.strip_prefix("cuda:") {
            Some(n) => n,
            None => return Err(Error::config(format!("unknown device '{d}'; use 'cpu' or 'cuda[:N]'"))),
        },
    };
    let ordinal: usize = ordinal
        .parse()
        .map_err(|_| Error::config(format!("bad device '{device}'; use 'cuda' or 'cuda:N' (N >= 0)")))?;
    if !cfg!(feature = "cuda") {
        return Err(Error::Device(format!(
            "device '{device}' needs a CUDA build of specrs (`make wheel-cuda`), and this one is CPU-only; \
             use device='cpu'"
        )));
    }
    Device::new_cuda(ordinal).map_err(|e| {
        Error::Device(format!(
            "cannot open CUDA device {ordinal} ({e}); check nvidia-smi, the driver (CUDA 13 or newer) \
             and CUDA_VISIBLE_DEVICES, or use device='cpu'"
        ))
    })
}

/// The expected-speedup model evaluated on measured acceptance and costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpectedSpeedup {
    pub textbook: f64,
    pub refined: f64,
    /// c: proposer time per draft relative to one single-token target step.
    pub draft_cost: f64,
    /// v: t(k+1) / t(1).
    pub verify_cost_ratio: f64,
    /// Where the verification curve came from (measured, cached, extrapolated past its end).
    pub verify_cost_source: CostSource,
}

/// One request's speculation: its proposer, k, and how each draft's length is chosen.
pub struct Speculation {
    pub method: &'static str,
    pub num_speculative_tokens: usize,
    pub proposer: Box<dyn Proposer>,
    /// Cost-aware cut (None = verify every draft whole).
    pub draft_length: Option<DraftLengthPolicy>,
    /// transformers' heuristic k schedule (None = constant k).
    pub schedule: Option<HeuristicSchedule>,
    /// Drafts with probabilities stop after a token with q(x) below this (0 = off).
    pub draft_confidence_threshold: f32,
    /// Where the draft-length policy's verification curve and draft cost came from (None
    /// without the policy; no draft cost source for model-free proposers, whose c is 0).
    pub verify_cost_source: Option<CostSource>,
    pub draft_cost_source: Option<CostSource>,
}

/// The costs one config's draft-length policy weighs, with their sources.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyCosts {
    /// `[k + 1]`: v(n) = t(n)/t(1).
    pub verify_cost_ratios: Vec<f64>,
    pub verify_cost_source: CostSource,
    /// c: drafting time per draft token over t(1).
    pub draft_cost: f64,
    pub draft_cost_source: Option<CostSource>,
}

/// The context length the draft-length policy's curve is measured at (or less, for a model whose
/// context cannot hold it beside the longest verify).
const POLICY_CONTEXT_LEN: usize = 512;

/// At most this many engine-wide suffix caches (one per distinct suffix config) are kept. A new
/// config past it evicts the least recently used one other than the engine's own default (requests
/// in flight keep theirs until they end), so clients cycling through configs cannot grow memory
/// without bound nor wipe the default's learned responses.
pub const MAX_SUFFIX_CACHES: usize = 8;

/// Bytes of weights and KV caches, for `Engine::memory`. KV figures count the caches of requests
/// in flight now, and the most held at once since the engine loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    pub target_weight_bytes: usize,
    /// Every draft model loaded so far (layer_skip drafts share the target's weights).
    pub draft_weight_bytes: usize,
    pub target_kv_bytes: usize,
    pub draft_kv_bytes: usize,
    pub peak_target_kv_bytes: usize,
    pub peak_draft_kv_bytes: usize,
    /// The engine-wide suffix caches (at most `MAX_SUFFIX_CACHES`): how many, and their bytes.
    pub num_suffix_caches: usize,
    pub suffix_cache_bytes: usize,
}

/// Where `quantized_self` drafts are written: `$SPECRS_CACHE_DIR`, else `$XDG_CACHE_HOME/specrs`,
/// else `~/.cache/specrs`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPECRS_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map_or_else(|| PathBuf::from(".cache"), |home| PathBuf::from(home).join(".cache"))
    });
    base.join("specrs")
}

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
    /// Verification curves and draft costs (costs.rs), shared by every request.
    costs: Mutex<CostTable>,
    /// Where `costs` persist across processes (None for a model built in memory, or when off).
    cost_cache: Option<DiskCache>,
    /// Whether a figure nobody measured yet may be measured when a request needs it. A server
    /// turns this off once it serves, so no step waits on a measurement: per-request configs then
    /// get the nearest figure (the curve extended past its end, a prior draft cost).
    measure_on_demand: AtomicBool,
    /// Draft models by file path, loaded once and shared by every request.
    drafts: Mutex<HashMap<PathBuf, Arc<dyn CausalLm>>>,
    target_kv: Arc<KvBytes>,
    draft_kv: Arc<KvBytes>,
}

impl Engine {
    /// A GGUF file, or a Hugging Face directory (config.json, *.safetensors, tokenizer.json).
    pub fn load(path: impl AsRef<Path>, device: &str) -> Result<Self> {
        let device = parse_device(device)?;
        let path = path.as_ref();
        if path.is_dir() {
            let (config, mut weights) = model::hf_dir::open(path, &device)?;
            let model = Decoder::from_hf(&mut weights, config)?;
            return Self::from_model(Arc::new(model), TextTokenizer::from_hf_dir(path)?, None);
        }
        let mut gguf = GgufFile::open(path)?;
        let model: Arc<dyn CausalLm> = Arc::from(model::load(&mut gguf, &device)?);
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
        let cost_cache = path
            .as_ref()
            .and_then(|p| DiskCache::for_model(&cache_dir(), p, &device, candle_core::utils::get_num_threads()));
        let costs = cost_cache.as_ref().map(DiskCache::load).unwrap_or_default();
        Ok(Self {
            path,
            model,
            tokenizer: Arc::new(tokenizer),
            metrics: Arc::default(),
            suffix_caches: Mutex::default(),
            pinned_suffix_config: Mutex::default(),
            costs: Mutex::new(costs),
            cost_cache,
            measure_on_demand: AtomicBool::new(true),
            drafts: Mutex::default(),
            target_kv: Arc::default(),
            draft_kv: Arc::default(),
        })
    }

    /// The draft model in the GGUF file at `path`, loaded on first use. Its tokenizer must be the
    /// target's (or a prefix of it): `Error::TokenizerMismatch` otherwise.
    pub fn draft_model(&self, path: impl AsRef<Path>) -> Result<Arc<dyn CausalLm>> {
        let path = path.as_ref();
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        if let Some(draft) = lock(&self.drafts)?.get(&key) {
            return Ok(draft.clone());
        }
        let mut gguf = GgufFile::open(path)?;
        let draft_tokenizer = TextTokenizer::from_gguf(&gguf)?;
        self.tokenizer.check_draft_compatible(&draft_tokenizer, &path.display().to_string())?;
        let draft: Arc<dyn CausalLm> = Arc::from(model::load(&mut gguf, self.model.device())?);
        lock(&self.drafts)?.insert(key, draft.clone());
        Ok(draft)
    }

    /// The target requantized to `quantization` (e.g. "q4_0"), written to `cache_dir()` on first
    /// use (a few seconds) and reused after; the file name records the source's size and mtime, so
    /// a changed target gets a fresh copy.
    pub fn quantized_self_path(&self, quantization: &str) -> Result<PathBuf> {
        let dtype = parse_quant_type(quantization)?;
        let source = self.path.as_ref().ok_or_else(|| {
            Error::config(
                "quantized_self requantizes the target's GGUF file, and this model has none; use another method",
            )
        })?;
        let meta = std::fs::metadata(source)
            .map_err(|e| Error::model_load(format!("cannot stat {}: {e}", source.display())))?;
        let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        let stem = source.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        let name = format!("{stem}.{}-{}.{quantization}.gguf", meta.len(), mtime.map_or(0, |d| d.as_secs()));
        let path = cache_dir().join("quantized_self").join(name);
        if !path.exists() {
            requantize_gguf(source, &path, dtype)?;
        }
        Ok(path)
    }

    /// Bytes of weights and KV caches.
    pub fn memory(&self) -> Result<MemoryReport> {
        let draft_weight_bytes = lock(&self.drafts)?.values().map(|d| d.weight_bytes()).sum();
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

    /// Everything `config` needs before its first request, so that request does not pay for it in
    /// its latency: draft weights loaded (a bad draft fails here), and for the adaptive length the
    /// verification curve up to k + 1 and the draft cost measured (or read from the disk cache).
    /// A suffix config's engine-wide cache is kept from eviction. Call it for the configs a
    /// program or server will use; `Engine(speculative_config=...)` calls it for its own.
    pub fn prepare(&self, config: &SpeculativeConfig) -> Result<PolicyCosts> {
        if matches!(config.method, Method::Suffix(_)) {
            *lock(&self.pinned_suffix_config)? = Some(config.to_json());
        }
        if !matches!(config.method, Method::Custom) {
            self.proposer(config, None)?;
        }
        self.policy_costs(config, true)
    }

    /// Whether a request whose config needs a figure nobody measured yet measures it (default
    /// true). Off, it gets the nearest figure instead: the curve extended past its measured end,
    /// or a prior draft cost, and its metrics say so. A server turns it off once it serves.
    pub fn set_measure_on_demand(&self, on: bool) {
        self.measure_on_demand.store(on, Ordering::Relaxed);
    }

    /// A request's speculation for `config`: the built-in proposer, or `custom` for method
    /// "custom", with the draft-length policy over `policy_costs`.
    pub fn speculation(&self, config: &SpeculativeConfig, custom: Option<Box<dyn Proposer>>) -> Result<Speculation> {
        let proposer = self.proposer(config, custom)?;
        let costs = if config.adaptive_draft_length {
            Some(self.policy_costs(config, self.measure_on_demand.load(Ordering::Relaxed))?)
        } else {
            None
        };
        Ok(Speculation {
            method: config.method_name(),
            num_speculative_tokens: config.num_speculative_tokens,
            proposer,
            draft_length: costs.as_ref().map(|c| DraftLengthPolicy::new(&c.verify_cost_ratios, c.draft_cost)),
            schedule: (config.schedule == Schedule::Heuristic)
                .then(|| HeuristicSchedule::new(config.num_speculative_tokens)),
            draft_confidence_threshold: config.draft_confidence_threshold,
            verify_cost_source: costs.as_ref().map(|c| c.verify_cost_source),
            draft_cost_source: costs.and_then(|c| c.draft_cost_source),
        })
    }

    /// The verification curve `[v(1), ..., v(k+1)]` and draft cost c the draft-length policy of
    /// `config` weighs: the config's own (`verify_cost_ratios`, `draft_cost`), else the engine's,
    /// measured now if `measure` and nobody has yet, else the nearest figure (the curve extended
    /// past its end, a prior). Every request of one engine reads one curve, at one context length,
    /// and measured figures never change, so a seeded request picks the same draft lengths (and so
    /// the same sampled tokens) every time it runs on this engine, whatever ran before it.
    pub fn policy_costs(&self, config: &SpeculativeConfig, measure: bool) -> Result<PolicyCosts> {
        let max_n = config.num_speculative_tokens + 1;
        let (verify_cost_ratios, verify_cost_source) = match &config.costs.verify_cost_ratios {
            Some(given) => match extend_ratios(given, max_n) {
                (ratios, true) => (ratios, CostSource::Extrapolated),
                (ratios, false) => (ratios, CostSource::Config),
            },
            None => match self.curve_s(self.policy_context_len(), max_n, measure)? {
                Some((curve, source)) => (curve.iter().map(|t| t / curve[0]).collect(), source),
                None => (prior_ratios(max_n), CostSource::Prior),
            },
        };
        let (draft_cost, draft_cost_source) = match config.costs.draft_cost {
            Some(c) => (c, Some(CostSource::Config)),
            None => match self.draft_cost(config, measure)? {
                Some((c, source)) => (c, Some(source)),
                None => (0.0, None),
            },
        };
        Ok(PolicyCosts { verify_cost_ratios, verify_cost_source, draft_cost, draft_cost_source })
    }

    /// The policy curve's context: `POLICY_CONTEXT_LEN`, or less where the model's context cannot
    /// hold it plus the longest verify. Fixed per engine, so every k reads the same curve.
    fn policy_context_len(&self) -> usize {
        let context = self.model.info().context_length;
        POLICY_CONTEXT_LEN.min(context.saturating_sub(MAX_SPECULATIVE_TOKENS + 1)).max(1)
    }

    /// c: drafting time per draft token over one target step, for model-based drafts (None for
    /// model-free ones, whose microseconds do not matter). Measured once per draft (on a
    /// 128-token context) when `measure`, else a prior from the draft's size: decoding is
    /// memory-bound, so a draft costs about its weight bytes over the target's per token.
    fn draft_cost(&self, config: &SpeculativeConfig, measure: bool) -> Result<Option<(f64, CostSource)>> {
        let Some(key) = self.draft_identity(config)? else { return Ok(None) };
        if let Some(known) = lock(&self.costs)?.draft_costs.get(&key) {
            return Ok(Some((known.value, known.source)));
        }
        if !measure {
            return Ok(Some((self.prior_draft_cost(config)?, CostSource::Prior)));
        }
        let Some((single_step, _)) = self.curve_s(self.policy_context_len(), 1, true)? else {
            return Err(Error::Internal("the verification curve was not measured".into()));
        };
        let k = config.num_speculative_tokens;
        let vocab = self.model.info().vocab_size as u64;
        let context: Vec<u32> = (0..128u64).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        let mut proposer = self.proposer(config, None)?;
        proposer.begin(&context, &SamplingParams { max_tokens: k + 1, ..SamplingParams::default() })?;
        let mut target_cache = self.model.new_cache(context.len() + k)?;
        if matches!(config.method, Method::LayerSkip { .. }) {
            // Only the layer-skip draft reads the target's cache.
            self.model.forward_rows(&context[..context.len() - 1], &mut target_cache, LogitRows::Last)?;
        }
        let mut times = Vec::new();
        for round in 0..4 {
            let t0 = Instant::now();
            let draft = proposer.propose_with_target_cache(&context, k, &mut target_cache)?;
            self.model.device().synchronize()?;
            if round > 0 {
                // The first round is a warm-up (cold weight pages).
                times.push(t0.elapsed().as_secs_f64() / draft.token_ids.len().max(1) as f64);
            }
            proposer.observe(0)?;
        }
        let (per_token_s, quiet) = median_if_quiet(&times);
        let cost = per_token_s / single_step[0];
        let mut costs = lock(&self.costs)?;
        let figure = Figure::measured(cost, quiet);
        let source = figure.source;
        costs.draft_costs.insert(key, figure);
        if let Some(disk) = &self.cost_cache {
            disk.store(&costs);
        }
        Ok(Some((cost, source)))
    }

    /// What a draft's cost depends on (the draft's weights, how many layers, PARD's k), so every
    /// config drafting alike shares one figure; None for model-free methods.
    fn draft_identity(&self, config: &SpeculativeConfig) -> Result<Option<String>> {
        let file = |path: &Path| {
            let meta = std::fs::metadata(path).ok();
            let mtime = meta
                .as_ref()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
            format!("{}:{}:{}", canonical.display(), meta.map_or(0, |m| m.len()), mtime.map_or(0, |d| d.as_nanos()))
        };
        Ok(match &config.method {
            Method::Ngram { .. } | Method::Suffix(_) | Method::Custom => None,
            Method::DraftModel(d) => Some(format!("draft_model:{}", file(Path::new(&d.model)))),
            Method::Pard { draft, mask_token_id } => Some(format!(
                "pard:{}:{mask_token_id}:k={}",
                file(Path::new(&draft.model)),
                config.num_speculative_tokens
            )),
            Method::QuantizedSelf { quantization, .. } => Some(format!("quantized_self:{quantization}")),
            Method::LayerSkip { exit_layer } => Some(format!("layer_skip:{exit_layer}")),
        })
    }

    /// The prior draft cost per token (see `draft_cost`): a draft model's weight bytes over the
    /// target's (PARD drafts k tokens per forward), a layer-skip draft's share of the layers.
    fn prior_draft_cost(&self, config: &SpeculativeConfig) -> Result<f64> {
        let bytes = |path: &Path| -> Result<f64> {
            Ok(self.draft_model(path)?.weight_bytes() as f64 / self.model.weight_bytes().max(1) as f64)
        };
        Ok(match &config.method {
            Method::Ngram { .. } | Method::Suffix(_) | Method::Custom => 0.0,
            Method::DraftModel(d) => bytes(Path::new(&d.model))?,
            Method::Pard { draft, .. } => bytes(Path::new(&draft.model))? / config.num_speculative_tokens as f64,
            Method::QuantizedSelf { quantization, .. } => bytes(&self.quantized_self_path(quantization)?)?,
            Method::LayerSkip { exit_layer } => *exit_layer as f64 / self.model.info().num_layers.max(1) as f64,
        })
    }

    /// The proposer `config` names (or `custom` for method "custom").
    fn proposer(&self, config: &SpeculativeConfig, custom: Option<Box<dyn Proposer>>) -> Result<Box<dyn Proposer>> {
        let target_vocab = self.model.info().vocab_size;
        let threshold = config.draft_confidence_threshold;
        let proposer: Box<dyn Proposer> = match (&config.method, custom) {
            (Method::Custom, Some(proposer)) => proposer,
            (Method::Custom, None) => {
                return Err(Error::config(
                    "method 'custom' needs a proposer object; pass Engine(..., proposer=obj) or generate(..., proposer=obj)",
                ))
            }
            (_, Some(_)) => {
                return Err(Error::config(format!(
                    "a proposer object was given but the speculative_config method is '{}'; use \"method\": \"custom\"",
                    config.method_name()
                )))
            }
            (Method::Ngram { prompt_lookup_min, prompt_lookup_max }, None) => {
                Box::new(NgramProposer::new(*prompt_lookup_min, *prompt_lookup_max))
            }
            (Method::Suffix(params), None) => Box::new(SuffixProposer::new(params.clone(), self.suffix_cache(config)?)),
            (Method::DraftModel(draft), None) => Box::new(DraftModelProposer::new(
                self.draft_model(&draft.model)?,
                draft.max_model_len,
                target_vocab,
                threshold,
                self.draft_kv.clone(),
            )),
            (Method::QuantizedSelf { quantization, max_model_len }, None) => Box::new(DraftModelProposer::new(
                self.draft_model(self.quantized_self_path(quantization)?)?,
                *max_model_len,
                target_vocab,
                threshold,
                self.draft_kv.clone(),
            )),
            (Method::LayerSkip { exit_layer }, None) => {
                Box::new(LayerSkipProposer::new(self.model.clone(), *exit_layer, threshold)?)
            }
            (Method::Pard { draft, mask_token_id }, None) => Box::new(PardProposer::new(
                self.draft_model(&draft.model)?,
                *mask_token_id,
                draft.max_model_len,
                target_vocab,
                threshold,
                self.draft_kv.clone(),
            )?),
        };
        Ok(proposer)
    }

    /// The engine-wide suffix cache of `config` (created on first use; see `MAX_SUFFIX_CACHES`).
    fn suffix_cache(&self, config: &SpeculativeConfig) -> Result<Arc<Mutex<SuffixCache>>> {
        let Method::Suffix(params) = &config.method else {
            return Err(Error::Internal("suffix_cache needs a suffix config".into()));
        };
        let key = config.to_json();
        let pinned = lock(&self.pinned_suffix_config)?.clone();
        let mut caches = lock(&self.suffix_caches)?;
        let cache = match caches.iter().position(|(k, _)| *k == key) {
            Some(i) => caches.remove(i).1,
            None => {
                if caches.len() >= MAX_SUFFIX_CACHES {
                    let evict = caches.iter().position(|(k, _)| Some(k) != pinned.as_ref()).unwrap_or(0);
                    caches.remove(evict);
                }
                Arc::new(Mutex::new(SuffixCache::new(params.max_tree_depth, params.max_cached_requests)))
            }
        };
        caches.push((key, cache.clone()));
        Ok(cache)
    }

    /// Sums over every finished request since the engine loaded (or since `reset_metrics`).
    pub fn metrics(&self) -> Result<EngineMetrics> {
        Ok(lock(&self.metrics)?.clone())
    }

    pub fn reset_metrics(&self) -> Result<()> {
        *lock(&self.metrics)? = EngineMetrics::default();
        Ok(())
    }

    /// The expected-speedup model for the acceptance in `spec`, or None without drafts (or
    /// without a curve, where measuring on demand is off). k is the mean draft length; the draft
    /// cost c is the mean proposer time per draft over t(1); v is t(k+1)/t(1) from the policy's
    /// verification cost curve.
    pub fn expected_speedup(&self, spec: &SpecDecodeMetrics) -> Result<Option<ExpectedSpeedup>> {
        if spec.num_drafts == 0 {
            return Ok(None);
        }
        let k = spec.mean_draft_length();
        let measure = self.measure_on_demand.load(Ordering::Relaxed);
        // [t(1), ..., t(ceil(k) + 1)]
        let Some((costs, verify_cost_source)) =
            self.curve_s(self.policy_context_len(), k.ceil() as usize + 1, measure)?
        else {
            return Ok(None);
        };
        let t1 = costs[0];
        let ratios: Vec<f64> = costs.iter().map(|t| t / t1).collect();
        let verify_cost_ratio = verify_cost_at(&ratios, k);
        let draft_cost = spec.propose_s / spec.num_drafts as f64 / t1;
        let a = spec.acceptance_rate();
        Ok(Some(ExpectedSpeedup {
            textbook: expected_speedup_textbook(a, k, draft_cost),
            refined: expected_speedup_refined(a, k, draft_cost, verify_cost_ratio),
            draft_cost,
            verify_cost_ratio,
            verify_cost_source,
        }))
    }

    /// Verification cost curve in seconds, `[t(1), ..., t(max_n)]`: one forward over n new tokens
    /// on a `context_len`-token cache (fewer for a model whose context cannot hold both), measured
    /// once and kept (the draft-length policy reads the one at 512 tokens).
    pub fn verify_costs(&self, max_n: usize, context_len: usize) -> Result<Vec<f64>> {
        let context_len = context_len.min(self.model.info().context_length.saturating_sub(max_n)).max(1);
        match self.curve_s(context_len, max_n, true)? {
            Some((costs, _)) => Ok(costs),
            None => Err(Error::Internal("the verification curve was not measured".into())),
        }
    }

    /// `[t(1), ..., t(max_n)]` seconds at `context_len` with its source: the stored curve, grown
    /// by measuring the missing n if `measure` (else extended past its end), or None if nothing is
    /// stored and `measure` is false. The lock is held while measuring, so two requests never time
    /// forwards against each other nor measure one figure twice.
    fn curve_s(&self, context_len: usize, max_n: usize, measure: bool) -> Result<Option<(Vec<f64>, CostSource)>> {
        let max_n = max_n.max(1);
        let mut costs = lock(&self.costs)?;
        let have = costs.curves.get(&context_len).map_or(0, |curve| curve.value.len());
        // A model whose context cannot hold a verify of max_n has the rest extrapolated.
        let measurable = max_n.min(self.model.info().context_length.saturating_sub(context_len)).max(1);
        if measure && have < measurable {
            let (new_costs, quiet) = self.measure_curve(context_len, have + 1, measurable)?;
            costs.extend_curve(context_len, &new_costs, quiet);
            if let Some(disk) = &self.cost_cache {
                disk.store(&costs);
            }
        }
        let Some(Figure { value: curve, source, .. }) = costs.curves.get(&context_len) else { return Ok(None) };
        if curve.len() >= max_n {
            return Ok(Some((curve[..max_n].to_vec(), *source)));
        }
        let t1 = curve[0];
        let (ratios, _) = extend_ratios(&curve.iter().map(|t| t / t1).collect::<Vec<_>>(), max_n);
        Ok(Some((ratios.iter().map(|v| v * t1).collect(), CostSource::Extrapolated)))
    }

    /// `[t(first_n), ..., t(last_n)]`: median seconds of one forward over n new tokens on a
    /// `context_len`-token cache, and whether every timing was quiet (see `costs.rs`). Any tokens
    /// do: a forward's cost does not depend on which it reads.
    fn measure_curve(&self, context_len: usize, first_n: usize, last_n: usize) -> Result<(Vec<f64>, bool)> {
        let vocab = self.model.info().vocab_size as u64;
        let token = |i: usize| ((i as u64 * 7919 + 13) % vocab) as u32;
        let context: Vec<u32> = (0..context_len).map(token).collect();
        let probe: Vec<u32> = (context_len..context_len + last_n).map(token).collect();
        let ns: Vec<usize> = (first_n..=last_n).collect();
        let timings: Vec<(f64, bool)> =
            self.time_forwards(&context, &probe, &ns, 5)?.iter().map(|t| median_if_quiet(t)).collect();
        Ok((timings.iter().map(|t| t.0).collect(), timings.iter().all(|t| t.1)))
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

    /// Starts a request, speculative when `speculation` is given. Fails with `ContextLength` when
    /// prompt + max_tokens exceeds the context.
    pub fn start(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculation: Option<Speculation>,
    ) -> Result<Session> {
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
        let cache = self.model.new_cache(needed)?.tracked_by(self.target_kv.clone());
        let timer = RequestTimer::new();
        let mut speculation = speculation;
        if let Some(speculation) = speculation.as_mut() {
            speculation.proposer.begin(&prompt_ids, &params)?;
        }
        Ok(Session {
            model: self.model.clone(),
            tokenizer: self.tokenizer.clone(),
            cache,
            prompt_len: prompt_ids.len(),
            detokenizer: IncrementalDetokenizer::new(prompt_ids.len()),
            all_ids: prompt_ids,
            sampler: Sampler::new(params.seed),
            params,
            timer,
            num_forward_passes: 0,
            text: String::new(),
            finish_reason: None,
            speculation,
            spec_metrics: SpecDecodeMetrics::default(),
            engine_metrics: self.metrics.clone(),
            prefill_chunk: None,
        })
    }

    /// Runs a request to completion.
    pub fn generate(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculation: Option<Speculation>,
    ) -> Result<Generation> {
        let mut session = self.start(prompt_ids, params, speculation)?;
        while !session.is_finished() {
            session.step()?;
        }
        Ok(session.result())
    }

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

    /// Verification cost curve: median seconds of one forward over `n` new tokens on top of a
    /// cache holding `context_ids`, for each `n` in `ns` (the new tokens are the context's last
    /// ones, reversed).
    pub fn forward_cost(&self, context_ids: &[u32], ns: &[usize], repeats: usize) -> Result<Vec<(usize, f64)>> {
        let max_n = ns.iter().copied().max().unwrap_or(1);
        if ns.contains(&0) || context_ids.len() < max_n {
            return Err(Error::config(format!(
                "forward_cost needs token counts of at least 1 (got {ns:?}) and at least {max_n} context tokens \
                 (got {})",
                context_ids.len()
            )));
        }
        let vocab = self.model.info().vocab_size;
        if let Some(bad) = context_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::config(format!(
                "forward_cost: context token id {bad} is outside the vocabulary (size {vocab}); pass ids below {vocab}"
            )));
        }
        let probe: Vec<u32> = context_ids.iter().rev().take(max_n).copied().collect();
        let timings = self.time_forwards(context_ids, &probe, ns, repeats)?;
        Ok(ns.iter().zip(timings).map(|(&n, t)| (n, median_if_quiet(&t).0)).collect())
    }

    /// Seconds of one forward over `probe[..n]` on top of a cache holding `context_ids`, `repeats`
    /// timings for each `n` in `ns` (each at most `probe.len()`). The `n` values are interleaved within
    /// each repeat so slow drift of the machine affects them alike, and the device is synchronized
    /// inside the timed region, so on a GPU this is the forward's own time, not its launch.
    fn time_forwards(&self, context_ids: &[u32], probe: &[u32], ns: &[usize], repeats: usize) -> Result<Vec<Vec<f64>>> {
        let mut cache: KvCache = self.model.new_cache(context_ids.len() + probe.len())?;
        self.model.forward_rows(context_ids, &mut cache, LogitRows::Last)?;
        // One untimed round first: the first forwards after loading touch cold weight pages, which
        // would inflate t(1) and deflate every ratio t(n)/t(1).
        for &n in ns {
            cache.truncate(context_ids.len());
            self.model.forward(&probe[..n], &mut cache)?;
        }
        let mut times = vec![Vec::with_capacity(repeats); ns.len()];
        let device = self.model.device();
        for _ in 0..repeats.max(1) {
            for (slot, &n) in ns.iter().enumerate() {
                cache.truncate(context_ids.len());
                // A GPU runs launched work after the launch returns: wait for what is still queued
                // (the untimed round's forwards) so none of it is counted here, and for this
                // forward's logits [n, vocab_size] before reading the clock, so t(n), and
                // v(n) = t(n)/t(1), are device time.
                device.synchronize()?;
                let t0 = Instant::now();
                let logits = self.model.forward(&probe[..n], &mut cache)?;
                logits.device().synchronize()?;
                times[slot].push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    }
}

/// Locks one of the engine's shared states, recovering it when an earlier panic (caught at the
/// FFI, so the process lives on) poisoned the lock: refusing every later request instead would let
/// one bad request take the engine down. That is safe for each state this guards, because none
/// is left inconsistent by a panic part way through its critical section:
/// - `metrics`: sums of finished requests; at worst one request is counted in part (statistics
///   only, never a request's output);
/// - `drafts`: a map whose entries are inserted whole; `pinned_suffix_config`: replaced whole;
/// - `costs`: a curve is extended, and a draft cost inserted, only after its measurement finished
///   (a panic while measuring leaves the figures it had; the measurement runs again later);
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

/// Rejects a draft the verifier cannot use: more than `max_draft` tokens, ids outside the
/// vocabulary, or probabilities that are not `[num_draft_tokens, vocab_size]` rows of
/// distributions with q(x) > 0 for each drafted x.
fn check_draft(draft: &Draft, max_draft: usize, vocab: usize, method: &str) -> Result<()> {
    let n = draft.token_ids.len();
    if n > max_draft {
        return Err(Error::Proposer(format!(
            "the {method} proposer returned {n} tokens but was asked for at most {max_draft}; return at most max_tokens"
        )));
    }
    if let Some(bad) = draft.token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Proposer(format!(
            "the {method} proposer returned token id {bad}, outside the vocabulary (size {vocab})"
        )));
    }
    let Some(probs) = &draft.probs else { return Ok(()) };
    if probs.len() != n * vocab {
        return Err(Error::Proposer(format!(
            "the {method} proposer's draft probabilities have {} values; expected [{n}, {vocab}] \
             (one row per draft token, one column per vocabulary entry)",
            probs.len()
        )));
    }
    for (i, (row, &x)) in probs.chunks(vocab.max(1)).zip(&draft.token_ids).enumerate() {
        if row.iter().any(|q| !q.is_finite() || *q < 0.0) || (row.iter().sum::<f32>() - 1.0).abs() > 1e-3 {
            return Err(Error::Proposer(format!(
                "the {method} proposer's draft probabilities in row {i} are not a distribution \
                 (non-negative, finite, summing to 1)"
            )));
        }
        if row[x as usize] <= 0.0 {
            return Err(Error::Proposer(format!(
                "the {method} proposer drafted token {x} at position {i} with draft probability 0; \
                 a drafted token must have q > 0 under its own distribution"
            )));
        }
    }
    Ok(())
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
    speculation: Option<Speculation>,
    spec_metrics: SpecDecodeMetrics,
    engine_metrics: Arc<Mutex<EngineMetrics>>,
    /// At most this many prompt tokens per step (None: the whole prompt in the first step).
    prefill_chunk: Option<usize>,
}

impl Session {
    /// Chunked prefill: a step feeds at most `tokens` prompt tokens, so a server interleaving
    /// requests stalls the others for one chunk rather than a whole long prompt. Rows are
    /// computed independently, so the logits and the output do not change.
    pub fn set_prefill_chunk(&mut self, tokens: Option<usize>) -> Result<()> {
        if tokens == Some(0) {
            return Err(Error::config("the prefill chunk must be at least 1 token (or None for no chunking)"));
        }
        self.prefill_chunk = tokens;
        Ok(())
    }

    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    pub fn generated_ids(&self) -> &[u32] {
        &self.all_ids[self.prompt_len..]
    }

    /// One target forward (the whole prompt on the first call; after that the newest token plus
    /// the proposer's draft) and the tokens it yields.
    pub fn step(&mut self) -> Result<StepOutput> {
        if self.is_finished() {
            return Ok(StepOutput { token_ids: Vec::new(), text: String::new() });
        }
        let is_prefill = self.cache.len() < self.prompt_len;
        if let Some(chunk) =
            self.prefill_chunk.filter(|&chunk| self.prompt_len.saturating_sub(self.cache.len()) > chunk)
        {
            // A prompt chunk alone yields no token; its logits are not needed.
            let start = self.cache.len();
            self.model.forward_rows(&self.all_ids[start..start + chunk], &mut self.cache, LogitRows::Last)?;
            self.num_forward_passes += 1;
            return Ok(StepOutput { token_ids: Vec::new(), text: String::new() });
        }
        let draft = if is_prefill { Draft::default() } else { self.propose()? };
        let num_draft_tokens = draft.token_ids.len();

        let cache_len = self.cache.len();
        let mut input = self.all_ids[cache_len..].to_vec();
        let num_unseen = input.len();
        input.extend_from_slice(&draft.token_ids);
        let rows = if num_draft_tokens == 0 { LogitRows::Last } else { LogitRows::All };
        let t0 = Instant::now();
        let logits = self.model.forward_rows(&input, &mut self.cache, rows)?; // [num_draft_tokens + 1, vocab]
                                                                              // A GPU forward returns before it runs; wait, so forward_s is the forward's own time.
        logits.device().synchronize()?;
        let t1 = Instant::now();
        self.num_forward_passes += 1;
        let verification = self.verify_step(&logits, &draft)?;
        let num_accepted = verification.num_accepted_tokens;
        // Keep [newest token, accepted drafts]; the rejected tail leaves the cache.
        self.cache.truncate(cache_len + num_unseen + num_accepted);
        if !is_prefill {
            self.spec_metrics.num_decode_steps += 1;
            self.spec_metrics.forward_s += (t1 - t0).as_secs_f64();
            self.spec_metrics.verify_s += t1.elapsed().as_secs_f64();
        }
        if num_draft_tokens > 0 {
            self.spec_metrics.observe_draft(num_draft_tokens, num_accepted);
            if let Some(speculation) = self.speculation.as_mut() {
                if let Some(policy) = speculation.draft_length.as_mut() {
                    policy.observe(num_draft_tokens, num_accepted);
                }
                if let Some(schedule) = speculation.schedule.as_mut() {
                    schedule.observe(num_draft_tokens, num_accepted);
                }
                speculation.proposer.observe(num_accepted)?;
            }
        }

        let mut new_ids = Vec::with_capacity(verification.token_ids.len());
        for &token in &verification.token_ids {
            self.all_ids.push(token);
            new_ids.push(token);
            let is_eos = self.tokenizer.eos_token_ids().contains(&token);
            if is_eos && !self.params.ignore_eos {
                self.finish_reason = Some(FinishReason::Stop);
            } else if self.generated_ids().len() >= self.params.max_tokens {
                self.finish_reason = Some(FinishReason::Length);
            }
            if self.is_finished() {
                break;
            }
        }
        self.timer.tokens_arrived(new_ids.len());
        let mut text = self.detokenizer.next(&self.tokenizer, &self.all_ids)?;
        if self.is_finished() {
            text.push_str(&self.detokenizer.finish(&self.tokenizer, &self.all_ids)?);
            self.on_finish();
        }
        self.text.push_str(&text);
        Ok(StepOutput { token_ids: new_ids, text })
    }

    /// The target's verdict on `draft` from `logits` `[num_draft_tokens + 1, vocab]`. On a GPU,
    /// requests whose distribution is softmax(logits / temperature) alone are decided by the
    /// acceptance kernel where the logits are, so only the counts and one token cross to the
    /// host; the rest (and the CPU) copy the logits and run `verify`. Both are exact; with one
    /// seed they consume the random stream differently, so seeded samples differ between them.
    fn verify_step(&mut self, logits: &Tensor, draft: &Draft) -> Result<Verification> {
        #[cfg(feature = "cuda")]
        if logits.device().is_cuda() && self.params.is_temperature_only() {
            return self.verify_on_device(logits, draft);
        }
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let vocab = self.model.info().vocab_size;
        verify(&logits, vocab, &draft.token_ids, draft.probs.as_deref(), &self.params, &mut self.sampler)
    }

    #[cfg(feature = "cuda")]
    fn verify_on_device(&mut self, logits: &Tensor, draft: &Draft) -> Result<Verification> {
        let n = draft.token_ids.len();
        let vocab = self.model.info().vocab_size;
        let uniforms: Vec<f32> =
            if self.params.is_greedy() { vec![0.0; n + 1] } else { (0..=n).map(|_| self.sampler.uniform()).collect() };
        let input = crate::batch::accept::AcceptInput {
            batch: 1,
            max_draft_tokens: n,
            vocab_size: vocab,
            target_logits: &[],
            draft_token_ids: &draft.token_ids,
            num_draft_tokens: &[n as u32],
            draft_probs: draft.probs.as_deref(),
            temperatures: &[self.params.temperature],
            uniforms: &uniforms,
        };
        let out = crate::batch::cuda::accept_on_device(&logits.reshape((1, n + 1, vocab))?, &input)?;
        let num_accepted_tokens = out.num_accepted_tokens[0] as usize;
        let mut token_ids = draft.token_ids[..num_accepted_tokens].to_vec();
        token_ids.push(out.next_token_ids[0]);
        Ok(Verification { num_accepted_tokens, token_ids })
    }

    /// The proposer's draft for this step: at most k tokens (fewer near max_tokens so a step never
    /// overshoots it, fewer when the schedule or the cost-aware policy says so, chosen before
    /// proposing so a model-based draft computes only what will be verified), checked, and cut
    /// after the first token below the confidence threshold.
    fn propose(&mut self) -> Result<Draft> {
        let remaining = self.params.max_tokens - self.generated_ids().len();
        let Some(speculation) = self.speculation.as_mut() else { return Ok(Draft::default()) };
        let mut max_draft = speculation.num_speculative_tokens.min(remaining.saturating_sub(1));
        if let Some(schedule) = &speculation.schedule {
            max_draft = max_draft.min(schedule.current());
        }
        if let Some(policy) = speculation.draft_length.as_mut().filter(|_| max_draft > 0) {
            max_draft = policy.best_length(max_draft);
            if max_draft == 0 {
                policy.skipped();
            }
        }
        if max_draft == 0 {
            return Ok(Draft::default());
        }
        let t0 = Instant::now();
        let mut draft = speculation.proposer.propose_with_target_cache(&self.all_ids, max_draft, &mut self.cache)?;
        self.spec_metrics.propose_s += t0.elapsed().as_secs_f64();
        let vocab = self.model.info().vocab_size;
        check_draft(&draft, max_draft, vocab, speculation.method)?;
        if self.cache.len() != self.all_ids.len() - 1 {
            return Err(Error::Proposer(format!(
                "the {} proposer changed the target cache length; it must leave it as it found it",
                speculation.method
            )));
        }
        if let Some(probs) = draft.probs.as_ref().filter(|_| speculation.draft_confidence_threshold > 0.0) {
            let threshold = speculation.draft_confidence_threshold;
            let unsure =
                draft.token_ids.iter().enumerate().position(|(i, &x)| probs[i * vocab + x as usize] < threshold);
            if let Some(i) = unsure {
                draft.truncate(i + 1, vocab);
            }
        }
        Ok(draft)
    }

    /// Positions held by the target's KV cache and by the proposer's own, if it has one.
    pub fn kv_lens(&self) -> (usize, Option<usize>) {
        (self.cache.len(), self.speculation.as_ref().and_then(|s| s.proposer.kv_len()))
    }

    /// Called once when the request ends: the caches are freed, the proposer keeps what it learned
    /// and the engine adds the request to its sums.
    fn on_finish(&mut self) {
        self.cache.release();
        if let Some(speculation) = self.speculation.as_mut() {
            speculation.proposer.finish(&self.all_ids[self.prompt_len..]);
        }
        let metrics = self.metrics();
        // A poisoned lock is recovered rather than skipped (see `lock`): skipping would silently
        // drop this request from the engine's sums.
        if let Ok(mut engine) = lock(&self.engine_metrics) {
            engine.record(&metrics, &self.timer.itls_s());
        }
    }

    /// Stops the request early (a cancelled stream); its result keeps what was generated.
    pub fn abort(&mut self) {
        if self.finish_reason.is_none() {
            self.finish_reason = Some(FinishReason::Abort);
            self.on_finish();
        }
    }

    pub fn metrics(&self) -> RequestMetrics {
        let mut m = self.timer.metrics(self.prompt_len, self.num_forward_passes);
        m.spec_method = self.speculation.as_ref().map(|s| s.method.to_string());
        m.num_speculative_tokens = self.speculation.as_ref().map_or(0, |s| s.num_speculative_tokens);
        m.verify_cost_source = self.speculation.as_ref().and_then(|s| s.verify_cost_source).map(CostSource::as_str);
        m.draft_cost_source = self.speculation.as_ref().and_then(|s| s.draft_cost_source).map(CostSource::as_str);
        m.spec = self.spec_metrics.clone();
        if m.spec.num_accepted_tokens_per_pos.len() < m.num_speculative_tokens {
            m.spec.num_accepted_tokens_per_pos.resize(m.num_speculative_tokens, 0);
        }
        m
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
