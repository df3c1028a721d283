//! What each supported family is, as GGUF metadata read into the shared decoder's flags
//! (`DecoderConfig`). The tensors tell the rest: q/k/v biases, q/k norms, the sandwich norms and
//! fused projections are used when the file has them.
//!
//! Facts follow llama.cpp's graphs for the same files (`src/models/*.cpp`): GGUF llama/mistral
//! q/k are permuted for interleaved RoPE, every other family rotates halves; Gemma 3 scales the
//! embeddings by sqrt(hidden), uses a GELU(tanh) gate, q·k scale 1/sqrt(head_dim), a sliding
//! window on every layer but each 6th (RoPE base 10000 there), and its converter already added 1 to
//! every norm weight; Phi-3's sliding window is off in llama.cpp, so it is off here.
//!
//! Invariant: every config returned here passes `validate`: every size is nonzero and within
//! `MAX_SIZE`, heads divide, the rotated dimensions fit the head, every float is finite and
//! positive where the arithmetic divides by it. An impossible value is a `ModelLoadError` naming
//! the key (GGUF or config.json), the value and the fix, so no decoder meets a shape it cannot
//! build. The tensors' shapes are checked against the config by `gguf_layout.rs` (GGUF) and
//! `hf_dir.rs` (safetensors), for every layer.

use candle_core::Device;

use super::config::DecoderConfig;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// GGUF `general.architecture` values this module reads.
pub const GGUF_ARCHITECTURES: [&str; 6] = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"];

/// Architectures `loader::load` accepts, for error messages.
pub const SUPPORTED_ARCHITECTURES: &str =
    "llama (SmolLM2, Llama 2/3, Mistral), qwen2 (Qwen2/2.5), qwen3, gemma3 and phi3 (GGUF general.architecture)";

/// More layers than any released model has (Llama 3.1 405B: 126); a larger count is corrupt
/// metadata, refused before anything is allocated per layer.
pub const MAX_LAYERS: usize = 1024;

fn check_num_layers(num_layers: usize, keys: &Keys) -> Result<()> {
    if num_layers > MAX_LAYERS {
        return Err(keys.refuse(
            Field::NumLayers,
            num_layers,
            &format!("more layers than any model has (specrs reads up to {MAX_LAYERS})"),
        ));
    }
    Ok(())
}

/// The decoder config of a GGUF file whose `general.architecture` is `arch`.
pub fn from_gguf(gguf: &mut GgufFile, arch: &str) -> Result<DecoderConfig> {
    let path = gguf.path.display().to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let num_layers = gguf.get_usize(&key("block_count"))?;
    check_num_layers(num_layers, &Keys::Gguf { path: &path, arch })?;
    let hidden_size = gguf.get_usize(&key("embedding_length"))?;
    let num_heads = gguf.get_usize(&key("attention.head_count"))?;
    let num_kv_heads = gguf.opt_usize(&key("attention.head_count_kv"))?.unwrap_or(num_heads);
    check_heads(num_heads, num_kv_heads, hidden_size, &Keys::Gguf { path: &path, arch })?;
    let head_dim = gguf.opt_usize(&key("attention.key_length"))?.unwrap_or(hidden_size / num_heads);
    let Some(embedding_dims) = gguf.tensor_dims("token_embd.weight") else {
        return Err(Error::model_load(format!(
            "{path} has no tensor 'token_embd.weight' (the token embeddings); the file is incomplete or not a \
             language model, re-convert it with llama.cpp's convert_hf_to_gguf.py"
        )));
    };
    let vocab_size = embedding_dims.first().copied().unwrap_or(0);
    let rope_theta = gguf.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    let mut config = DecoderConfig {
        architecture: arch.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size: gguf.get_usize(&key("feed_forward_length"))?,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        context_length: gguf.get_usize(&key("context_length"))?,
        rms_eps: gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta,
        rope_theta_local: rope_theta,
        rope_linear_factor: 1.0,
        rope_dims: gguf.opt_usize(&key("rope.dimension_count"))?.unwrap_or(head_dim),
        rope_interleaved: matches!(arch, "llama" | "mistral"),
        rope_freq_factors: rope_freq_factors(gguf)?,
        attention_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_logit_softcap: gguf.opt_f32(&key("attn_logit_softcapping"))?,
        final_logit_softcap: gguf.opt_f32(&key("final_logit_softcapping"))?,
        sliding_window: None,
        sliding_layers: vec![false; num_layers],
        embed_scale: None,
        gelu: false,
        tie_word_embeddings: !gguf.has_tensor("output.weight"),
    };
    match arch {
        "llama" | "mistral" | "qwen2" | "qwen3" => {}
        "gemma3" => {
            config.embed_scale = Some((hidden_size as f32).sqrt());
            config.gelu = true;
            // Gemma 3 27B scales by the model width per head instead (llama.cpp's special case).
            if num_layers == 62 {
                config.attention_scale = 1.0 / ((hidden_size / num_heads) as f32).sqrt();
            }
            config.sliding_window = gguf.opt_usize(&key("attention.sliding_window"))?.filter(|&w| w > 0);
            if config.sliding_window.is_some() {
                let period = gguf.opt_usize(&key("attention.sliding_window_pattern"))?.unwrap_or(6);
                config.sliding_layers = (0..num_layers).map(|i| period == 0 || i % period < period - 1).collect();
                config.rope_theta_local = gguf.opt_f32(&key("rope.freq_base_swa"))?.unwrap_or(10_000.0);
            }
            if gguf.opt_str(&key("rope.scaling.type"))? == Some("linear") {
                config.rope_linear_factor = gguf.opt_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0);
            }
        }
        "phi3" => {
            if gguf.has_tensor("rope_factors_long.weight") {
                return Err(Error::model_load(format!(
                    "{path}: LongRoPE scaling (Phi-3 128k-context models) is not supported; use a 4k-context \
                     Phi-3 model"
                )));
            }
        }
        other => {
            return Err(Error::model_load(format!(
                "{path}: unsupported architecture '{other}'; specrs runs {}",
                SUPPORTED_ARCHITECTURES
            )))
        }
    }
    validate(&config, &Keys::Gguf { path: &path, arch })?;
    Ok(config)
}

/// Llama 3.1-style frequency scaling, which GGUF ships as a tensor of per-dimension divisors
/// (`[rope_dims / 2]`; `validate` checks its length).
fn rope_freq_factors(gguf: &mut GgufFile) -> Result<Option<Vec<f32>>> {
    if !gguf.has_tensor("rope_freqs.weight") {
        return Ok(None);
    }
    let factors = gguf.tensor("rope_freqs.weight", &Device::Cpu)?.dequantize(&Device::Cpu)?;
    Ok(Some(factors.flatten_all()?.to_vec1::<f32>()?))
}

/// The largest size (vocabulary, width, layer count, context length, ...) a config may give: far
/// above any real model, low enough that products of two sizes cannot overflow and that a corrupt
/// value fails here rather than as an allocation of terabytes.
pub const MAX_SIZE: usize = 1 << 24;

/// The quantities `validate` checks, named by where they come from.
#[derive(Debug, Clone, Copy)]
enum Field {
    VocabSize,
    NumLayers,
    HiddenSize,
    IntermediateSize,
    NumHeads,
    NumKvHeads,
    HeadDim,
    RopeDims,
    ContextLength,
    RmsEps,
    RopeTheta,
    RopeThetaLocal,
    RopeScale,
    RopeFreqs,
    AttentionScale,
    AttnSoftcap,
    FinalSoftcap,
    SlidingWindow,
}

/// The file a config came from, to name its keys in errors.
enum Keys<'a> {
    Gguf { path: &'a str, arch: &'a str },
    Hf { path: &'a str },
}

impl Keys<'_> {
    fn path(&self) -> &str {
        match self {
            Keys::Gguf { path, .. } | Keys::Hf { path } => path,
        }
    }

    /// The metadata key (GGUF) or config.json key (HF) that sets `field`.
    fn key(&self, field: Field) -> String {
        match self {
            Keys::Gguf { arch, .. } => {
                let key = match field {
                    Field::VocabSize => return "the rows of tensor 'token_embd.weight'".into(),
                    Field::RopeFreqs => return "the length of tensor 'rope_freqs.weight'".into(),
                    Field::AttentionScale => "attention.key_length",
                    Field::NumLayers => "block_count",
                    Field::HiddenSize => "embedding_length",
                    Field::IntermediateSize => "feed_forward_length",
                    Field::NumHeads => "attention.head_count",
                    Field::NumKvHeads => "attention.head_count_kv",
                    Field::HeadDim => "attention.key_length",
                    Field::RopeDims => "rope.dimension_count",
                    Field::ContextLength => "context_length",
                    Field::RmsEps => "attention.layer_norm_rms_epsilon",
                    Field::RopeTheta => "rope.freq_base",
                    Field::RopeThetaLocal => "rope.freq_base_swa",
                    Field::RopeScale => "rope.scaling.factor",
                    Field::AttnSoftcap => "attn_logit_softcapping",
                    Field::FinalSoftcap => "final_logit_softcapping",
                    Field::SlidingWindow => "attention.sliding_window",
                };
                format!("metadata '{arch}.{key}'")
            }
            Keys::Hf { .. } => {
                let key = match field {
                    Field::VocabSize => "vocab_size",
                    Field::NumLayers => "num_hidden_layers",
                    Field::HiddenSize => "hidden_size",
                    Field::IntermediateSize => "intermediate_size",
                    Field::NumHeads => "num_attention_heads",
                    Field::NumKvHeads => "num_key_value_heads",
                    Field::HeadDim => "head_dim",
                    Field::RopeDims => "partial_rotary_factor",
                    Field::ContextLength => "max_position_embeddings",
                    Field::RmsEps => "rms_norm_eps",
                    Field::RopeTheta => "rope_theta",
                    Field::RopeThetaLocal => "rope_local_base_freq",
                    Field::RopeScale => "rope_scaling.factor",
                    Field::RopeFreqs => "rope_scaling",
                    Field::AttentionScale => "query_pre_attn_scalar",
                    Field::AttnSoftcap => "attn_logit_softcapping",
                    Field::FinalSoftcap => "final_logit_softcapping",
                    Field::SlidingWindow => "sliding_window",
                };
                format!("'{key}'")
            }
        }
    }

    /// "{path}: {key} is {value}, {why}; {fix}".
    fn refuse(&self, field: Field, value: impl std::fmt::Display, why: &str) -> Error {
        let fix = match self {
            Keys::Gguf { .. } => "the GGUF metadata is corrupt; re-download the file or re-convert the model",
            Keys::Hf { .. } => "fix config.json (or download the model's own config.json again)",
        };
        Error::model_load(format!("{}: {} is {value}, {why}; {fix}", self.path(), self.key(field)))
    }
}

/// Head counts the config can divide by: both nonzero and within `MAX_SIZE`, the kv heads a
/// divisor of the query heads. Checked before `hidden / heads` is computed.
fn check_heads(num_heads: usize, num_kv_heads: usize, hidden_size: usize, keys: &Keys) -> Result<()> {
    for (field, value) in [(Field::NumHeads, num_heads), (Field::NumKvHeads, num_kv_heads)] {
        if value == 0 || value > MAX_SIZE {
            return Err(keys.refuse(field, value, &format!("but a model needs 1..={MAX_SIZE} heads")));
        }
    }
    if !num_heads.is_multiple_of(num_kv_heads) {
        return Err(keys.refuse(
            Field::NumKvHeads,
            num_kv_heads,
            &format!("which does not divide the {num_heads} query heads (grouped-query attention shares each kv head)"),
        ));
    }
    if hidden_size > MAX_SIZE {
        return Err(keys.refuse(Field::HiddenSize, hidden_size, &format!("above the limit of {MAX_SIZE}")));
    }
    Ok(())
}

/// Refuses every value the decoders cannot compute with (see the module invariant).
fn validate(c: &DecoderConfig, keys: &Keys) -> Result<()> {
    check_heads(c.num_heads, c.num_kv_heads, c.hidden_size, keys)?;
    for (field, value) in [
        (Field::VocabSize, c.vocab_size),
        (Field::NumLayers, c.num_layers),
        (Field::HiddenSize, c.hidden_size),
        (Field::IntermediateSize, c.intermediate_size),
        (Field::HeadDim, c.head_dim),
        (Field::ContextLength, c.context_length),
    ] {
        if value == 0 || value > MAX_SIZE {
            return Err(keys.refuse(field, value, &format!("but it must be in 1..={MAX_SIZE}")));
        }
    }
    if c.rope_dims == 0 || c.rope_dims > c.head_dim || !c.rope_dims.is_multiple_of(2) {
        return Err(keys.refuse(
            Field::RopeDims,
            format!("{} rotated dimensions", c.rope_dims),
            &format!("but RoPE rotates an even number of dimensions from 2 to the head dimension {}", c.head_dim),
        ));
    }
    if let Some(factors) = &c.rope_freq_factors {
        if factors.len() != c.rope_dims / 2 || factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
            return Err(keys.refuse(
                Field::RopeFreqs,
                factors.len(),
                &format!("but RoPE needs {} positive finite frequency factors (one per rotated pair)", c.rope_dims / 2),
            ));
        }
    }
    let positive = [
        (Field::RmsEps, Some(c.rms_eps)),
        (Field::RopeTheta, Some(c.rope_theta)),
        (Field::RopeThetaLocal, Some(c.rope_theta_local)),
        (Field::RopeScale, Some(c.rope_linear_factor)),
        (Field::AttentionScale, Some(c.attention_scale)),
        (Field::AttnSoftcap, c.attn_logit_softcap),
        (Field::FinalSoftcap, c.final_logit_softcap),
    ];
    for (field, value) in positive {
        if let Some(v) = value.filter(|v| !v.is_finite() || *v <= 0.0) {
            return Err(keys.refuse(field, v, "but it must be a positive finite number"));
        }
    }
    if c.rms_eps >= 1.0 {
        return Err(keys.refuse(Field::RmsEps, c.rms_eps, "but an RMSNorm epsilon is a small positive number (~1e-6)"));
    }
    if c.sliding_window == Some(0) {
        return Err(keys.refuse(Field::SlidingWindow, 0, "but a window must hold at least the token itself"));
    }
    if c.sliding_layers.len() != c.num_layers {
        return Err(Error::model_load(format!(
            "{}: {} layers are marked sliding or full for {} layers; the layer types and {} disagree",
            keys.path(),
            c.sliding_layers.len(),
            c.num_layers,
            keys.key(Field::NumLayers)
        )));
    }
    Ok(())
}

/// transformers `model_type` values `from_hf_config` reads.
pub const HF_MODEL_TYPES: [&str; 6] = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"];

/// The decoder config of a Hugging Face `config.json` (`source` names the file in errors).
pub fn from_hf_config(config: &serde_json::Value, source: &str) -> Result<DecoderConfig> {
    let model_type = config.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
    if !HF_MODEL_TYPES.contains(&model_type) {
        return Err(Error::model_load(format!(
            "{source}: unsupported model_type '{model_type}' (architectures {}); specrs reads safetensors \
             models of types {}",
            config.get("architectures").map_or("?".into(), |a| a.to_string()),
            HF_MODEL_TYPES.join(", ")
        )));
    }
    let int = |key: &str| -> Result<usize> {
        config
            .get(key)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| Error::model_load(format!("{source}: '{key}' is missing or not a positive integer")))
    };
    let opt_int = |key: &str| config.get(key).and_then(|v| v.as_u64()).map(|v| v as usize);
    let opt_f32 = |key: &str| config.get(key).and_then(|v| v.as_f64()).map(|v| v as f32);
    let (hidden_size, num_heads, num_layers) =
        (int("hidden_size")?, int("num_attention_heads")?, int("num_hidden_layers")?);
    check_num_layers(num_layers, &Keys::Hf { path: source })?;
    let num_kv_heads = opt_int("num_key_value_heads").unwrap_or(num_heads);
    let keys = Keys::Hf { path: source };
    check_heads(num_heads, num_kv_heads, hidden_size, &keys)?;
    let head_dim = opt_int("head_dim").unwrap_or(hidden_size / num_heads);
    // Newer transformers nest the RoPE settings under rope_parameters, per layer type where the
    // types differ (Gemma 3: full_attention / sliding_attention).
    let rope_all = config.get("rope_parameters").or_else(|| config.get("rope_scaling")).filter(|v| v.is_object());
    let rope = rope_all.map(|r| r.get("full_attention").unwrap_or(r));
    let rope_local = rope_all.and_then(|r| r.get("sliding_attention"));
    let theta_of =
        |r: Option<&serde_json::Value>| r.and_then(|r| r.get("rope_theta")).and_then(|v| v.as_f64()).map(|v| v as f32);
    let rope_theta = opt_f32("rope_theta").or_else(|| theta_of(rope)).unwrap_or(10_000.0);
    let rope_type = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(|v| v.as_str());
    let rope_dims = (opt_f32("partial_rotary_factor").unwrap_or(1.0) * head_dim as f32) as usize;
    let mut c = DecoderConfig {
        architecture: model_type.trim_end_matches("_text").to_string(),
        vocab_size: int("vocab_size")?,
        hidden_size,
        intermediate_size: int("intermediate_size")?,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        context_length: int("max_position_embeddings")?,
        rms_eps: opt_f32("rms_norm_eps").unwrap_or(1e-6),
        rope_theta,
        rope_theta_local: rope_theta,
        rope_linear_factor: 1.0,
        rope_dims,
        rope_interleaved: false,
        rope_freq_factors: None,
        attention_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_logit_softcap: opt_f32("attn_logit_softcapping"),
        final_logit_softcap: opt_f32("final_logit_softcapping"),
        sliding_window: None,
        sliding_layers: vec![false; num_layers],
        embed_scale: None,
        gelu: false,
        tie_word_embeddings: config
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(model_type == "gemma3_text"),
    };
    match rope_type {
        None | Some("default") => {}
        Some("linear") => {
            c.rope_linear_factor = rope.and_then(|r| r.get("factor")).and_then(|v| v.as_f64()).unwrap_or(1.0) as f32
        }
        Some(other) => {
            return Err(Error::model_load(format!(
                "{source}: rope scaling '{other}' is not supported (only linear); use a model without it"
            )))
        }
    }
    if model_type == "mistral" {
        if let Some(window) = opt_int("sliding_window") {
            c.sliding_window = Some(window);
            c.sliding_layers = vec![true; num_layers];
        }
    }
    if model_type == "gemma3_text" {
        c.embed_scale = Some((hidden_size as f32).sqrt());
        c.gelu = true;
        c.attention_scale = 1.0 / opt_f32("query_pre_attn_scalar").unwrap_or(head_dim as f32).sqrt();
        c.rope_theta_local = opt_f32("rope_local_base_freq").or_else(|| theta_of(rope_local)).unwrap_or(10_000.0);
        c.sliding_window = opt_int("sliding_window");
        c.sliding_layers = match config.get("layer_types").and_then(|v| v.as_array()) {
            Some(types) => types.iter().map(|t| t.as_str() == Some("sliding_attention")).collect(),
            None => {
                let period = opt_int("sliding_window_pattern").unwrap_or(6);
                (0..num_layers).map(|i| period == 0 || i % period < period - 1).collect()
            }
        };
        if c.sliding_layers.len() != num_layers {
            return Err(Error::model_load(format!(
                "{source}: layer_types has {} entries for {num_layers} layers",
                c.sliding_layers.len()
            )));
        }
    }
    validate(&c, &keys)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::gguf_file::{self, Content, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Tensor};
    use serde_json::json;

    use super::*;

    fn config(model_type: &str, changes: serde_json::Value) -> serde_json::Value {
        let mut c = json!({"model_type": model_type, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-6});
        c.as_object_mut().unwrap().extend(changes.as_object().unwrap().clone());
        c
    }

    #[test]
    fn impossible_values_are_refused_naming_key_and_value() {
        assert!(from_hf_config(&config("llama", json!({})), "config.json").is_ok());
        for (model_type, change, message) in [
            ("llama", json!({"rms_norm_eps": 0.0}), "'rms_norm_eps' is 0, but it must be a positive finite number"),
            ("llama", json!({"rms_norm_eps": 2.0}), "'rms_norm_eps' is 2, but an RMSNorm epsilon"),
            ("llama", json!({"partial_rotary_factor": 0.0}), "'partial_rotary_factor' is 0 rotated dimensions"),
            ("llama", json!({"num_key_value_heads": 3}), "'num_key_value_heads' is 3, which does not divide the 4"),
            ("llama", json!({"vocab_size": 0}), "'vocab_size' is 0, but it must be in 1..=16777216"),
            ("llama", json!({"num_hidden_layers": 1u64 << 30}), "'num_hidden_layers' is 1073741824, more layers than"),
            ("llama", json!({"hidden_size": 1u64 << 40}), "'hidden_size' is 1099511627776, above the limit"),
            ("llama", json!({"rope_theta": -1.0}), "'rope_theta' is -1"),
            ("mistral", json!({"sliding_window": 0}), "'sliding_window' is 0, but a window must hold"),
            ("gemma3_text", json!({"query_pre_attn_scalar": 0.0}), "'query_pre_attn_scalar' is inf"),
            ("gemma3_text", json!({"attn_logit_softcapping": 0.0}), "'attn_logit_softcapping' is 0"),
            ("gemma3_text", json!({"final_logit_softcapping": -30.0}), "'final_logit_softcapping' is -30"),
        ] {
            let err = from_hf_config(&config(model_type, change.clone()), "config.json").unwrap_err();
            assert!(matches!(err, Error::ModelLoad(_)), "{change}: {err}");
            let text = err.to_string();
            assert!(text.starts_with("config.json: ") && text.contains(message), "{change}: {text}");
            assert!(text.contains("fix config.json"), "{text}");
        }
    }

    const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/gguf/llama-q8_0.gguf");

    type Metadata = Vec<(String, Value)>;
    type Tensors = Vec<(String, QTensor)>;

    /// The golden tiny llama (hidden 64, FFN 128, 2 layers) with `edit` applied, as GGUF bytes.
    fn edited(edit: impl FnOnce(&mut Metadata, &mut Tensors)) -> Vec<u8> {
        let bytes = std::fs::read(GOLDEN).unwrap();
        let mut reader = std::io::Cursor::new(&bytes);
        let content = Content::read(&mut reader).unwrap();
        let mut tensors: Tensors = content
            .tensor_infos
            .keys()
            .map(|name| (name.clone(), content.tensor(&mut reader, name, &Device::Cpu).unwrap()))
            .collect();
        let mut metadata: Metadata = content.metadata.into_iter().collect();
        edit(&mut metadata, &mut tensors);
        let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let mut out = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut out, &metadata, &tensors).unwrap();
        out.into_inner()
    }

    fn load(bytes: Vec<u8>) -> Result<Box<dyn crate::model::CausalLm>> {
        crate::model::loader::load(&mut GgufFile::from_bytes("edited.gguf", bytes)?, &Device::Cpu)
    }

    fn load_error(bytes: Vec<u8>) -> String {
        let err = load(bytes).err().expect("the edited file loaded");
        assert!(matches!(err, Error::ModelLoad(_)), "{err:?}");
        err.to_string()
    }

    #[test]
    fn the_unedited_golden_file_loads() {
        load(edited(|_, _| {})).unwrap();
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: a layer past the first with a tensor of the wrong
    // shape loaded, and the first forward panicked indexing a matmul's rows.
    #[test]
    fn every_layers_tensor_shapes_are_checked() {
        let bytes = edited(|_, tensors| {
            let narrow = Tensor::zeros((64, 32), DType::F32, &Device::Cpu).unwrap();
            let (_, t) = tensors.iter_mut().find(|(name, _)| name == "blk.1.ffn_down.weight").unwrap();
            *t = QTensor::quantize(&narrow, GgmlDType::Q8_0).unwrap();
        });
        let err = load_error(bytes);
        assert!(
            err.contains("'blk.1.ffn_down.weight' has shape [64, 32], but the metadata implies [64, 128]"),
            "{err}"
        );
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: a huge context_length made candle/decoder.rs (the path
    // of a model with attention soft-capping) allocate RoPE tables for all of it, an abort.
    #[test]
    fn a_context_length_past_any_model_is_refused_before_allocating() {
        let bytes = edited(|metadata, _| {
            let (_, v) = metadata.iter_mut().find(|(k, _)| k == "llama.context_length").unwrap();
            *v = Value::U64(1 << 40);
        });
        let err = load_error(bytes);
        assert!(err.contains("'llama.context_length' is 1099511627776, but it must be in 1..="), "{err}");
        let config = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 0
        });
        let err = from_hf_config(&config, "config.json").err().unwrap().to_string();
        assert!(err.contains("'max_position_embeddings' is 0, but it must be in 1..="), "{err}");
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: rope.dimension_count = 0 loaded, and candle's rotary
    // kernel (candle/decoder.rs, the path of a model with attention soft-capping) panicked on it.
    #[test]
    fn zero_rotary_dimensions_are_refused() {
        let bytes = edited(|metadata, _| metadata.push(("llama.rope.dimension_count".into(), Value::U32(0))));
        assert!(load_error(bytes).contains("'llama.rope.dimension_count' is 0 rotated dimensions"));
        let config = serde_json::json!({
            "model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 128, "partial_rotary_factor": 0.0
        });
        let err = from_hf_config(&config, "config.json").err().unwrap().to_string();
        assert!(err.contains("'partial_rotary_factor' is 0 rotated dimensions"), "{err}");
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: a huge block_count allocated per-layer tables
    // until the process ran out of memory.
    #[test]
    fn a_block_count_past_any_model_is_refused_before_allocating() {
        let bytes = edited(|metadata, _| {
            let (_, v) = metadata.iter_mut().find(|(k, _)| k == "llama.block_count").unwrap();
            *v = Value::U64(1 << 40);
        });
        assert!(load_error(bytes).contains("'llama.block_count' is 1099511627776, more layers than any model has"));
        let config = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1u64 << 40,
            "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 128
        });
        let err = from_hf_config(&config, "config.json").err().unwrap().to_string();
        assert!(err.contains("'num_hidden_layers' is 1099511627776, more layers than any model has"), "{err}");
    }
}
