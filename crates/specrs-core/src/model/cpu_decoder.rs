//! The CPU decoder: GGUF llama/mistral (SmolLM2, Llama 2/3) and Gemma 3, computed as llama.cpp's
//! CPU backend computes them, with hand-written AVX2 kernels.
//!
//! A block: RMSNorm -> q/k/v projections -> (per-head q/k RMSNorm: Gemma) -> RoPE (interleaved
//! pairs for GGUF llama, whose q/k were permuted for it; halves for Gemma, with a base of its own on
//! the sliding-window layers) -> grouped-query attention over the f16 cache (windowed on Gemma's
//! local layers) -> output projection (-> RMSNorm: Gemma) -> residual -> RMSNorm -> SiLU (llama)
//! or GELU (Gemma) gated MLP (-> RMSNorm: Gemma) -> residual.
//!
//! Invariant: a token's logits are bitwise the same however the sequence was split into forwards
//! (prefill, single steps, a k+1-token verify pass): every step is row-independent (quantized
//! matmuls quantize each activation row on its own; attention is computed row by row, see
//! `attention.rs`). Greedy speculative decoding is therefore exactly plain greedy decoding.
//!
//! Numerics follow llama.cpp's AVX2 build op by op: int8 activation quantization and its dot
//! orders (`qlinear.rs`, `kquants.rs`), f16 KV cache and attention rounding (`attention.rs`),
//! RMSNorm with an f64 sum of squares, ggml's RoPE angles (`rope.rs`), its exponential and f16
//! GELU table (`ggml_math.rs`). llama.cpp itself computes one token and a batch differently;
//! which of its paths is reproduced is per family:
//! - llama (SmolLM2 Q4_1): the two differ only in attention's summation order; the batched one
//!   (prefill, verification) is reproduced, and the logits equal llama.cpp's bitwise;
//! - Gemma 3 (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 weights): llama.cpp picks its matmul kernels by batch
//!   size (tinyBLAS from 2 rows, repacked Q4_K GEMM per 4 rows, tiled K-quant matmuls from 8), so
//!   its batched arithmetic depends on the batch; its single-token path is the one well-defined
//!   reference, and it is reproduced: greedy output equals llama.cpp's token-by-token decoding.
//!
//! Performance notes: the hidden state stays in plain `Vec<f32>` rows between the kernels (no
//! per-op tensor allocation); the LM head runs only on the rows that need logits (prefill needs
//! one). Tried and dropped: candle's matmul + softmax attention, with KV heads expanded or with
//! query heads folded into rows; both changed logits by up to ~1 between batched and single-token
//! forwards.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use super::attention::{Attention, DotOrder, HeadShape};
use super::decoder::DecoderConfig;
use super::ggml_math::{geglu, swiglu};
use super::qlinear::QLinear;
use super::rope::{Pairing, Rope};
use super::{check_exit_layer, CausalLm, GgufWeights, LogitRows, ModelInfo};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;

struct Block {
    attn_norm: Vec<f32>,
    wq: QLinear,
    wk: QLinear,
    wv: QLinear,
    /// `[head_dim]`, Gemma.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    wo: QLinear,
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    w_gate: QLinear,
    w_up: QLinear,
    w_down: QLinear,
    post_ffn_norm: Option<Vec<f32>>,
}

pub struct CpuDecoder {
    info: ModelInfo,
    config: DecoderConfig,
    embed: Arc<QTensor>,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    lm_head: QLinear,
    global_rope: Rope,
    /// Sliding-window layers' rotation when its base differs (Gemma: 10000).
    local_rope: Option<Rope>,
    /// Gemma multiplies q by the attention scale before q·k (llama.cpp's graph), llama scales q·k
    /// inside the softmax; the two round differently unless the scale is a power of two.
    scale_query: bool,
    order: DotOrder,
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

    fn optional_f32_vec(&mut self, name: &str) -> Result<Option<Vec<f32>>> {
        if self.gguf.has_tensor(name) {
            Ok(Some(self.f32_vec(name)?))
        } else {
            Ok(None)
        }
    }
}

impl CpuDecoder {
    /// Whether this file fits this implementation: a GGUF llama/mistral without a sliding window
    /// or a Gemma 3, neither with q/k/v biases, attention soft-capping or partial rotary. Anything
    /// else runs on `decoder.rs`.
    pub fn runs(config: &DecoderConfig, gguf: &GgufFile) -> bool {
        let family = match config.architecture.as_str() {
            "llama" | "mistral" => config.sliding_window.is_none(),
            "gemma3" => true,
            _ => false,
        };
        family
            && config.rope_dims == config.head_dim
            && config.attn_logit_softcap.is_none()
            && !gguf.has_tensor("blk.0.attn_q.bias")
    }

    /// `config` comes from `families::from_gguf` and passed `runs`.
    pub fn load(gguf: &mut GgufFile, config: DecoderConfig) -> Result<Self> {
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
                    q_norm: w.optional_f32_vec(&name("attn_q_norm"))?,
                    k_norm: w.optional_f32_vec(&name("attn_k_norm"))?,
                    wo: w.qlinear(&name("attn_output"))?,
                    post_attn_norm: w.optional_f32_vec(&name("post_attention_norm"))?,
                    ffn_norm: w.f32_vec(&name("ffn_norm"))?,
                    w_gate: w.qlinear(&name("ffn_gate"))?,
                    w_up: w.qlinear(&name("ffn_up"))?,
                    w_down: w.qlinear(&name("ffn_down"))?,
                    post_ffn_norm: w.optional_f32_vec(&name("post_ffw_norm"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weight_bytes = w.num_bytes;
        let pairing = if config.rope_interleaved { Pairing::Interleaved } else { Pairing::Halves };
        let factors = config.rope_freq_factors.as_deref();
        let rope = |base: f32, freq_scale: f32| Rope::new(config.rope_dims, base, freq_scale, factors, pairing);
        let global_rope = rope(config.rope_theta, 1.0 / config.rope_linear_factor);
        let local_rope = config.sliding_layers.iter().any(|&s| s).then(|| rope(config.rope_theta_local, 1.0));
        let gemma = config.architecture == "gemma3";
        Ok(Self {
            info: ModelInfo {
                architecture: config.architecture.clone(),
                vocab_size: config.vocab_size,
                context_length: config.context_length,
                num_layers: config.num_layers,
                num_kv_heads: config.num_kv_heads,
                head_dim: config.head_dim,
            },
            embed,
            blocks,
            final_norm,
            lm_head,
            global_rope,
            local_rope,
            scale_query: gemma,
            order: if gemma { DotOrder::SingleToken } else { DotOrder::Batched },
            device,
            weight_bytes,
            config,
        })
    }
}

/// RMSNorm of each `weight.len()`-wide row, as ggml computes it (f64 sum of squares, f32 mean).
fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(weight.len()) {
        let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / row.len() as f64) as f32 + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(&v, &w)| (v * scale) * w));
    }
    out
}

fn norm_if(x: Vec<f32>, weight: Option<&Vec<f32>>, eps: f32) -> Vec<f32> {
    match weight {
        Some(w) => rms_norm(&x, w, eps),
        None => x,
    }
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

impl CausalLm for CpuDecoder {
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

impl CpuDecoder {
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
        let c = &self.config;
        let (eps, head_dim) = (c.rms_eps, c.head_dim);
        let shape = HeadShape { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim };
        let global_angles = self.global_rope.tables(past, n);
        let local_angles = self.local_rope.as_ref().map(|rope| rope.tables(past, n));

        let ids = Tensor::new(tokens, &self.device)?;
        let mut x: Vec<f32> = self.embed.embedding(&ids)?.flatten_all()?.to_vec1()?; // [n, hidden]
        if let Some(scale) = c.embed_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        for (layer, block) in self.blocks[..num_layers].iter().enumerate() {
            let sliding = c.sliding_layers[layer];
            let (rope, (cos, sin)) = match (&self.local_rope, &local_angles) {
                (Some(rope), Some(angles)) if sliding => (rope, angles),
                _ => (&self.global_rope, &global_angles),
            };
            let h = rms_norm(&x, &block.attn_norm, eps);
            let q = block.wq.forward_rows(&h, n)?; // [n, heads * hd]
            let k = block.wk.forward_rows(&h, n)?; // [n, kv_heads * hd]
            let v = block.wv.forward_rows(&h, n)?;
            let mut q = norm_if(q, block.q_norm.as_ref(), eps);
            let mut k = norm_if(k, block.k_norm.as_ref(), eps);
            rope.apply(&mut q, c.num_heads, head_dim, cos, sin);
            rope.apply(&mut k, c.num_kv_heads, head_dim, cos, sin);
            let score_scale = if self.scale_query {
                q.iter_mut().for_each(|v| *v *= c.attention_scale);
                1.0
            } else {
                c.attention_scale
            };
            cache.append(layer, &k, &v)?;
            let (k_cache, v_cache) = cache.layer(layer);
            let window = c.sliding_window.filter(|_| sliding);
            let attention = Attention { shape, scale: score_scale, window, order: self.order };
            let attn = attention.forward(&q, k_cache, v_cache, past); // [n, heads * hd]
            let out = norm_if(block.wo.forward_rows(&attn, n)?, block.post_attn_norm.as_ref(), eps);
            add_assign(&mut x, &out);

            let h = rms_norm(&x, &block.ffn_norm, eps);
            let mut gate = block.w_gate.forward_rows(&h, n)?; // [n, ffn]
            let up = block.w_up.forward_rows(&h, n)?;
            if c.gelu {
                geglu(&mut gate, &up);
            } else {
                swiglu(&mut gate, &up);
            }
            let down = norm_if(block.w_down.forward_rows(&gate, n)?, block.post_ffn_norm.as_ref(), eps);
            add_assign(&mut x, &down);
        }
        cache.commit(n);

        let (first_row, num_rows) = match rows {
            LogitRows::All => (0, n),
            LogitRows::Last => (n - 1, 1),
        };
        let last = &x[first_row * c.hidden_size..];
        let normed = rms_norm(last, &self.final_norm, eps);
        let mut logits = self.lm_head.forward_rows(&normed, num_rows)?;
        if let Some(cap) = c.final_logit_softcap {
            // ggml's order: scale by 1/cap, tanh, scale by cap.
            let inv = 1.0 / cap;
            logits.iter_mut().for_each(|v| *v = (*v * inv).tanh() * cap);
        }
        Ok(Tensor::from_vec(logits, (num_rows, self.lm_head.out_features()), &self.device)?)
        // [rows, vocab]
    }
}
