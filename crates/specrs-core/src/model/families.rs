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
//! Invariant: every config returned here passes `check`, so the decoder never meets a shape it
//! cannot build.

use candle_core::Device;

use super::decoder::DecoderConfig;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// GGUF `general.architecture` values this module reads.
pub const GGUF_ARCHITECTURES: [&str; 6] = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"];

/// More layers than any released model has (Llama 3.1 405B: 126); a larger count is corrupt
/// metadata, refused before anything is allocated per layer.
pub const MAX_LAYERS: usize = 1024;

/// Past the longest context any model specrs runs was trained for (Qwen2.5-1M: 1,010,000 tokens).
/// `decoder.rs` precomputes RoPE tables for the whole context, so a corrupt count must stop here.
pub const MAX_CONTEXT_LENGTH: usize = 1 << 24;

fn check_context_length(context_length: usize, key: &str, path: &str) -> Result<usize> {
    if context_length == 0 || context_length > MAX_CONTEXT_LENGTH {
        return Err(Error::model_load(format!(
            "{path}: {key} = {context_length} is not a context length specrs can run (1..={MAX_CONTEXT_LENGTH}); \
             the metadata is corrupt"
        )));
    }
    Ok(context_length)
}

fn check_num_layers(num_layers: usize, key: &str, path: &str) -> Result<()> {
    if num_layers > MAX_LAYERS {
        return Err(Error::model_load(format!(
            "{path}: {key} = {num_layers} is more layers than any model has (specrs reads up to {MAX_LAYERS}); \
             the metadata is corrupt"
        )));
    }
    Ok(())
}

/// The decoder config of a GGUF file whose `general.architecture` is `arch`.
pub fn from_gguf(gguf: &mut GgufFile, arch: &str) -> Result<DecoderConfig> {
    let path = gguf.path.display().to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let num_layers = gguf.get_usize(&key("block_count"))?;
    check_num_layers(num_layers, &key("block_count"), &path)?;
    let hidden_size = gguf.get_usize(&key("embedding_length"))?;
    let num_heads = gguf.get_usize(&key("attention.head_count"))?;
    let num_kv_heads = gguf.opt_usize(&key("attention.head_count_kv"))?.unwrap_or(num_heads);
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(Error::model_load(format!(
            "{path}: {num_heads} attention heads cannot share {num_kv_heads} kv heads; the GGUF metadata is corrupt"
        )));
    }
    let head_dim = gguf.opt_usize(&key("attention.key_length"))?.unwrap_or(hidden_size / num_heads);
    let vocab_size = gguf.tensor_dims("token_embd.weight").and_then(|d| d.first().copied()).unwrap_or(0);
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
        context_length: check_context_length(gguf.get_usize(&key("context_length"))?, &key("context_length"), &path)?,
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
                super::SUPPORTED_ARCHITECTURES
            )))
        }
    }
    check(&config, &path, gguf)?;
    Ok(config)
}

/// Llama 3.1-style frequency scaling, which GGUF ships as a tensor of per-dimension divisors.
fn rope_freq_factors(gguf: &mut GgufFile) -> Result<Option<Vec<f32>>> {
    if !gguf.has_tensor("rope_freqs.weight") {
        return Ok(None);
    }
    Ok(Some(gguf.tensor("rope_freqs.weight", &Device::Cpu)?.dequantize(&Device::Cpu)?.to_vec1::<f32>()?))
}

/// Shapes the metadata promises against the tensors the file holds: every tensor either decoder
/// reads, in every layer, when the file has it (a missing one is named when it is loaded). The
/// kernels index rows by these shapes, so a mismatch must stop here, not inside a matmul.
fn check(c: &DecoderConfig, path: &str, gguf: &GgufFile) -> Result<()> {
    // rope_dims 0 (no rotation) is no family's, and candle's rotary kernel panics on it.
    if c.vocab_size == 0
        || c.num_layers == 0
        || c.head_dim == 0
        || c.rope_dims == 0
        || c.rope_dims > c.head_dim
        || !c.rope_dims.is_multiple_of(2)
    {
        return Err(Error::model_load(format!(
            "{path}: inconsistent shape (vocab {}, {} layers, head dim {}, rope dims {}); the GGUF metadata is corrupt",
            c.vocab_size, c.num_layers, c.head_dim, c.rope_dims
        )));
    }
    // Saturating: the sizes are the file's, and a product past usize can only mismatch.
    let (hidden, ffn) = (c.hidden_size, c.intermediate_size);
    let q_width = c.num_heads.saturating_mul(c.head_dim);
    let kv_width = c.num_kv_heads.saturating_mul(c.head_dim);
    let qkv_width = q_width.saturating_add(kv_width.saturating_mul(2));
    let mut expected = vec![
        ("token_embd.weight".to_string(), vec![c.vocab_size, hidden]),
        ("output.weight".to_string(), vec![c.vocab_size, hidden]),
        ("output_norm.weight".to_string(), vec![hidden]),
        ("rope_freqs.weight".to_string(), vec![c.rope_dims / 2]),
    ];
    let fused_ffn = |i: usize| !gguf.has_tensor(&format!("blk.{i}.ffn_gate.weight"));
    for i in 0..c.num_layers {
        let per_layer: [(&str, Vec<usize>); 22] = [
            ("attn_norm.weight", vec![hidden]),
            ("attn_qkv.weight", vec![qkv_width, hidden]),
            ("attn_qkv.bias", vec![qkv_width]),
            ("attn_q.weight", vec![q_width, hidden]),
            ("attn_q.bias", vec![q_width]),
            ("attn_k.weight", vec![kv_width, hidden]),
            ("attn_k.bias", vec![kv_width]),
            ("attn_v.weight", vec![kv_width, hidden]),
            ("attn_v.bias", vec![kv_width]),
            ("attn_q_norm.weight", vec![c.head_dim]),
            ("attn_k_norm.weight", vec![c.head_dim]),
            ("attn_output.weight", vec![hidden, q_width]),
            ("attn_output.bias", vec![hidden]),
            ("post_attention_norm.weight", vec![hidden]),
            ("ffn_norm.weight", vec![hidden]),
            ("ffn_gate.weight", vec![ffn, hidden]),
            ("ffn_gate.bias", vec![ffn]),
            ("ffn_up.weight", vec![if fused_ffn(i) { ffn.saturating_mul(2) } else { ffn }, hidden]),
            ("ffn_up.bias", vec![if fused_ffn(i) { ffn.saturating_mul(2) } else { ffn }]),
            ("ffn_down.weight", vec![hidden, ffn]),
            ("ffn_down.bias", vec![hidden]),
            ("post_ffw_norm.weight", vec![hidden]),
        ];
        expected.extend(per_layer.into_iter().map(|(part, dims)| (format!("blk.{i}.{part}"), dims)));
    }
    // The attention needs q, k and v one way or the other: fused, or all three.
    if !gguf.has_tensor("blk.0.attn_qkv.weight") && !gguf.has_tensor("blk.0.attn_q.weight") {
        return Err(Error::model_load(format!(
            "{path}: has neither 'blk.0.attn_qkv.weight' nor 'blk.0.attn_q.weight'; the file is not a supported model"
        )));
    }
    for (name, want) in expected {
        if let Some(got) = gguf.tensor_dims(&name) {
            if got != want {
                return Err(Error::model_load(format!(
                    "{path}: tensor '{name}' has shape {got:?}, the metadata implies {want:?}; the file is corrupt"
                )));
            }
        }
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
    check_num_layers(num_layers, "num_hidden_layers", source)?;
    let num_kv_heads = opt_int("num_key_value_heads").unwrap_or(num_heads);
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(Error::model_load(format!(
            "{source}: {num_heads} attention heads cannot share {num_kv_heads} kv heads"
        )));
    }
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
        context_length: check_context_length(int("max_position_embeddings")?, "max_position_embeddings", source)?,
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
    if c.vocab_size == 0
        || num_layers == 0
        || head_dim == 0
        || c.rope_dims == 0
        || c.rope_dims > head_dim
        || !c.rope_dims.is_multiple_of(2)
    {
        return Err(Error::model_load(format!(
            "{source}: inconsistent shape (vocab {}, {num_layers} layers, head dim {head_dim}, rope dims {})",
            c.vocab_size, c.rope_dims
        )));
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::gguf_file::{self, Content, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Tensor};

    use super::*;

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
        crate::model::load(&mut GgufFile::from_bytes("edited.gguf", bytes)?, &Device::Cpu)
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
        assert!(err.contains("'blk.1.ffn_down.weight' has shape [64, 32], the metadata implies [64, 128]"), "{err}");
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: a huge context_length made decoder.rs (the path
    // of a model with attention soft-capping) allocate RoPE tables for all of it, an abort.
    #[test]
    fn a_context_length_past_any_model_is_refused_before_allocating() {
        let bytes = edited(|metadata, _| {
            let (_, v) = metadata.iter_mut().find(|(k, _)| k == "llama.context_length").unwrap();
            *v = Value::U64(1 << 40);
        });
        let err = load_error(bytes);
        assert!(err.contains("llama.context_length = 1099511627776 is not a context length specrs can run"), "{err}");
        let config = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 0
        });
        let err = from_hf_config(&config, "config.json").err().unwrap().to_string();
        assert!(err.contains("max_position_embeddings = 0 is not a context length"), "{err}");
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: rope.dimension_count = 0 loaded, and candle's rotary
    // kernel (decoder.rs, the path of a model with attention soft-capping) panicked on it.
    #[test]
    fn zero_rotary_dimensions_are_refused() {
        let bytes = edited(|metadata, _| metadata.push(("llama.rope.dimension_count".into(), Value::U32(0))));
        assert!(load_error(bytes).contains("rope dims 0"));
        let config = serde_json::json!({
            "model_type": "phi3", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 128, "partial_rotary_factor": 0.0
        });
        let err = from_hf_config(&config, "config.json").err().unwrap().to_string();
        assert!(err.contains("rope dims 0"), "{err}");
    }

    // Found by fuzz/fuzz_targets/gguf_edits.rs: a huge block_count allocated per-layer tables
    // until the process ran out of memory.
    #[test]
    fn a_block_count_past_any_model_is_refused_before_allocating() {
        let bytes = edited(|metadata, _| {
            let (_, v) = metadata.iter_mut().find(|(k, _)| k == "llama.block_count").unwrap();
            *v = Value::U64(1 << 40);
        });
        assert!(load_error(bytes).contains("llama.block_count = 1099511627776 is more layers than any model has"));
        let config = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1u64 << 40,
            "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 128
        });
        let err = from_hf_config(&config, "config.json").err().unwrap().to_string();
        assert!(err.contains("num_hidden_layers = 1099511627776 is more layers than any model has"), "{err}");
    }
}
