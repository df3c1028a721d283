//! Llama hyperparameters with Hugging Face `config.json` names: the shape of a random-weight
//! model (`Engine.random`), which `candle/decoder.rs` builds. GGUF metadata is read by `families.rs`.
//!
//! Invariant: a `LlamaConfig` that exists is self-consistent (heads divide the width, kv heads
//! divide the heads), so model code never re-checks shapes it derives from it.

use serde::Deserialize;

use crate::error::{Error, Result};

/// Field names and defaults follow transformers' `LlamaConfig`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "default_context")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_context() -> usize {
    2048
}
fn default_rope_theta() -> f32 {
    10_000.0
}
fn default_rms_eps() -> f32 {
    1e-6
}

impl LlamaConfig {
    /// Llama 3 8B's shape (the GPU benchmark's target).
    pub fn llama3_8b() -> Self {
        Self {
            vocab_size: 128_256,
            hidden_size: 4096,
            intermediate_size: 14_336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: Some(8),
            max_position_embeddings: 8192,
            rope_theta: 500_000.0,
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
        }
    }

    /// Parses JSON with transformers' names; an unknown key is an error naming the known ones.
    pub fn from_json(text: &str) -> Result<Self> {
        let config: Self = serde_json::from_str(text).map_err(|e| Error::config(format!("llama config: {e}")))?;
        config.validated("llama config")
    }

    fn validated(self, source: &str) -> Result<Self> {
        let (hidden, heads, kv_heads) = (self.hidden_size, self.num_attention_heads, self.num_kv_heads());
        if heads == 0 || hidden % heads != 0 || kv_heads == 0 || heads % kv_heads != 0 || (hidden / heads) % 2 != 0 {
            return Err(Error::model_load(format!(
                "{source}: inconsistent attention shape (width {hidden}, {heads} heads, {kv_heads} kv heads); \
                 the heads must divide the width into an even head size and the kv heads must divide the heads"
            )));
        }
        if self.vocab_size == 0 || self.num_hidden_layers == 0 || self.intermediate_size == 0 {
            return Err(Error::model_load(format!(
                "{source}: vocab_size, num_hidden_layers and intermediate_size must be positive"
            )));
        }
        Ok(self)
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_uses_transformers_names_and_rejects_unknown_keys() {
        let config = LlamaConfig::from_json(
            r#"{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#,
        )
        .unwrap();
        assert_eq!((config.head_dim(), config.num_kv_heads(), config.max_position_embeddings), (8, 2, 2048));
        let err = LlamaConfig::from_json(r#"{"vocab_size": 64, "hiden_size": 32}"#).unwrap_err();
        assert!(matches!(err, Error::Config(_)) && err.to_string().contains("hiden_size"), "{err}");
        let err = LlamaConfig::from_json(
            r#"{"vocab_size": 64, "hidden_size": 30, "intermediate_size": 48,
                "num_hidden_layers": 2, "num_attention_heads": 4}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("inconsistent attention shape"), "{err}");
    }
}
