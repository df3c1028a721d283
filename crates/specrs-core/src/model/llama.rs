//! Llama-architecture decoder (SmolLM2, Llama 2/3, Mistral) on GGUF weights, on the CPU.
//!
//! Pre-norm blocks: RMSNorm -> grouped-query attention with interleaved RoPE (GGUF stores q/k
//! permuted for it) -> residual -> RMSNorm -> SwiGLU MLP -> residual.
//!
//! Invariant: a token's logits are bitwise the same however the sequence was split into forwards
//! (prefill, single steps, a k+1-token verify pass): every step is row-independent (quantized
//! matmuls quantize each activation row on its own; attention is computed row by row, see
//! `attention.rs`). Greedy speculative decoding is therefore exactly plain greedy decoding.
//!
//! Numerics follow llama.cpp's CPU path where it matters for agreement with it: int8 activation
//! quantization (`qlinear.rs`), f16 KV cache and attention rounding (`attention.rs`), RMSNorm with
//! an f64 sum of squares, RoPE angles advanced by repeated multiplication.
//!
//! Performance notes: the hidden state stays in plain `Vec<f32>` rows between the kernels (no
//! per-op tensor allocation); the LM head runs only on the rows that need logits (prefill needs
//! one). Tried and dropped: candle's matmul + softmax attention, with KV heads expanded or with
//! query heads folded into rows; both changed logits by up to ~1 between batched and single-token
//! forwards.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use super::attention::{apply_rope, causal_attention, rope_tables, HeadShape};
use super::decoder::DecoderConfig;
use super::ggml_math::swiglu;
use super::qlinear::QLinear;
use super::{check_exit_layer, CausalLm, GgufWeights, LogitRows, ModelInfo};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;

struct Block {
    attn_norm: Vec<f32>,
    wq: QLinear,
    wk: QLinear,
    wv: QLinear,
    wo: QLinear,
    ffn_norm: Vec<f32>,
    w_gate: QLinear,
    w_up: QLinear,
    w_down: QLinear,
}

pub struct Llama {
    info: ModelInfo,
    hidden: usize,
    num_heads: usize,
    rms_eps: f32,
    embed: Arc<QTensor>,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    lm_head: QLinear,
    /// `[context_length, head_dim / 2]` rotary tables.
    cos: Vec<f32>,
    sin: Vec<f32>,
    device: Device,
    weight_bytes: usize,
}

impl GgufWeights<'_> {
    fn qlinear(&mut self, name: &str) -> Result<QLinear> {
        QLinear::new(self.qtensor(name)?)
    }

    /// Norm weights are small and used in f32.
    fn f32_vec(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
    }
}

impl Llama {
    /// Whether this file fits this implementation: a GGUF llama (q/k permuted for interleaved
    /// RoPE) with full rotary dims and heads exactly spanning the width. Anything else runs on
    /// `decoder.rs`.
    pub fn runs(config: &DecoderConfig) -> bool {
        matches!(config.architecture.as_str(), "llama" | "mistral")
            && config.rope_dims == config.head_dim
            && config.num_heads * config.head_dim == config.hidden_size
            && config.sliding_window.is_none()
    }

    /// `config` comes from `families::from_gguf` and passed `runs`.
    pub fn load(gguf: &mut GgufFile, config: DecoderConfig) -> Result<Self> {
        let (hidden, num_heads, head_dim) = (config.hidden_size, config.num_heads, config.head_dim);
        let device = Device::Cpu;
        let mut w = GgufWeights::new(gguf, &device);
        let embed = w.qtensor("token_embd.weight")?;
        let lm_head =
            if config.tie_word_embeddings { QLinear::new(embed.clone())? } else { w.qlinear("output.weight")? };
        let final_norm = w.f32_vec("output_norm.weight")?;
        let blocks = (0..config.num_layers)
            .map(|i| {
                let name = |part: &str| format!("blk.{i}.{part}.weight");
                Ok(Block {
                    attn_norm: w.f32_vec(&name("attn_norm"))?,
                    wq: w.qlinear(&name("attn_q"))?,
                    wk: w.qlinear(&name("attn_k"))?,
                    wv: w.qlinear(&name("attn_v"))?,
                    wo: w.qlinear(&name("attn_output"))?,
                    ffn_norm: w.f32_vec(&name("ffn_norm"))?,
                    w_gate: w.qlinear(&name("ffn_gate"))?,
                    w_up: w.qlinear(&name("ffn_up"))?,
                    w_down: w.qlinear(&name("ffn_down"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weight_bytes = w.num_bytes;
        let (cos, sin) =
            rope_tables(head_dim, config.rope_theta, config.context_length, config.rope_freq_factors.as_deref());

        Ok(Self {
            info: ModelInfo {
                architecture: config.architecture.clone(),
                vocab_size: config.vocab_size,
                context_length: config.context_length,
                num_layers: config.num_layers,
                num_kv_heads: config.num_kv_heads,
                head_dim,
            },
            hidden,
            num_heads,
            rms_eps: config.rms_eps,
            embed,
            blocks,
            final_norm,
            lm_head,
            cos,
            sin,
            device,
            weight_bytes,
        })
    }
}

/// RMSNorm of each `weight.len()`-wide row, as ggml computes it (f64 sum of squares).
fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(weight.len()) {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / row.len() as f64) as f32 + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(&v, &w)| (v * scale) * w));
    }
    out
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

impl CausalLm for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let i = &self.info;
        Ok(KvCache::new(i.num_layers, i.num_kv_heads * i.head_dim, capacity, i.context_length))
    }

    fn forward_rows(&self, tokens: &[u32], cache: &mut KvCache, rows: LogitRows) -> Result<Tensor> {
        self.forward_layers(tokens, cache, self.blocks.len(), rows)
    }

    fn forward_early_exit(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        num_layers: usize,
        rows: LogitRows,
    ) -> Result<Tensor> {
        check_exit_layer(num_layers, self.blocks.len())?;
        self.forward_layers(tokens, cache, num_layers, rows)
    }
}

impl Llama {
    /// The first `num_layers` blocks, then the final norm and the LM head.
    fn forward_layers(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        num_layers: usize,
        rows: LogitRows,
    ) -> Result<Tensor> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::Internal("forward called with no tokens".into()));
        }
        let past = cache.len();
        cache.reserve(n)?;
        let (num_heads, num_kv_heads, head_dim) = (self.num_heads, self.info.num_kv_heads, self.info.head_dim);
        let shape = HeadShape { num_heads, num_kv_heads, head_dim };

        let ids = Tensor::new(tokens, &self.device)?;
        let mut x: Vec<f32> = self.embed.embedding(&ids)?.flatten_all()?.to_vec1()?; // [n, hidden]
        for (layer, block) in self.blocks[..num_layers].iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, self.rms_eps);
            let mut q = block.wq.forward_rows(&h, n)?; // [n, heads * hd]
            let mut k = block.wk.forward_rows(&h, n)?; // [n, kv_heads * hd]
            let v = block.wv.forward_rows(&h, n)?;
            apply_rope(&mut q, num_heads, head_dim, past, &self.cos, &self.sin);
            apply_rope(&mut k, num_kv_heads, head_dim, past, &self.cos, &self.sin);
            cache.append(layer, &k, &v)?;
            let (k_cache, v_cache) = cache.layer(layer);
            let attn = causal_attention(&q, k_cache, v_cache, past, shape); // [n, heads * hd]
            add_assign(&mut x, &block.wo.forward_rows(&attn, n)?);

            let h = rms_norm(&x, &block.ffn_norm, self.rms_eps);
            let mut gate = block.w_gate.forward_rows(&h, n)?; // [n, ffn]
            let up = block.w_up.forward_rows(&h, n)?;
            swiglu(&mut gate, &up);
            add_assign(&mut x, &block.w_down.forward_rows(&gate, n)?);
        }
        cache.commit(n);

        let (first_row, num_rows) = match rows {
            LogitRows::All => (0, n),
            LogitRows::Last => (n - 1, 1),
        };
        let last = &x[first_row * self.hidden..];
        let normed = rms_norm(last, &self.final_norm, self.rms_eps);
        let logits = self.lm_head.forward_rows(&normed, num_rows)?;
        Ok(Tensor::from_vec(logits, (num_rows, self.lm_head.out_features()), &self.device)?)
        // [rows, vocab]
    }
}
