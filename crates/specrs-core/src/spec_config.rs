//! `SpeculativeConfig`: which proposer to run and how many tokens it may guess, parsed from the
//! same JSON object `vllm serve --speculative-config` takes (same key names, same defaults).
//!
//! Invariant: a parsed config is complete and valid (every method-specific default filled in,
//! every range checked), so proposers never re-validate. Every rejection names the key and the
//! fix; an unknown key or method names the closest valid one.

use serde_json::{Map, Value};

use crate::costs::DraftCostUnit;
use crate::error::{Error, Result};
use crate::quantize::{parse_quant_type, quant_type_name};

pub mod methods;
pub mod shipped;
pub mod tree;
pub use methods::MethodSpec;
pub use tree::{TreeConfig, TreeMode};

/// The suffix-decoding settings of a speculative config (vLLM's `suffix_decoding_*` keys).
#[derive(Debug, Clone, PartialEq)]
pub struct SuffixParams {
    /// Longest substring the trees index; a match uses at most `max_tree_depth - 1` context tokens.
    pub max_tree_depth: usize,
    /// Finished responses kept in the global tree (FIFO); 0 disables the global tree.
    pub max_cached_requests: usize,
    /// A match of length m may propose at most `floor(max_spec_factor * m)` tokens.
    pub max_spec_factor: f32,
    /// Stop the draft once its cumulative estimated probability falls below this.
    pub min_token_prob: f32,
}

impl Default for SuffixParams {
    /// vLLM's defaults.
    fn default() -> Self {
        Self {
            max_tree_depth: methods::DEFAULT_SUFFIX_MAX_TREE_DEPTH,
            max_cached_requests: 10_000,
            max_spec_factor: 1.0,
            min_token_prob: 0.1,
        }
    }
}

/// The most tokens one step may guess; a verify forward over more rows costs more than it can win
/// on any model specrs runs.
pub const MAX_SPECULATIVE_TOKENS: usize = 64;

// Upper bounds of the other size-like keys. vLLM bounds none of these; each value sizes an
// allocation or a per-token loop, so an unbounded one lets a single request exhaust memory (a
// prompt_lookup_max of 1e8 asked for gigabytes of n-gram tables). Each is far past any useful value.
/// prompt_lookup_min / prompt_lookup_max: one n-gram table per length in between.
pub const MAX_PROMPT_LOOKUP: usize = 64;
/// suffix_decoding_max_tree_depth: each indexed token adds up to this many trie nodes.
pub const MAX_SUFFIX_TREE_DEPTH: usize = 64;
/// suffix_decoding_max_cached_requests: responses kept in one engine-wide suffix tree.
pub const MAX_SUFFIX_CACHED_REQUESTS: usize = 100_000;
/// suffix_decoding_max_spec_factor: a match of m tokens drafts at most factor * m (k caps it anyway).
pub const MAX_SUFFIX_SPEC_FACTOR: f64 = 64.0;
/// max_model_len of a draft's KV cache (the draft's own context bounds it further).
pub const MAX_DRAFT_MODEL_LEN: usize = 1 << 24;
/// exit_layer of a layer-skip draft (the target's layer count bounds it further).
pub const MAX_EXIT_LAYER: usize = 1024;
/// draft_cost: a draft token costing 100 target steps never pays.
pub const MAX_DRAFT_COST: f64 = 100.0;

/// Every key a speculative config may hold: vLLM's, then specrs' own.
pub const KEYS: [&str; 25] = [
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
    "model",
    "max_model_len",
    "quantization",
    "mask_token_id",
    "exit_layer",
    "adaptive_draft_length",
    "draft_confidence_threshold",
    "num_speculative_tokens_schedule",
    "verify_cost_ratios",
    "draft_cost",
    "tree",
    "speculative_token_tree",
    "tree_depth",
    "tree_top_k",
    "grammar_drafts",
    "verification",
    "draft_method",
];

/// Every method a speculative config may name (besides aliases such as `draft` and `[ngram]`);
/// `methods::ALL` holds what each takes and needs.
pub const METHODS: [&str; methods::ALL.len()] = methods::NAMES;

/// The draft weight type `quantized_self` builds when the config names none.
pub const DEFAULT_SELF_QUANTIZATION: &str = "q4_0";

#[derive(Debug, Clone, PartialEq)]
pub enum Method {
    /// Prompt lookup: continue the most recent earlier occurrence of the context's last n-gram.
    Ngram { prompt_lookup_min: usize, prompt_lookup_max: usize },
    /// SuffixDecoding: suffix trees over this request and previous responses.
    Suffix(SuffixParams),
    /// A proposer object supplied by the caller (Python `propose(context_ids, max_tokens)`).
    Custom,
    /// A separate draft model (GGUF) sharing the target's tokenizer.
    DraftModel(DraftModelParams),
    /// The target's first `exit_layer` layers + final norm + LM head.
    LayerSkip { exit_layer: usize },
    /// The target requantized to `quantization` (e.g. "q4_0"), built once and cached on disk.
    QuantizedSelf { quantization: String, max_model_len: Option<usize> },
    /// A PARD draft: k tokens from one forward over k-1 appended mask tokens.
    Pard { draft: DraftModelParams, mask_token_id: u32 },
    /// A hidden-state head at `model` (a directory or GGUF file); MTP without `model` reads the
    /// target's own checkpoint. `quantization` ("q8_0" or "q4_0") quantizes its linear weights
    /// at load; None keeps them f32.
    Head { method: HeadMethod, model: Option<String>, quantization: Option<String> },
    /// Per step, the drafter with the most expected tokens per unit of cost among the model-free
    /// lookups (suffix, n-gram) and, with `model`, a model drafter: a `DraftModel` or a `Head`
    /// (`proposer/auto.rs`).
    Auto { model: Option<Box<Method>> },
}

impl Method {
    /// The facts of this method (`methods::ALL`).
    pub fn spec(&self) -> &'static MethodSpec {
        methods::spec(method_name(self))
    }

    /// The config keys naming the weights this method loads besides the target's
    /// (`MethodSpec::weight_keys`); empty for the methods that load none.
    pub fn weight_keys(&self) -> &'static [&'static str] {
        self.spec().weight_keys
    }

    /// How its drafting is charged (`costs::DraftCost`): per draft for a method that drafts a
    /// whole block in one forward (`MethodSpec::one_forward_per_draft`), else per draft token;
    /// "auto" as its model drafter.
    pub fn draft_cost_unit(&self) -> DraftCostUnit {
        match self {
            Method::Auto { model: Some(drafter) } => drafter.draft_cost_unit(),
            method if method.spec().one_forward_per_draft => DraftCostUnit::Draft,
            _ => DraftCostUnit::Token,
        }
    }
}

/// The hidden-state heads, by vLLM's method names (`proposer/heads/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeadMethod {
    /// EAGLE-1/2: `fc` over [embedding; last hidden], one layer, the target's LM head.
    Eagle,
    /// EAGLE-3: three tapped layers into `fc`, one layer, its own LM head over a draft vocabulary.
    Eagle3,
    /// Multi-token prediction layers shipped with the target (DeepSeek-V3, GLM-4.5, MiMo).
    Mtp,
    /// IBM's MLP speculator: one small MLP per drafted position.
    MlpSpeculator,
    /// Medusa: one residual-block head per drafted position.
    Medusa,
    /// DFlash: a block drafter over tapped target layers, one forward per block of drafts.
    DFlash,
    /// DSpark: DFlash plus a Markov head and a confidence head.
    DSpark,
}

impl HeadMethod {
    pub const ALL: [HeadMethod; 7] = [
        HeadMethod::Eagle,
        HeadMethod::Eagle3,
        HeadMethod::Mtp,
        HeadMethod::MlpSpeculator,
        HeadMethod::Medusa,
        HeadMethod::DFlash,
        HeadMethod::DSpark,
    ];

    pub fn name(self) -> &'static str {
        match self {
            HeadMethod::Eagle => "eagle",
            HeadMethod::Eagle3 => "eagle3",
            HeadMethod::Mtp => "mtp",
            HeadMethod::MlpSpeculator => "mlp_speculator",
            HeadMethod::Medusa => "medusa",
            HeadMethod::DFlash => "dflash",
            HeadMethod::DSpark => "dspark",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct DraftModelParams {
    /// Path of the draft's GGUF file.
    pub model: String,
    /// Bounds the draft's KV cache; requests longer than this get no drafts past it.
    pub max_model_len: Option<usize>,
}

/// How a sampled request's drafts from a model (draft models, self-drafts, heads) are drawn and
/// verified (`"verification"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verification {
    /// Coupled for seeded requests (their output is asked to be reproducible), rejection for
    /// unseeded ones (more drafts accepted: benches/README.md, verification_bench). The default.
    Auto,
    /// The draft draws each token with the uniform the target samples that position with
    /// (`Sampler::uniform_at`), and a draft token is accepted iff it equals the target's own
    /// sample: every emitted token is the one plain sampling emits, whatever the draft lengths,
    /// batch-mates or timing.
    Coupled,
    /// The draft draws from its own random stream and the target verifies by rejection sampling
    /// with the draft's probabilities (Leviathan et al.): exact in distribution, and accepts more
    /// often, but a seeded request's tokens depend on its draft lengths.
    Rejection,
}

impl Verification {
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Coupled => "coupled",
            Self::Rejection => "rejection",
        }
    }

    /// Whether a request seeded (`seeded`) or not draws its model drafts in coupled form.
    pub fn couples(self, seeded: bool) -> bool {
        match self {
            Self::Auto => seeded,
            Self::Coupled => true,
            Self::Rejection => false,
        }
    }
}

/// How k moves during a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// k stays num_speculative_tokens.
    Constant,
    /// transformers' heuristic: +2 after a fully accepted draft, -1 otherwise, in 1..=k.
    Heuristic,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SpeculativeConfig {
    pub method: Method,
    /// Upper bound on draft tokens per step (k).
    pub num_speculative_tokens: usize,
    /// Pick each draft's length for the best expected tokens per unit of cost (specrs'
    /// `draft_length` module; default on). Off: every draft is verified whole, as in vLLM.
    pub adaptive_draft_length: bool,
    /// Drafts with probabilities stop after a token whose draft probability is below this
    /// (transformers' `assistant_confidence_threshold`; 0 = off).
    pub draft_confidence_threshold: f32,
    /// For requests with a grammar: the tokens the grammar forces are drafted first, for free
    /// (n-gram and suffix drafts, chains and trees; default on).
    pub grammar_drafts: bool,
    /// Sampled drafts of the methods whose drafts carry probabilities: coupled (the output is
    /// plain sampling's, token for token), rejection sampling, or auto (coupled when seeded).
    pub verification: Verification,
    pub schedule: Schedule,
    /// Costs the adaptive length reads from the config instead of measuring them (specrs keys):
    /// pinned costs make draft lengths, and so seeded samples, the same on every machine, and let
    /// tests assert the policy rather than the machine's timing.
    pub costs: ConfigCosts,
    /// Token trees (`spec_config/tree.rs`); with one, `num_speculative_tokens` is the node budget.
    pub tree: TreeConfig,
}

/// `verify_cost_ratios` ([v(1) = 1, v(2), ...], v(n) = t(n)/t(1)) and `draft_cost` (c, drafting
/// time over t(1) per draft token, or per draft for a method that drafts a block in one forward:
/// `Method::draft_cost_unit`); None = measured by the engine.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConfigCosts {
    pub verify_cost_ratios: Option<Vec<f64>>,
    pub draft_cost: Option<f64>,
}

impl SpeculativeConfig {
    pub fn method_name(&self) -> &'static str {
        method_name(&self.method)
    }

    /// Parses the JSON text of a vLLM-style speculative config.
    pub fn from_json(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| {
            Error::config(format!(
                "speculative_config is not valid JSON ({e}); write it like \
                 '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'"
            ))
        })?;
        let Value::Object(map) = value else {
            return Err(Error::config("speculative_config must be a JSON object, e.g. {\"method\": \"suffix\"}"));
        };
        Self::from_map(&map)
    }

    pub fn from_map(map: &Map<String, Value>) -> Result<Self> {
        for key in map.keys() {
            if !KEYS.contains(&key.as_str()) {
                return Err(Error::config(format!(
                    "unknown speculative_config key '{}'; did you mean '{}'? (valid keys: {})",
                    shown(key),
                    closest(key, &KEYS),
                    KEYS.join(", ")
                )));
            }
        }
        let method = match map.get("method") {
            None => return Err(Error::config("speculative_config needs \"method\": one of ngram, suffix, custom")),
            Some(Value::String(m)) => m.as_str(),
            Some(other) => {
                return Err(Error::config(format!(
                    "\"method\" must be a string such as \"ngram\" (got {})",
                    shown(&other.to_string())
                )))
            }
        };
        let Some(spec) = methods::resolve(method) else {
            return Err(Error::config(format!(
                "unknown speculative method '{}'; did you mean '{}'? (methods: {})",
                shown(method),
                closest(method, &METHODS),
                METHODS.join(", ")
            )));
        };
        let method = spec.name;
        let only_for = |prefix: &str, owner: &str| -> Result<()> {
            match map.keys().find(|k| k.starts_with(prefix)) {
                Some(k) if method != owner => Err(Error::config(format!(
                    "'{k}' applies to method '{owner}' only, not '{method}'; remove it or set \"method\": \"{owner}\""
                ))),
                _ => Ok(()),
            }
        };
        only_for("prompt_lookup_", "ngram")?;
        only_for("suffix_decoding_", "suffix")?;
        for key in KEYS {
            let owners = methods::owners(key);
            if map.contains_key(key) && !owners.is_empty() && !owners.contains(&method) {
                return Err(Error::config(format!(
                    "'{key}' applies to method {} only, not '{method}'; remove it",
                    owners.join(" / ")
                )));
            }
        }
        let max_model_len = bounded_count(map, "max_model_len", MAX_DRAFT_MODEL_LEN)?;
        if max_model_len == Some(0) {
            return Err(Error::config("max_model_len must be >= 1 (got 0); leave it out to use the draft's context"));
        }
        // A hidden-state head's "model" and "quantization" (its own method, or "auto"'s drafter).
        let head_params = |head: HeadMethod| -> Result<Method> {
            let name = head.name();
            let model = match map.get("model") {
                None | Some(Value::Null) if head == HeadMethod::Mtp => None,
                Some(Value::String(model)) if !model.is_empty() => Some(model.clone()),
                _ => {
                    return Err(Error::config(format!(
                        "method '{name}' needs \"model\": the path of the head's directory (config.json + \
                         *.safetensors), or a llama.cpp eagle3 / nextn MTP .gguf file"
                    )))
                }
            };
            let quantization = match map.get("quantization") {
                None | Some(Value::Null) => None,
                Some(Value::String(q))
                    if matches!(parse_quant_type(q).map(quant_type_name).as_deref(), Ok("q8_0" | "q4_0")) =>
                {
                    Some(q.to_ascii_lowercase())
                }
                Some(other) => {
                    return Err(Error::config(format!(
                        "a head's 'quantization' is \"q8_0\" or \"q4_0\" (got {}); leave it out to keep the \
                         head's weights in f32",
                        shown(&other.to_string())
                    )))
                }
            };
            Ok(Method::Head { method: head, model, quantization })
        };
        let draft_params = || -> Result<DraftModelParams> {
            match map.get("model") {
                Some(Value::String(model)) if !model.is_empty() => {
                    Ok(DraftModelParams { model: model.clone(), max_model_len })
                }
                _ => Err(Error::config(format!(
                    "method '{method}' needs \"model\": the path of the draft's .gguf file (it must share the target's tokenizer)"
                ))),
            }
        };

        let num_speculative_tokens = bounded_count(map, "num_speculative_tokens", MAX_SPECULATIVE_TOKENS)?;
        if num_speculative_tokens == Some(0) {
            return Err(Error::config(format!(
                "num_speculative_tokens must be in 1..={MAX_SPECULATIVE_TOKENS} (got 0); try 4"
            )));
        }
        let (mut tree, static_tree_k) = TreeConfig::parse(map, num_speculative_tokens)?;
        let num_speculative_tokens = num_speculative_tokens.or(static_tree_k);
        let required_k = || {
            num_speculative_tokens.ok_or_else(|| {
                Error::config(format!(
                    "method '{method}' needs \"num_speculative_tokens\" (how many tokens to guess per step), e.g. 4"
                ))
            })
        };
        let (method, num_speculative_tokens) = match method {
            "ngram" => {
                // vLLM: both missing -> 5 and 5; one missing -> equal to the other.
                let (min, max) = match (
                    bounded_count(map, "prompt_lookup_min", MAX_PROMPT_LOOKUP)?,
                    bounded_count(map, "prompt_lookup_max", MAX_PROMPT_LOOKUP)?,
                ) {
                    (None, None) => (5, 5),
                    (Some(min), None) => (min, min),
                    (None, Some(max)) => (max, max),
                    (Some(min), Some(max)) => (min, max),
                };
                if min == 0 {
                    return Err(Error::config("prompt_lookup_min must be >= 1 (got 0); try 2"));
                }
                if min > max {
                    return Err(Error::config(format!(
                        "prompt_lookup_min={min} must be <= prompt_lookup_max={max}; raise prompt_lookup_max or lower prompt_lookup_min"
                    )));
                }
                (Method::Ngram { prompt_lookup_min: min, prompt_lookup_max: max }, required_k()?)
            }
            "suffix" => {
                let max_tree_depth = bounded_count(map, "suffix_decoding_max_tree_depth", MAX_SUFFIX_TREE_DEPTH)?
                    .unwrap_or(methods::DEFAULT_SUFFIX_MAX_TREE_DEPTH);
                if max_tree_depth == 0 {
                    return Err(Error::config(format!(
                        "suffix_decoding_max_tree_depth must be >= 1 (got 0); the default is {}",
                        methods::DEFAULT_SUFFIX_MAX_TREE_DEPTH
                    )));
                }
                let max_cached_requests =
                    bounded_count(map, "suffix_decoding_max_cached_requests", MAX_SUFFIX_CACHED_REQUESTS)?
                        .unwrap_or(10_000);
                let max_spec_factor = optional_number(map, "suffix_decoding_max_spec_factor")?.unwrap_or(1.0);
                if !(0.0..=MAX_SUFFIX_SPEC_FACTOR).contains(&max_spec_factor) {
                    return Err(Error::config(format!(
                        "suffix_decoding_max_spec_factor must be in [0, {MAX_SUFFIX_SPEC_FACTOR}] (got {max_spec_factor}); \
                         the default is 1.0"
                    )));
                }
                let min_token_prob = optional_number(map, "suffix_decoding_min_token_prob")?.unwrap_or(0.1);
                if !(0.0..=1.0).contains(&min_token_prob) {
                    return Err(Error::config(format!(
                        "suffix_decoding_min_token_prob must be in [0, 1] (got {min_token_prob}); the default is 0.1"
                    )));
                }
                let params = SuffixParams {
                    max_tree_depth,
                    max_cached_requests,
                    max_spec_factor: max_spec_factor as f32,
                    min_token_prob: min_token_prob as f32,
                };
                // vLLM: suffix decoding sizes its drafts itself; k defaults to the tree depth as a cap.
                (Method::Suffix(params), num_speculative_tokens.unwrap_or(max_tree_depth.min(MAX_SPECULATIVE_TOKENS)))
            }
            "draft_model" => (Method::DraftModel(draft_params()?), required_k()?),
            "auto" => {
                if tree.is_on() {
                    return Err(Error::config(
                        "method 'auto' drafts chains (each step's drafter picks its own length); remove \"tree\"",
                    ));
                }
                let model = auto_model_drafter(map, &head_params, &draft_params)?;
                (Method::Auto { model: model.map(Box::new) }, num_speculative_tokens.unwrap_or(methods::DEFAULT_AUTO_K))
            }
            "pard" => {
                let mask_token_id = optional_count(map, "mask_token_id")?.ok_or_else(|| {
                    Error::config(
                        "method 'pard' needs \"mask_token_id\": the mask token the PARD draft was trained with",
                    )
                })?;
                let mask_token_id = u32::try_from(mask_token_id)
                    .map_err(|_| Error::config(format!("mask_token_id {mask_token_id} is not a token id")))?;
                (Method::Pard { draft: draft_params()?, mask_token_id }, required_k()?)
            }
            "layer_skip" => {
                let exit_layer = bounded_count(map, "exit_layer", MAX_EXIT_LAYER)?.ok_or_else(|| {
                    Error::config(
                        "method 'layer_skip' needs \"exit_layer\": how many of the target's layers draft, e.g. 8",
                    )
                })?;
                (Method::LayerSkip { exit_layer }, required_k()?)
            }
            "quantized_self" => {
                let quantization = match map.get("quantization") {
                    None | Some(Value::Null) => DEFAULT_SELF_QUANTIZATION.to_string(),
                    Some(Value::String(q)) => quant_type_name(parse_quant_type(q)?),
                    Some(other) => {
                        return Err(Error::config(format!(
                            "'quantization' must be a string such as \"q4_0\" (got {})",
                            shown(&other.to_string())
                        )))
                    }
                };
                (Method::QuantizedSelf { quantization, max_model_len }, required_k()?)
            }
            head if HeadMethod::from_name(head).is_some() => {
                (head_params(HeadMethod::from_name(head).expect("matched above"))?, required_k()?)
            }
            _ => (Method::Custom, required_k()?),
        };
        tree.fill_depth(num_speculative_tokens);
        // A fixed tree is verified whole; "auto" is the adaptive choice for trees, reading the
        // same cost curve.
        let adaptive_draft_length = match (map.get("adaptive_draft_length"), tree.mode) {
            (None | Some(Value::Null), TreeMode::On) => false,
            (None | Some(Value::Null), _) => true,
            (Some(Value::Bool(true)), TreeMode::On) => {
                return Err(Error::config(
                    "\"tree\": true verifies whole trees; for adaptive trees set \"tree\": \"auto\" (and remove adaptive_draft_length)",
                ))
            }
            (Some(Value::Bool(false)), _) if matches!(method, Method::Auto { .. }) => {
                return Err(Error::config(
                    "method 'auto' chooses each step's drafter and length by cost; remove adaptive_draft_length \
                     (or pick one method to verify fixed lengths)",
                ))
            }
            (Some(Value::Bool(false)), TreeMode::Auto) => {
                return Err(Error::config(
                    "\"tree\": \"auto\" chooses each step's tree by cost; with adaptive_draft_length false set \"tree\": true instead",
                ))
            }
            (Some(Value::Bool(b)), _) => *b,
            (Some(other), _) => {
                return Err(Error::config(format!("'adaptive_draft_length' must be true or false (got {})", shown(&other.to_string()))))
            }
        };
        let draft_confidence_threshold = optional_number(map, "draft_confidence_threshold")?.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&draft_confidence_threshold) {
            return Err(Error::config(format!(
                "draft_confidence_threshold must be in [0, 1] (got {draft_confidence_threshold}); 0 turns it off, try 0.4"
            )));
        }
        if draft_confidence_threshold > 0.0 && !spec.draft_probs {
            return Err(Error::config(format!(
                "draft_confidence_threshold needs drafts with probabilities, and '{}' drafts have none; \
                 remove it{}",
                method_name(&method),
                if matches!(method, Method::Suffix(_)) {
                    " (suffix_decoding_min_token_prob plays its part)"
                } else {
                    ""
                }
            )));
        }
        let grammar_drafts = match map.get("grammar_drafts") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(Error::config(format!(
                    "'grammar_drafts' must be true or false (got {})",
                    shown(&other.to_string())
                )))
            }
        };
        let verification = match map.get("verification") {
            None | Some(Value::Null) => Verification::Auto,
            Some(Value::String(s)) if s == "auto" => Verification::Auto,
            Some(Value::String(s)) if s == "coupled" => Verification::Coupled,
            Some(Value::String(s)) if s == "rejection" => Verification::Rejection,
            Some(other) => {
                return Err(Error::config(format!(
                    "'verification' must be \"auto\", \"coupled\" or \"rejection\" (got {})",
                    shown(&other.to_string())
                )))
            }
        };
        if map.get("verification").is_some_and(|v| !v.is_null()) && (!spec.draft_probs || spec.needs_proposer_object) {
            return Err(Error::config(format!(
                "'verification' chooses how drafts drawn from a model's probabilities are verified, and '{}' {}; \
                 remove it",
                method_name(&method),
                if spec.needs_proposer_object {
                    "drafts come from your proposer (its probabilities, when it returns them, are verified by rejection \
                     sampling)"
                } else {
                    "drafts have no probabilities (they are always verified in coupled form)"
                }
            )));
        }
        let costs = ConfigCosts {
            verify_cost_ratios: verify_cost_ratios(map)?,
            draft_cost: optional_number(map, "draft_cost")?,
        };
        if let Some(c) = costs.draft_cost.filter(|c| !(0.0..=MAX_DRAFT_COST).contains(c)) {
            return Err(Error::config(format!(
                "draft_cost must be in [0, {MAX_DRAFT_COST}] (got {c}): drafting time per draft token (per draft for {}) \
                 over one target step",
                methods::ALL.iter().filter(|m| m.one_forward_per_draft).map(|m| m.name).collect::<Vec<_>>().join(", ")
            )));
        }
        if !adaptive_draft_length && (costs.verify_cost_ratios.is_some() || costs.draft_cost.is_some()) {
            return Err(Error::config(
                "verify_cost_ratios and draft_cost feed the adaptive draft length, which this config turns off; \
                 remove them or set \"adaptive_draft_length\": true",
            ));
        }
        let schedule = match map.get("num_speculative_tokens_schedule") {
            None | Some(Value::Null) => Schedule::Constant,
            Some(Value::String(s)) if s == "constant" => Schedule::Constant,
            Some(Value::String(s)) if s == "heuristic" => Schedule::Heuristic,
            Some(other) => {
                return Err(Error::config(format!(
                    "'num_speculative_tokens_schedule' must be \"constant\" or \"heuristic\" (got {})",
                    shown(&other.to_string())
                )))
            }
        };
        Ok(Self {
            method,
            num_speculative_tokens,
            adaptive_draft_length,
            draft_confidence_threshold: draft_confidence_threshold as f32,
            grammar_drafts,
            verification,
            schedule,
            costs,
            tree,
        })
    }

    /// The weights this config loads besides the target's: `{"method": ..., key: value}` for each
    /// of its method's `weight_keys` (null where the method's default applies, e.g. MTP reading
    /// the target's own checkpoint); None when it loads none. Configs with equal weights load the
    /// same weights (the engine's draft and head caches are keyed by these values), so a server
    /// can tell a request that reuses its weights from one that would load new ones.
    pub fn weights(&self) -> Option<Map<String, Value>> {
        // "auto"'s model drafter is loaded as its own method's weights are (one engine cache entry
        // per file), so a server holding them lets requests use them either way; without one,
        // "auto" loads nothing.
        if let Method::Auto { .. } = self.method {
            return self.model_drafter().and_then(|drafter| drafter.weights());
        }
        let keys = self.method.weight_keys();
        if keys.is_empty() {
            return None;
        }
        let all = self.to_map();
        let mut weights = Map::new();
        weights.insert("method".into(), self.method_name().into());
        for key in keys {
            weights.insert((*key).into(), all.get(*key).cloned().unwrap_or(Value::Null));
        }
        Some(weights)
    }

    /// "auto"'s model drafter as a config of its own method (a draft model's or a head's, with
    /// this config's k, costs and drawing): what loads it, measures its cost and builds it. None
    /// for every other method and for "auto" over the lookups alone.
    pub fn model_drafter(&self) -> Option<SpeculativeConfig> {
        match &self.method {
            Method::Auto { model: Some(model) } => {
                Some(SpeculativeConfig { method: (**model).clone(), ..self.clone() })
            }
            _ => None,
        }
    }

    /// The settings of this config's engine-wide suffix cache: a suffix config's own, or "auto"'s
    /// suffix lookup's (vLLM's defaults); None for the methods that keep none.
    pub fn suffix_params(&self) -> Option<SuffixParams> {
        match &self.method {
            Method::Suffix(params) => Some(params.clone()),
            Method::Auto { .. } => Some(SuffixParams::default()),
            _ => None,
        }
    }

    /// The config as vLLM-style JSON, every default spelled out.
    pub fn to_json(&self) -> String {
        // Keys sorted, whatever serde_json's map keeps (llguidance turns on its insertion order):
        // this string keys the suffix caches saved to disk, so it must not change between versions.
        let sorted: std::collections::BTreeMap<String, Value> = self.to_map().into_iter().collect();
        serde_json::to_string(&sorted).unwrap_or_default()
    }

    fn to_map(&self) -> Map<String, Value> {
        let mut map = Map::new();
        map.insert("method".into(), self.method_name().into());
        map.insert("num_speculative_tokens".into(), self.num_speculative_tokens.into());
        map.insert("adaptive_draft_length".into(), self.adaptive_draft_length.into());
        if self.draft_confidence_threshold > 0.0 {
            map.insert("draft_confidence_threshold".into(), f64::from(self.draft_confidence_threshold).into());
        }
        if !self.grammar_drafts {
            map.insert("grammar_drafts".into(), false.into());
        }
        // Written only when not the default, so the JSON of configs without it (suffix caches'
        // keys on disk among them) stays what it was.
        if self.verification != Verification::Auto {
            map.insert("verification".into(), self.verification.name().into());
        }
        if self.schedule == Schedule::Heuristic {
            map.insert("num_speculative_tokens_schedule".into(), "heuristic".into());
        }
        if let Some(ratios) = &self.costs.verify_cost_ratios {
            map.insert("verify_cost_ratios".into(), ratios.clone().into());
        }
        if let Some(c) = self.costs.draft_cost {
            map.insert("draft_cost".into(), c.into());
        }
        self.tree.to_json(&mut map);
        let draft = |d: &DraftModelParams, map: &mut Map<String, Value>| {
            map.insert("model".into(), d.model.clone().into());
            if let Some(len) = d.max_model_len {
                map.insert("max_model_len".into(), len.into());
            }
        };
        let head = |model: &Option<String>, quantization: &Option<String>, map: &mut Map<String, Value>| {
            if let Some(model) = model {
                map.insert("model".into(), model.clone().into());
            }
            if let Some(q) = quantization {
                map.insert("quantization".into(), q.clone().into());
            }
        };
        match &self.method {
            Method::Ngram { prompt_lookup_min, prompt_lookup_max } => {
                map.insert("prompt_lookup_min".into(), (*prompt_lookup_min).into());
                map.insert("prompt_lookup_max".into(), (*prompt_lookup_max).into());
            }
            Method::Suffix(p) => {
                map.insert("suffix_decoding_max_tree_depth".into(), p.max_tree_depth.into());
                map.insert("suffix_decoding_max_cached_requests".into(), p.max_cached_requests.into());
                map.insert("suffix_decoding_max_spec_factor".into(), f64::from(p.max_spec_factor).into());
                map.insert("suffix_decoding_min_token_prob".into(), f64::from(p.min_token_prob).into());
            }
            Method::Custom => {}
            Method::DraftModel(d) => draft(d, &mut map),
            // A draft model's keys alone, as before heads could join (this JSON keys suffix caches
            // on disk); a head's with its "draft_method".
            Method::Auto { model } => match model.as_deref() {
                Some(Method::DraftModel(d)) => draft(d, &mut map),
                Some(Method::Head { method, model, quantization }) => {
                    head(model, quantization, &mut map);
                    map.insert("draft_method".into(), method.name().into());
                }
                _ => {}
            },
            Method::Pard { draft: d, mask_token_id } => {
                draft(d, &mut map);
                map.insert("mask_token_id".into(), (*mask_token_id).into());
            }
            Method::LayerSkip { exit_layer } => {
                map.insert("exit_layer".into(), (*exit_layer).into());
            }
            Method::Head { model, quantization, .. } => head(model, quantization, &mut map),
            Method::QuantizedSelf { quantization, max_model_len } => {
                map.insert("quantization".into(), quantization.clone().into());
                if let Some(len) = max_model_len {
                    map.insert("max_model_len".into(), (*len).into());
                }
            }
        }
        map
    }
}

fn method_name(method: &Method) -> &'static str {
    match method {
        Method::Ngram { .. } => "ngram",
        Method::Suffix(_) => "suffix",
        Method::Custom => "custom",
        Method::DraftModel(_) => "draft_model",
        Method::LayerSkip { .. } => "layer_skip",
        Method::QuantizedSelf { .. } => "quantized_self",
        Method::Pard { .. } => "pard",
        Method::Head { method, .. } => method.name(),
        Method::Auto { .. } => "auto",
    }
}

/// "auto"'s model drafter: by "draft_method" ("draft_model", the default where "model" is given,
/// or a hidden-state head), parsed by that method's own rules; None without either key. A key
/// auto takes for one kind of drafter is refused with the other.
fn auto_model_drafter(
    map: &Map<String, Value>,
    head_params: &dyn Fn(HeadMethod) -> Result<Method>,
    draft_params: &dyn Fn() -> Result<DraftModelParams>,
) -> Result<Option<Method>> {
    let refuse = |key: &str, drafter: &str| -> Result<()> {
        match map.get(key) {
            None | Some(Value::Null) => Ok(()),
            Some(_) => Err(Error::config(format!(
                "'{key}' does not apply to auto's {drafter}; remove it (it is a {})",
                if key == "max_model_len" { "draft model's key" } else { "head's key" }
            ))),
        }
    };
    let drafter = match (map.get("draft_method"), map.get("model")) {
        (None | Some(Value::Null), None | Some(Value::Null)) => {
            refuse("max_model_len", "lookups (no \"model\")")?;
            refuse("quantization", "lookups (no \"model\")")?;
            return Ok(None);
        }
        (None | Some(Value::Null), Some(_)) => "draft_model",
        (Some(Value::String(name)), _) => name.as_str(),
        (Some(other), _) => &other.to_string(),
    };
    if drafter == "draft_model" {
        refuse("quantization", "draft model")?;
        return Ok(Some(Method::DraftModel(draft_params()?)));
    }
    let Some(head) = HeadMethod::from_name(drafter) else {
        return Err(Error::config(format!(
            "'draft_method' is auto's model drafter: \"draft_model\" or a head ({}); got {}",
            HeadMethod::ALL.map(HeadMethod::name).join(", "),
            shown(drafter)
        )));
    };
    refuse("max_model_len", &format!("{drafter} head"))?;
    head_params(head).map(Some)
}

fn optional_count(map: &Map<String, Value>, key: &str) -> Result<Option<usize>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64().map(|v| v as usize)),
        Some(other) => {
            Err(Error::config(format!("'{key}' must be a whole number >= 0 (got {})", shown(&other.to_string()))))
        }
    }
}

/// `optional_count` refused above `max`, before anything is sized by it.
fn bounded_count(map: &Map<String, Value>, key: &str, max: usize) -> Result<Option<usize>> {
    match optional_count(map, key)? {
        Some(value) if value > max => Err(Error::config(format!(
            "'{key}' must be at most {max} (got {value}); larger values only cost memory and time"
        ))),
        value => Ok(value),
    }
}

fn optional_number(map: &Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(other) => Err(Error::config(format!("'{key}' must be a number (got {})", shown(&other.to_string())))),
    }
}

/// `verify_cost_ratios`: `[v(1), ..., v(n)]` with v(1) = 1 and 2 <= n <= k_max + 1 positive
/// finite ratios (a curve shorter than k + 1 is extended by the engine like a measured one).
fn verify_cost_ratios(map: &Map<String, Value>) -> Result<Option<Vec<f64>>> {
    let bad = |what: &str| {
        Error::config(format!(
            "verify_cost_ratios must be a list [1.0, v(2), ..., v(n)] of 2 to {} positive numbers, v(n) = t(n)/t(1) \
             the cost of verifying n tokens over one plain step ({what}); e.g. [1.0, 1.4, 1.6]",
            MAX_SPECULATIVE_TOKENS + 1
        ))
    };
    let list = match map.get("verify_cost_ratios") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("not a list")),
    };
    if !(2..=MAX_SPECULATIVE_TOKENS + 1).contains(&list.len()) {
        return Err(bad(&format!("got {} values", list.len())));
    }
    let ratios: Vec<f64> =
        list.iter().map(|v| v.as_f64().ok_or_else(|| bad("a value is not a number"))).collect::<Result<_>>()?;
    if ratios[0] != 1.0 {
        return Err(bad("v(1) must be 1"));
    }
    if ratios.iter().any(|v| !(v.is_finite() && *v > 0.0 && *v <= 1e4)) {
        return Err(bad("values must be in (0, 1e4]"));
    }
    Ok(Some(ratios))
}

/// How much of a client's text an error message quotes: a config may come from anyone (a server's
/// request), and a megabyte key must not come back as a megabyte message.
pub const MAX_QUOTED_CHARS: usize = 80;

/// `text` for an error message: whole when short, else its first `MAX_QUOTED_CHARS` characters
/// and how long it was.
pub(crate) fn shown(text: &str) -> String {
    match text.char_indices().nth(MAX_QUOTED_CHARS) {
        None => text.to_string(),
        Some((end, _)) => format!("{}... ({} characters)", &text[..end], text.chars().count()),
    }
}

/// The candidate with the smallest edit distance to `word` (its first few characters: no valid
/// name is longer, and the distance costs their product).
fn closest<'a>(word: &str, candidates: &[&'a str]) -> &'a str {
    let word: String = word.chars().take(MAX_QUOTED_CHARS).collect();
    candidates.iter().copied().min_by_key(|c| edit_distance(&word, c)).unwrap_or("")
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SpeculativeConfig> {
        SpeculativeConfig::from_json(text)
    }

    fn error(text: &str) -> String {
        let err = parse(text).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err:?}");
        err.to_string()
    }

    /// Block drafters are charged per draft (`costs::DraftCost`); "auto" as its model drafter.
    #[test]
    fn block_drafters_are_charged_per_draft() {
        let unit = |text: &str| parse(text).unwrap().method.draft_cost_unit();
        let k = r#""num_speculative_tokens": 4"#;
        for (config, expected) in [
            (format!(r#"{{"method": "pard", "model": "d", "mask_token_id": 3, {k}}}"#), DraftCostUnit::Draft),
            (format!(r#"{{"method": "dflash", "model": "h", {k}}}"#), DraftCostUnit::Draft),
            (format!(r#"{{"method": "dspark", "model": "h", {k}}}"#), DraftCostUnit::Draft),
            (r#"{"method": "auto", "draft_method": "dflash", "model": "h"}"#.to_string(), DraftCostUnit::Draft),
            (format!(r#"{{"method": "draft_model", "model": "d", {k}}}"#), DraftCostUnit::Token),
            (format!(r#"{{"method": "eagle3", "model": "h", {k}}}"#), DraftCostUnit::Token),
            (r#"{"method": "auto", "model": "d"}"#.to_string(), DraftCostUnit::Token),
            (r#"{"method": "auto"}"#.to_string(), DraftCostUnit::Token),
            (format!(r#"{{"method": "ngram", {k}}}"#), DraftCostUnit::Token),
        ] {
            assert_eq!(unit(&config), expected, "{config}");
        }
    }

    #[test]
    fn to_json_sorts_its_keys() {
        // It keys suffix caches on disk: the same config must give the same string in every version.
        let json =
            SpeculativeConfig::from_json(r#"{"num_speculative_tokens": 4, "method": "suffix"}"#).unwrap().to_json();
        let map: serde_json::Map<String, Value> = serde_json::from_str(&json).unwrap();
        let keys: Vec<&String> = map.keys().collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted, "{json}");
    }

    #[test]
    fn fills_vllm_defaults() {
        let ngram = parse(r#"{"method": "ngram", "num_speculative_tokens": 4}"#).unwrap();
        assert_eq!(ngram.method, Method::Ngram { prompt_lookup_min: 5, prompt_lookup_max: 5 });
        let ngram = parse(r#"{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}"#).unwrap();
        assert_eq!(ngram.method, Method::Ngram { prompt_lookup_min: 4, prompt_lookup_max: 4 });
        let suffix = parse(r#"{"method": "suffix"}"#).unwrap();
        assert_eq!(suffix.num_speculative_tokens, 24);
        assert!(suffix.adaptive_draft_length);
        let fixed = parse(r#"{"method": "suffix", "adaptive_draft_length": false}"#).unwrap();
        assert!(!fixed.adaptive_draft_length);
        assert_eq!(
            suffix.method,
            Method::Suffix(SuffixParams {
                max_tree_depth: 24,
                max_cached_requests: 10_000,
                max_spec_factor: 1.0,
                min_token_prob: 0.1
            })
        );
        assert_eq!(SpeculativeConfig::from_json(&suffix.to_json()).unwrap(), suffix);
        assert_eq!(SpeculativeConfig::from_json(&ngram.to_json()).unwrap(), ngram);
        for text in [
            r#"{"method": "draft", "model": "d.gguf", "max_model_len": 512, "num_speculative_tokens": 4}"#,
            r#"{"method": "pard", "model": "d.gguf", "mask_token_id": 7, "num_speculative_tokens": 4}"#,
            r#"{"method": "layer_skip", "exit_layer": 8, "num_speculative_tokens": 2, "draft_confidence_threshold": 0.5}"#,
            r#"{"method": "quantized_self", "quantization": "Q2_K", "num_speculative_tokens": 4, "num_speculative_tokens_schedule": "heuristic"}"#,
        ] {
            let config = parse(text).unwrap();
            assert_eq!(SpeculativeConfig::from_json(&config.to_json()).unwrap(), config, "{text}");
        }
        for head in HeadMethod::ALL {
            let c = parse(&format!(r#"{{"method": "{}", "model": "h", "num_speculative_tokens": 3}}"#, head.name()))
                .unwrap();
            assert_eq!(c.method, Method::Head { method: head, model: Some("h".into()), quantization: None });
            assert_eq!(SpeculativeConfig::from_json(&c.to_json()).unwrap(), c);
        }
        let mtp = parse(r#"{"method": "mtp", "num_speculative_tokens": 1}"#).unwrap();
        assert_eq!(mtp.method, Method::Head { method: HeadMethod::Mtp, model: None, quantization: None });
        let q = parse(r#"{"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "quantization": "Q8_0"}"#)
            .unwrap();
        assert_eq!(
            q.method,
            Method::Head { method: HeadMethod::Eagle3, model: Some("h".into()), quantization: Some("q8_0".into()) }
        );
        assert!(error(r#"{"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "quantization": "q4_k"}"#)
            .contains("q8_0"));
        let q = parse(r#"{"method": "quantized_self", "num_speculative_tokens": 4}"#).unwrap();
        assert_eq!(q.method, Method::QuantizedSelf { quantization: "q4_0".into(), max_model_len: None });
        assert_eq!(q.schedule, Schedule::Constant);
        assert_eq!(q.draft_confidence_threshold, 0.0);
    }

    #[test]
    fn bad_input_names_the_fix() {
        assert!(error(r#"{"method": "ngram", "num_spec_tokens": 4}"#).contains("'num_speculative_tokens'"));
        assert!(error(r#"{"method": "ngarm", "num_speculative_tokens": 4}"#).contains("'ngram'"));
        assert!(error(r#"{"method": "eagle", "num_speculative_tokens": 4}"#).contains("needs \"model\""));
        assert!(error(r#"{"method": "eagle3", "model": "h"}"#).contains("num_speculative_tokens"));
        assert!(error(r#"{"method": "draft", "num_speculative_tokens": 4}"#).contains("needs \"model\""));
        assert!(
            error(r#"{"method": "pard", "model": "d.gguf", "num_speculative_tokens": 4}"#).contains("mask_token_id")
        );
        assert!(error(r#"{"method": "layer_skip", "num_speculative_tokens": 4}"#).contains("exit_layer"));
        assert!(
            error(r#"{"method": "ngram", "num_speculative_tokens": 4, "exit_layer": 2}"#).contains("layer_skip only")
        );
        assert!(error(r#"{"method": "quantized_self", "num_speculative_tokens": 4, "quantization": "q1"}"#)
            .contains("q4_0"));
        assert!(error(r#"{"method": "ngram", "num_speculative_tokens": 4, "draft_confidence_threshold": 0.4}"#)
            .contains("no"));
        assert!(error(
            r#"{"method": "layer_skip", "exit_layer": 2, "num_speculative_tokens": 4, "draft_confidence_threshold": 2}"#
        )
        .contains("[0, 1]"));
        assert!(error(
            r#"{"method": "custom", "num_speculative_tokens": 4, "num_speculative_tokens_schedule": "fast"}"#
        )
        .contains("heuristic"));
        assert!(error(r#"{"method": "ngram", "num_speculative_tokens": 0}"#).contains("num_speculative_tokens"));
        assert!(error(r#"{"method": "ngram", "num_speculative_tokens": -2}"#).contains("num_speculative_tokens"));
        assert!(error(r#"{"method": "ngram", "num_speculative_tokens": 2.5}"#).contains("whole number"));
        assert!(error(r#"{"method": "ngram"}"#).contains("needs \"num_speculative_tokens\""));
        assert!(error(
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}"#
        )
        .contains("prompt_lookup_min=4 must be <= prompt_lookup_max=2"));
        assert!(error(r#"{"method": "suffix", "prompt_lookup_min": 2}"#).contains("applies to method 'ngram'"));
        assert!(error(r#"{"method": "suffix", "suffix_decoding_min_token_prob": 2}"#).contains("[0, 1]"));
        // Found by fuzz/fuzz_targets/spec_config.rs before the bound: 3.5e38 became an infinite f32,
        // which to_json wrote as null, so the config did not survive a round trip.
        assert!(error(r#"{"method": "suffix", "suffix_decoding_max_spec_factor": 3.5e38}"#)
            .contains("suffix_decoding_max_spec_factor must be in [0, 64]"));
        assert!(error(r#"{"num_speculative_tokens": 4}"#).contains("needs \"method\""));
        assert!(error(r#"{"method": "suffix", "adaptive_draft_length": 1}"#).contains("true or false"));
        assert!(error("[1, 2]").contains("JSON object"));
        assert!(error("{method: ngram}").contains("not valid JSON"));
    }

    #[test]
    fn size_like_keys_are_bounded() {
        // Each of these used to size an allocation (gigabytes for the first) before any check.
        for (text, key) in [
            (
                r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 100000000}"#,
                "prompt_lookup_max",
            ),
            (r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 65}"#, "prompt_lookup_min"),
            (r#"{"method": "suffix", "suffix_decoding_max_tree_depth": 100000000}"#, "suffix_decoding_max_tree_depth"),
            (
                r#"{"method": "suffix", "suffix_decoding_max_cached_requests": 18446744073709551615}"#,
                "suffix_decoding_max_cached_requests",
            ),
            (r#"{"method": "suffix", "suffix_decoding_max_spec_factor": 1e300}"#, "suffix_decoding_max_spec_factor"),
            (r#"{"method": "ngram", "num_speculative_tokens": 65}"#, "num_speculative_tokens"),
            (
                r#"{"method": "draft", "model": "d.gguf", "num_speculative_tokens": 4, "max_model_len": 1e12}"#,
                "max_model_len",
            ),
            (
                r#"{"method": "draft", "model": "d.gguf", "num_speculative_tokens": 4, "max_model_len": 4294967296000}"#,
                "max_model_len",
            ),
            (r#"{"method": "layer_skip", "exit_layer": 100000, "num_speculative_tokens": 4}"#, "exit_layer"),
            (
                r#"{"method": "pard", "model": "d.gguf", "mask_token_id": 4294967296, "num_speculative_tokens": 4}"#,
                "mask_token_id",
            ),
        ] {
            assert!(error(text).contains(key), "{text}: {}", error(text));
        }
        // The bounds themselves are valid.
        let at_bounds = parse(&format!(
            r#"{{"method": "suffix", "num_speculative_tokens": {MAX_SPECULATIVE_TOKENS},
                "suffix_decoding_max_tree_depth": {MAX_SUFFIX_TREE_DEPTH},
                "suffix_decoding_max_cached_requests": {MAX_SUFFIX_CACHED_REQUESTS}}}"#
        ))
        .unwrap();
        assert_eq!(at_bounds.num_speculative_tokens, MAX_SPECULATIVE_TOKENS);
        let ngram = parse(&format!(
            r#"{{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": {MAX_PROMPT_LOOKUP}}}"#
        ))
        .unwrap();
        assert_eq!(ngram.method, Method::Ngram { prompt_lookup_min: 64, prompt_lookup_max: 64 });
    }

    #[test]
    fn weights_name_what_a_config_loads() {
        let weights = |text: &str| parse(text).unwrap().weights().map(|w| Value::Object(w).to_string());
        for text in [
            r#"{"method": "ngram", "num_speculative_tokens": 4}"#,
            r#"{"method": "suffix"}"#,
            r#"{"method": "custom", "num_speculative_tokens": 4}"#,
            r#"{"method": "layer_skip", "exit_layer": 8, "num_speculative_tokens": 2}"#,
        ] {
            assert_eq!(weights(text), None, "{text}");
        }
        assert_eq!(
            weights(r#"{"method": "draft", "model": "d.gguf", "max_model_len": 512, "num_speculative_tokens": 4}"#),
            Some(r#"{"method":"draft_model","model":"d.gguf"}"#.into())
        );
        assert_eq!(
            weights(r#"{"method": "pard", "model": "p.gguf", "mask_token_id": 7, "num_speculative_tokens": 4}"#),
            Some(r#"{"method":"pard","model":"p.gguf"}"#.into())
        );
        // The default quantization is spelled out: it is what gets built.
        assert_eq!(
            weights(r#"{"method": "quantized_self", "num_speculative_tokens": 4}"#),
            Some(r#"{"method":"quantized_self","quantization":"q4_0"}"#.into())
        );
        for head in HeadMethod::ALL {
            let text = format!(r#"{{"method": "{}", "model": "h", "num_speculative_tokens": 3}}"#, head.name());
            let expected = format!(r#"{{"method":"{}","model":"h","quantization":null}}"#, head.name());
            assert_eq!(weights(&text), Some(expected));
        }
        assert_eq!(
            weights(r#"{"method": "mtp", "quantization": "Q8_0", "num_speculative_tokens": 1}"#),
            Some(r#"{"method":"mtp","model":null,"quantization":"q8_0"}"#.into())
        );
        // Settings beside the weights do not change them.
        assert_eq!(
            weights(r#"{"method": "eagle3", "model": "h", "num_speculative_tokens": 2, "tree": true}"#),
            weights(r#"{"method": "eagle3", "model": "h", "num_speculative_tokens": 5}"#)
        );
    }

    /// A config naming `method` (`spec`'s name or alias) and holding every key `spec` owns
    /// (valid values), plus `extra`.
    fn config_with_every_key(spec: &MethodSpec, method: &str, extra: &str) -> Result<SpeculativeConfig> {
        let mut map: Map<String, Value> = serde_json::from_str(extra).unwrap();
        map.insert("method".into(), method.into());
        // "auto"'s draft-model key and its head keys exclude each other; its head form holds
        // every weight key.
        for key in spec.keys.iter().filter(|&&key| !(spec.name == "auto" && key == "max_model_len")) {
            let value: Value = match *key {
                "model" => "weights.gguf".into(),
                "draft_method" => "eagle3".into(),
                "quantization" => "q8_0".into(),
                "suffix_decoding_max_spec_factor" | "suffix_decoding_min_token_prob" => 0.5.into(),
                "suffix_decoding_max_tree_depth" => methods::DEFAULT_SUFFIX_MAX_TREE_DEPTH.into(),
                _ => 2.into(),
            };
            map.insert((*key).into(), value);
        }
        SpeculativeConfig::from_map(&map)
    }

    #[test]
    fn auto_takes_an_optional_model_drafter_and_refuses_what_it_decides_itself() {
        let auto = SpeculativeConfig::from_json(r#"{"method": "auto"}"#).unwrap();
        assert_eq!(auto.method, Method::Auto { model: None });
        assert_eq!(auto.num_speculative_tokens, methods::DEFAULT_AUTO_K);
        assert_eq!(auto.weights(), None, "auto without a model drafter loads nothing");
        assert_eq!(auto.model_drafter(), None);
        let with_draft = SpeculativeConfig::from_json(r#"{"method": "auto", "model": "d.gguf"}"#).unwrap();
        let draft_model = SpeculativeConfig::from_json(
            r#"{"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2}"#,
        );
        assert_eq!(with_draft.weights(), draft_model.unwrap().weights(), "the same weights as draft_model's");
        assert_eq!(SpeculativeConfig::from_json(&with_draft.to_json()).unwrap(), with_draft);
        assert!(!with_draft.to_json().contains("draft_method"), "a draft model's JSON is as it was");
        let explicit =
            SpeculativeConfig::from_json(r#"{"method": "auto", "model": "d.gguf", "draft_method": "draft_model"}"#);
        assert_eq!(explicit.unwrap(), with_draft);
        // A head joins the lookups by "draft_method"; it loads (and a server checks) the head's
        // weights as the head method's own config does, and drafts with auto's k.
        let with_head = SpeculativeConfig::from_json(
            r#"{"method": "auto", "draft_method": "eagle3", "model": "h", "quantization": "Q8_0"}"#,
        )
        .unwrap();
        let head =
            Method::Head { method: HeadMethod::Eagle3, model: Some("h".into()), quantization: Some("q8_0".into()) };
        assert_eq!(with_head.method, Method::Auto { model: Some(Box::new(head.clone())) });
        let drafter = with_head.model_drafter().unwrap();
        assert_eq!((drafter.method, drafter.num_speculative_tokens), (head, methods::DEFAULT_AUTO_K));
        let eagle3 = SpeculativeConfig::from_json(
            r#"{"method": "eagle3", "model": "h", "quantization": "q8_0", "num_speculative_tokens": 3}"#,
        );
        assert_eq!(with_head.weights(), eagle3.unwrap().weights());
        assert_eq!(SpeculativeConfig::from_json(&with_head.to_json()).unwrap(), with_head);
        let mtp = SpeculativeConfig::from_json(r#"{"method": "auto", "draft_method": "mtp"}"#).unwrap();
        assert_eq!(
            mtp.method,
            Method::Auto {
                model: Some(Box::new(Method::Head { method: HeadMethod::Mtp, model: None, quantization: None }))
            }
        );
        for (bad, says) in [
            (r#"{"method": "auto", "tree": true}"#, "remove \"tree\""),
            (r#"{"method": "auto", "adaptive_draft_length": false}"#, "remove adaptive_draft_length"),
            (r#"{"method": "auto", "model": ""}"#, "needs \"model\""),
            (r#"{"method": "auto", "exit_layer": 3}"#, "exit_layer"),
            (r#"{"method": "auto", "draft_method": "eagle3"}"#, "method 'eagle3' needs \"model\""),
            (r#"{"method": "auto", "draft_method": "ngram", "model": "h"}"#, "'draft_method' is auto's model drafter"),
            (r#"{"method": "auto", "draft_method": 3}"#, "\"draft_model\" or a head (eagle, eagle3, mtp"),
            (
                r#"{"method": "auto", "model": "d.gguf", "quantization": "q8_0"}"#,
                "'quantization' does not apply to auto's draft model",
            ),
            (
                r#"{"method": "auto", "draft_method": "medusa", "model": "h", "max_model_len": 9}"#,
                "'max_model_len' does not apply to auto's medusa head",
            ),
            (r#"{"method": "auto", "quantization": "q8_0"}"#, "'quantization' does not apply to auto's lookups"),
            (
                r#"{"method": "eagle3", "model": "h", "draft_method": "eagle3", "num_speculative_tokens": 3}"#,
                "'draft_method' applies to method auto only",
            ),
        ] {
            let e = SpeculativeConfig::from_json(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn verification_is_auto_by_default_and_only_for_drafts_drawn_from_a_model() {
        let draft = r#""method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2"#;
        let auto = SpeculativeConfig::from_json(&format!("{{{draft}}}")).unwrap();
        assert_eq!(auto.verification, Verification::Auto);
        assert!(!auto.to_json().contains("verification"), "the default is not written: {}", auto.to_json());
        let explicit = SpeculativeConfig::from_json(&format!(r#"{{{draft}, "verification": "auto"}}"#)).unwrap();
        assert_eq!(explicit, auto);
        for (name, verification) in [("coupled", Verification::Coupled), ("rejection", Verification::Rejection)] {
            let config = SpeculativeConfig::from_json(&format!(r#"{{{draft}, "verification": "{name}"}}"#)).unwrap();
            assert_eq!(config.verification, verification);
            assert_eq!(SpeculativeConfig::from_json(&config.to_json()).unwrap(), config);
        }
        assert!(Verification::Auto.couples(true) && !Verification::Auto.couples(false));
        assert!(Verification::Coupled.couples(false) && !Verification::Rejection.couples(true));
        for (bad, says) in [
            (format!(r#"{{{draft}, "verification": "gumbel"}}"#), "must be \"auto\", \"coupled\" or \"rejection\""),
            (format!(r#"{{{draft}, "verification": true}}"#), "must be \"auto\", \"coupled\" or \"rejection\""),
            (
                r#"{"method": "ngram", "num_speculative_tokens": 2, "verification": "coupled"}"#.into(),
                "have no probabilities",
            ),
            (
                r#"{"method": "custom", "num_speculative_tokens": 2, "verification": "rejection"}"#.into(),
                "your proposer",
            ),
        ] {
            let e = SpeculativeConfig::from_json(&bad).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("verification"), "{bad}: {e}");
        }
    }

    #[test]
    fn every_method_parses_as_its_facts_say() {
        for spec in &methods::ALL {
            let name = spec.name;
            let config = config_with_every_key(spec, name, r#"{"num_speculative_tokens": 2}"#)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(config.method_name(), name);
            for alias in spec.aliases {
                let aliased = config_with_every_key(spec, alias, r#"{"num_speculative_tokens": 2}"#);
                assert_eq!(aliased.as_ref().ok(), Some(&config), "{alias}");
            }
            // Weights: exactly the keys the facts name, so no method can take a path the server
            // would not see as weights.
            let weights = config.weights();
            assert_eq!(weights.is_some(), !spec.weight_keys.is_empty(), "{name}");
            if let Some(weights) = weights {
                let keys: Vec<&str> = weights.keys().map(String::as_str).filter(|k| *k != "method").collect();
                let mut expected = spec.weight_keys.to_vec();
                expected.sort();
                assert_eq!(keys, expected, "{name}");
            }
            // Its keys are its own: any other method refuses each of them.
            for key in spec.keys {
                for other in methods::ALL.iter().filter(|o| !o.keys.contains(key)) {
                    let text = format!(r#"{{"method": "{}", "num_speculative_tokens": 2, "{key}": 2}}"#, other.name);
                    assert!(error(&text).contains(&format!("'{key}' applies to method")), "{text}: {}", error(&text));
                }
            }
            // Default k: filled in, or the config is told to set it.
            match (spec.default_k, config_with_every_key(spec, name, "{}")) {
                (Some(k), Ok(config)) => assert_eq!(config.num_speculative_tokens, k, "{name}"),
                (None, Err(e)) => assert!(e.to_string().contains("needs \"num_speculative_tokens\""), "{name}: {e}"),
                (k, parsed) => panic!("{name}: default_k {k:?} but parsing without k gave {parsed:?}"),
            }
            // draft_confidence_threshold applies exactly to the methods whose drafts carry probabilities.
            let thresholded = config_with_every_key(
                spec,
                name,
                r#"{"num_speculative_tokens": 2, "draft_confidence_threshold": 0.5}"#,
            );
            assert_eq!(thresholded.is_ok(), spec.draft_probs, "{name}: {thresholded:?}");
        }
    }

    #[test]
    fn messages_quote_client_text_shortened() {
        let long = "k".repeat(100_000);
        for text in [
            format!(r#"{{"method": "suffix", "{long}": 1}}"#),
            format!(r#"{{"method": "{long}"}}"#),
            format!(r#"{{"method": ["{long}"]}}"#),
            format!(r#"{{"method": "suffix", "adaptive_draft_length": "{long}"}}"#),
            format!(r#"{{"method": "suffix", "tree": "{long}"}}"#),
            format!(r#"{{"method": "ngram", "num_speculative_tokens": "{long}"}}"#),
        ] {
            let message = error(&text);
            assert!(message.len() < 1000 && message.contains("characters)"), "{message}");
        }
        assert_eq!(shown("short"), "short");
        assert_eq!(shown(&"é".repeat(MAX_QUOTED_CHARS)), "é".repeat(MAX_QUOTED_CHARS));
    }

    #[test]
    fn costs_from_the_config_are_checked_and_round_trip() {
        let config = parse(
            r#"{"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [1, 1.5, 2.0], "draft_cost": 0.25}"#,
        )
        .unwrap();
        assert_eq!(config.costs.verify_cost_ratios, Some(vec![1.0, 1.5, 2.0]));
        assert_eq!(config.costs.draft_cost, Some(0.25));
        assert_eq!(SpeculativeConfig::from_json(&config.to_json()).unwrap(), config);
        for (text, fix) in [
            (r#"{"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [2, 3]}"#, "v(1) must be 1"),
            (r#"{"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [1]}"#, "got 1 values"),
            (r#"{"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [1, -1]}"#, "(0, 1e4]"),
            (r#"{"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": 1.5}"#, "not a list"),
            (r#"{"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [1, "x"]}"#, "not a number"),
            (r#"{"method": "custom", "num_speculative_tokens": 4, "draft_cost": -0.5}"#, "draft_cost must be in"),
            (
                r#"{"method": "custom", "num_speculative_tokens": 4, "draft_cost": 0.1, "adaptive_draft_length": false}"#,
                "turns off",
            ),
        ] {
            assert!(error(text).contains(fix), "{text}: {}", error(text));
        }
        let long = format!(
            r#"{{"method": "custom", "num_speculative_tokens": 4, "verify_cost_ratios": [1{}]}}"#,
            ", 1.5".repeat(MAX_SPECULATIVE_TOKENS + 1)
        );
        assert!(error(&long).contains("values"));
    }

    // Found by fuzz/fuzz_targets/spec_config.rs: serde_json's default float parser is off by an ulp
    // for some numbers, so a config did not survive to_json -> from_json; the workspace enables
    // serde_json's float_roundtrip.
    #[test]
    fn every_float_survives_a_round_trip() {
        let config = parse(r#"{"method": "suffix", "draft_cost": 8.081095890145881e-230}"#).unwrap();
        assert_eq!(SpeculativeConfig::from_json(&config.to_json()).unwrap(), config);
    }

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("same", "same"), 0);
    }
}
