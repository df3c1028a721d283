//! `DecoderConfig`: everything a decoder block needs to know about a family beyond its tensors,
//! read by both backends (`cpu/decoder.rs`, `candle/decoder.rs`) and written by the family readers
//! (`families.rs` for GGUF keys and HF `config.json`, `llama_config.rs` for random models).
//!
//! Invariant: it holds facts only (sizes and flags), no weights and no backend choice, so it sits
//! below every file that reads or writes it and no import runs in a circle through it.

use super::llama_config::LlamaConfig;

/// Everything the shared block needs to know about a family, beyond the tensors themselves.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Base of the sliding-window layers' rotary embedding (Gemma 3: 10000).
    pub rope_theta_local: f32,
    /// Global layers' positions are divided by this (linear RoPE scaling; 1 = none).
    pub rope_linear_factor: f32,
    /// Rotated dimensions of each head (< head_dim: partial rotary, Phi-3.5/4).
    pub rope_dims: usize,
    /// Pairs (2i, 2i+1) instead of (i, i + rope_dims/2): GGUF llama, whose q/k were permuted.
    pub rope_interleaved: bool,
    /// Llama-3.1-style per-dimension frequency divisors (`[rope_dims / 2]`).
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Multiplier of q·k (usually 1/sqrt(head_dim)).
    pub attention_scale: f32,
    pub attn_logit_softcap: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    /// Keys a query sees in a sliding-window layer, itself included.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it uses the sliding window.
    pub sliding_layers: Vec<bool>,
    /// Embeddings multiplied by this (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f32>,
    /// GELU (tanh) gate instead of SiLU (Gemma).
    pub gelu: bool,
    pub tie_word_embeddings: bool,
}

impl DecoderConfig {
    /// Bytes of keys and values one query row reads at `context` positions, `value_bytes` per
    /// stored value: every layer's, a sliding-window layer's up to its window.
    pub fn kv_read_bytes(&self, context: usize, value_bytes: usize) -> usize {
        let row = 2 * self.num_kv_heads * self.head_dim * value_bytes;
        let window = |sliding: bool| match self.sliding_window {
            Some(w) if sliding => context.min(w),
            _ => context,
        };
        self.sliding_layers.iter().map(|&sliding| window(sliding) * row).sum()
    }

    /// A plain Llama with transformers' layout (half-split RoPE).
    pub fn from_llama(config: &LlamaConfig) -> Self {
        let head_dim = config.head_dim();
        Self {
            architecture: "llama".into(),
            vocab_size: config.vocab_size,
            hidden_size: config.hidden_size,
            intermediate_size: config.intermediate_size,
            num_layers: config.num_hidden_layers,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_kv_heads(),
            head_dim,
            context_length: config.max_position_embeddings,
            rms_eps: config.rms_norm_eps,
            rope_theta: config.rope_theta,
            rope_theta_local: config.rope_theta,
            rope_linear_factor: 1.0,
            rope_dims: head_dim,
            rope_interleaved: false,
            rope_freq_factors: None,
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_logit_softcap: None,
            final_logit_softcap: None,
            sliding_window: None,
            sliding_layers: vec![false; config.num_hidden_layers],
            embed_scale: None,
            gelu: false,
            tie_word_embeddings: config.tie_word_embeddings,
        }
    }
}
