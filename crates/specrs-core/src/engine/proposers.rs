//! The proposer factory: a request's `Speculation` (its proposer, k, and how each draft's length
//! is chosen) from a speculative config, with the draft models and suffix trees the engine shares.
//!
//! Invariant: every proposer a config names is built here, and only here; draft models are
//! loaded once per file and checked against the target's tokenizer before any request uses them.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::acceptance_prior::AcceptanceRecorder;
use super::tree_chooser::TreeChooser;
use super::{cache_dir, lock, Engine, PolicyCosts};
use crate::costs::CostSource;
use crate::draft_length::{AcceptancePrior, DraftLengthPolicy, HeuristicSchedule};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::{self, CausalLm};
use crate::proposer::auto::{AutoProposer, ModelDrafter};
use crate::proposer::cross_tokenizer::CrossTokenizerProposer;
use crate::proposer::draft_model::{DraftDrawing, DraftModelProposer};
use crate::proposer::heads::load::{load as load_head, LoadedHead};
use crate::proposer::heads::HeadProposer;
use crate::proposer::layer_skip::LayerSkipProposer;
use crate::proposer::ngram::NgramProposer;
use crate::proposer::pard::PardProposer;
use crate::proposer::suffix::{SuffixCache, SuffixProposer};
use crate::proposer::Proposer;
use crate::quantize::{parse_quant_type, requantize_gguf};
use crate::spec_config::{
    HeadMethod, Method, Schedule, SpeculativeConfig, SuffixParams, TreeConfig, TreeMode, Verification,
};
use crate::tokenizer::TextTokenizer;

/// One request's speculation: its proposer, k, and how each draft's length is chosen.
pub struct Speculation {
    pub method: &'static str,
    pub num_speculative_tokens: usize,
    pub proposer: Box<dyn Proposer>,
    /// Cost-aware cut of chains (None = verify every draft whole, or trees).
    pub draft_length: Option<DraftLengthPolicy>,
    /// Token trees (mode Off: chains).
    pub tree: TreeConfig,
    /// Tree mode "auto": picks each step's subtree by expected tokens per second.
    pub tree_chooser: Option<TreeChooser>,
    /// transformers' heuristic k schedule (None = constant k).
    pub schedule: Option<HeuristicSchedule>,
    /// Drafts with probabilities stop after a token with q(x) below this (0 = off).
    pub draft_confidence_threshold: f32,
    /// Grammar-forced tokens open the drafts of requests with a grammar (`spec_config.rs`).
    pub grammar_drafts: bool,
    /// Whether a seeded request's drafts carry no probabilities (ngram, suffix, the trees of
    /// heads and draft models, model drafts unless "verification" is "rejection"), so they are
    /// verified in coupled form and a seeded sampled request's tokens do not depend on its draft
    /// lengths (verify.rs). A custom proposer may return probabilities, so it counts as not.
    pub one_hot_drafts: bool,
    /// How model drafts are drawn and verified (the config's "verification"): the session gives
    /// the proposer the seed it verifies with when this says coupled for every request.
    pub verification: Verification,
    /// Where the draft-length policy's verification curve and draft cost came from (None
    /// without the policy; no draft cost source for model-free proposers, whose c is 0).
    pub verify_cost_source: Option<CostSource>,
    pub draft_cost_source: Option<CostSource>,
    /// Where the draft-length policy's verified drafts go while its draft's acceptance is not
    /// measured in this engine (`acceptance_prior.rs`).
    pub acceptance_recorder: Option<AcceptanceRecorder>,
}

/// A draft model file as loaded: the model, its tokenizer, and why that tokenizer is not the
/// target's (the `TokenizerMismatch` message), if it is not.
#[derive(Clone)]
pub(crate) struct LoadedDraft {
    pub model: Arc<dyn CausalLm>,
    pub tokenizer: Arc<TextTokenizer>,
    pub other_tokenizer: Option<String>,
}

/// At most this many engine-wide suffix caches (one per distinct suffix config) are kept. A new
/// config past it evicts the least recently used one other than the engine's own default (requests
/// in flight keep theirs until they end), so clients cycling through configs cannot grow memory
/// without bound nor wipe the default's learned responses.
pub const MAX_SUFFIX_CACHES: usize = 8;

/// "auto"'s n-gram lookup: prompt_lookup_min and prompt_lookup_max (short n-grams match more
/// often; each request's measured acceptance judges them).
const AUTO_NGRAM: (usize, usize) = (2, 5);

impl Engine {
    /// The draft model in the GGUF file at `path`, loaded on first use. Its tokenizer must be the
    /// target's (or a prefix of it): `Error::TokenizerMismatch` otherwise.
    pub fn draft_model(&self, path: impl AsRef<Path>) -> Result<Arc<dyn CausalLm>> {
        Ok(self.draft(path.as_ref(), true)?.model)
    }

    /// The draft model in the GGUF file at `path` and its tokenizer, loaded on first use. With
    /// `same_tokenizer`, a tokenizer that is not the target's is `Error::TokenizerMismatch`
    /// (before the weights load); without, such a draft loads too (`other_tokenizer`).
    pub(crate) fn draft(&self, path: &Path, same_tokenizer: bool) -> Result<LoadedDraft> {
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let cached = lock(&self.drafts)?.get(&key).cloned();
        if let Some(draft) = cached {
            return match (&draft.other_tokenizer, same_tokenizer) {
                (Some(mismatch), true) => Err(Error::TokenizerMismatch(mismatch.clone())),
                _ => Ok(draft),
            };
        }
        let mut gguf = GgufFile::open(path)?;
        let tokenizer = TextTokenizer::from_gguf(&gguf)?;
        let other_tokenizer = match self.tokenizer.check_draft_compatible(&tokenizer, &path.display().to_string()) {
            Ok(()) => None,
            Err(Error::TokenizerMismatch(message)) if !same_tokenizer => Some(message),
            Err(other) => return Err(other),
        };
        let model: Arc<dyn CausalLm> = Arc::from(model::loader::load(&mut gguf, self.model.device())?);
        let draft = LoadedDraft { model, tokenizer: Arc::new(tokenizer), other_tokenizer };
        lock(&self.drafts)?.insert(key, draft.clone());
        Ok(draft)
    }

    /// The `method` head at `model` (or, for MTP without one, in the target's own checkpoint),
    /// its linear weights quantized to `quantization` if given, loaded on first use and checked
    /// against the target.
    pub fn head(&self, method: HeadMethod, model: Option<&str>, quantization: Option<&str>) -> Result<LoadedHead> {
        let path = match (model, &self.checkpoint) {
            (Some(model), _) => PathBuf::from(model),
            (None, Some(checkpoint)) => checkpoint.clone(),
            (None, None) => {
                return Err(Error::config(format!(
                    "method '{}' without \"model\" reads MTP layers from the target's checkpoint, and this model \
                     was built in memory; set \"model\"",
                    method.name()
                )))
            }
        };
        let key = (method, path.canonicalize().unwrap_or_else(|_| path.clone()), quantization.map(str::to_string));
        if let Some(head) = lock(&self.heads)?.get(&key) {
            return Ok(head.clone());
        }
        let quantization = quantization.map(parse_quant_type).transpose()?;
        let head = load_head(method, &path, self.model.clone(), quantization)?;
        lock(&self.heads)?.insert(key, head.clone());
        Ok(head)
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

    /// Everything `config` needs before its first request, so that request does not pay for it in
    /// its latency: draft weights loaded (a bad draft fails here), and for the adaptive length the
    /// verification curve up to k + 1 and the draft cost queued for the background thread unless
    /// known (the disk cache). Returns the costs a request would read now. A suffix config's
    /// engine-wide cache is kept from eviction. Call it for the configs a program or server will
    /// use; `Engine(speculative_config=...)` calls it for its own.
    pub fn prepare(&self, config: &SpeculativeConfig) -> Result<PolicyCosts> {
        if config.suffix_params().is_some() {
            *lock(&self.pinned_suffix_config)? = Some(config.to_json());
        }
        if !matches!(config.method, Method::Custom) {
            self.proposer(config, None)?;
        }
        self.policy_costs(config)
    }

    /// A request's speculation for `config`: the built-in proposer, or `custom` for method
    /// "custom", with the draft-length policy over `policy_costs`.
    pub fn speculation(&self, config: &SpeculativeConfig, custom: Option<Box<dyn Proposer>>) -> Result<Speculation> {
        let proposer = self.proposer(config, custom)?;
        let costs = if config.adaptive_draft_length { Some(self.policy_costs(config)?) } else { None };
        // Whether a seeded request's drafts carry no probabilities (ngram, suffix, the trees of
        // heads and draft models, model drafts unless "verification" is "rejection"), so they are
        // verified in coupled form and its tokens do not depend on its draft lengths (verify.rs).
        // A custom proposer may return probabilities, so it counts as not. "auto" couples exactly
        // the seeded requests, whose output can depend on anything.
        let model_free =
            matches!(config.method, Method::Ngram { .. } | Method::Suffix(_) | Method::Auto { model: None });
        let top_k_tree = config.tree.is_on()
            && matches!(config.method, Method::Head { .. } | Method::DraftModel(_) | Method::QuantizedSelf { .. });
        let coupled = config.verification != Verification::Rejection && !matches!(config.method, Method::Custom);
        let one_hot_drafts = model_free || top_k_tree || coupled;
        // "auto" keeps one policy per drafter (`proposer/auto.rs`); trees are sized by the chooser.
        let chain_costs =
            costs.as_ref().filter(|_| !config.tree.is_on() && !matches!(config.method, Method::Auto { .. }));
        // A costly draft's policy starts from this engine's measured acceptance, exploring until
        // there is one; not where draft lengths choose a seeded request's tokens, which must not
        // depend on what the engine ran before.
        let explored = chain_costs.filter(|c| !c.draft_cost.is_free() && one_hot_drafts);
        let (acceptance_prior, acceptance_recorder) = match explored.and_then(|c| c.draft_identity.as_deref()) {
            Some(draft) => self.acceptance.prior(draft)?,
            None => (AcceptancePrior::uninformed(), None),
        };
        Ok(Speculation {
            method: config.method_name(),
            num_speculative_tokens: config.num_speculative_tokens,
            proposer,
            draft_length: chain_costs
                .map(|c| DraftLengthPolicy::with_prior(&c.verify_cost_ratios, c.draft_cost, acceptance_prior)),
            tree: config.tree.clone(),
            tree_chooser: costs
                .as_ref()
                .filter(|_| config.tree.mode == TreeMode::Auto)
                .map(|c| TreeChooser::new(&c.verify_cost_ratios, c.draft_cost)),
            schedule: (config.schedule == Schedule::Heuristic)
                .then(|| HeuristicSchedule::new(config.num_speculative_tokens)),
            draft_confidence_threshold: config.draft_confidence_threshold,
            grammar_drafts: config.grammar_drafts,
            one_hot_drafts,
            verification: config.verification,
            verify_cost_source: costs.as_ref().map(|c| c.verify_cost_source),
            draft_cost_source: costs.and_then(|c| c.draft_cost_source),
            acceptance_recorder,
        })
    }

    /// The proposer `config` names (or `custom` for method "custom").
    pub(super) fn proposer(
        &self,
        config: &SpeculativeConfig,
        custom: Option<Box<dyn Proposer>>,
    ) -> Result<Box<dyn Proposer>> {
        let target_vocab = self.model.info().vocab_size;
        let drawing =
            DraftDrawing { confidence_threshold: config.draft_confidence_threshold, verification: config.verification };
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
            (Method::DraftModel(draft), None) => {
                let loaded = self.draft(Path::new(&draft.model), false)?;
                match loaded.other_tokenizer {
                    // A draft with a tokenizer of its own drafts text (`cross_tokenizer.rs`).
                    Some(_) => Box::new(CrossTokenizerProposer::new(
                        loaded.model,
                        loaded.tokenizer,
                        self.tokenizer.clone(),
                        draft.max_model_len,
                        self.draft_kv.clone(),
                    )),
                    None => Box::new(DraftModelProposer::new(
                        loaded.model,
                        draft.max_model_len,
                        target_vocab,
                        drawing,
                        self.draft_kv.clone(),
                    )),
                }
            }
            (Method::QuantizedSelf { quantization, max_model_len }, None) => Box::new(DraftModelProposer::new(
                self.draft_model(self.quantized_self_path(quantization)?)?,
                *max_model_len,
                target_vocab,
                drawing,
                self.draft_kv.clone(),
            )),
            (Method::Auto { .. }, None) => {
                let lookups: Vec<(&'static str, Box<dyn Proposer>)> = vec![
                    ("suffix", Box::new(SuffixProposer::new(SuffixParams::default(), self.suffix_cache(config)?))),
                    ("ngram", Box::new(NgramProposer::new(AUTO_NGRAM.0, AUTO_NGRAM.1))),
                ];
                let costs = self.policy_costs(config)?;
                let model = match self.auto_model_drafter(config)? {
                    Some(drafter) => Some(ModelDrafter {
                        name: drafter.method_name(),
                        proposer: self.proposer(&drafter, None)?,
                        draft_cost: costs.draft_cost,
                        max_tokens: drafter.num_speculative_tokens,
                    }),
                    None => None,
                };
                Box::new(AutoProposer::new(&costs.verify_cost_ratios, lookups, model))
            }
            (Method::LayerSkip { exit_layer }, None) => {
                Box::new(LayerSkipProposer::new(self.model.clone(), *exit_layer, drawing)?)
            }
            (Method::Pard { draft, mask_token_id }, None) => Box::new(PardProposer::new(
                self.draft_model(&draft.model)?,
                *mask_token_id,
                draft.max_model_len,
                target_vocab,
                drawing,
                self.draft_kv.clone(),
            )?),
            (Method::Head { method, model, quantization }, None) => {
                let head = self.head(*method, model.as_deref(), quantization.as_deref())?.head;
                // A tree's depth is what one sub-head per token bounds; a chain's length.
                let (depth, key) = if config.tree.is_on() {
                    (config.tree.max_depth, "tree_depth")
                } else {
                    (config.num_speculative_tokens, "num_speculative_tokens")
                };
                if let Some((max, why)) = head.max_draft_tokens().filter(|(max, _)| depth > *max) {
                    return Err(Error::config(format!(
                        "{key} is {depth} but this {} head drafts at most {max} tokens deep ({why}); set {key} \
                         to at most {max}",
                        method.name()
                    )));
                }
                Box::new(HeadProposer::new(head, method.name(), target_vocab, drawing, self.draft_kv.clone()))
            }
        };
        Ok(proposer)
    }

    /// "auto"'s model drafter as a config of its own (`SpeculativeConfig::model_drafter`), its k
    /// capped at what the drafter drafts per step (a parallel head: one token per sub-head), so
    /// it builds and its cost is measured at the lengths auto can ask of it.
    pub(super) fn auto_model_drafter(&self, config: &SpeculativeConfig) -> Result<Option<SpeculativeConfig>> {
        let Some(mut drafter) = config.model_drafter() else { return Ok(None) };
        if let Method::Head { method, model, quantization } = &drafter.method {
            if let Some((max, _)) =
                self.head(*method, model.as_deref(), quantization.as_deref())?.head.max_draft_tokens()
            {
                drafter.num_speculative_tokens = drafter.num_speculative_tokens.min(max);
            }
        }
        Ok(Some(drafter))
    }

    /// The engine-wide suffix cache of `config` (created on first use; see `MAX_SUFFIX_CACHES`):
    /// one per distinct suffix or "auto" config (keyed by its JSON), so a benchmark's configs never
    /// draft from each other's responses.
    pub(super) fn suffix_cache(&self, config: &SpeculativeConfig) -> Result<Arc<Mutex<SuffixCache>>> {
        let Some(params) = config.suffix_params() else {
            return Err(Error::Internal("suffix_cache needs a suffix or auto config".into()));
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
}
