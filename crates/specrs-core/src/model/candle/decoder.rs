//! The shared decoder-only transformer, written with candle tensor ops so it runs on any candle
//! device: every family on CUDA, and on the CPU what `cpu/decoder.rs` does not run (HF safetensors
//! directories, seeded random models, GGUF with attention soft-capping). Llama, Mistral, Qwen2/2.5,
//! Qwen3, Gemma 3 and Phi-3 are one block with flags (`DecoderConfig`); which GGUF keys set them
//! is in `families.rs`. Weights are GGUF tensors (specrs' kernels on the CPU, candle's quantized
//! matmul on CUDA) or dense bf16/f16/f32 tensors (safetensors, seeded random weights).
//!
//! A block: RMSNorm -> q/k/v projections (+ bias: Qwen2) -> per-head q/k RMSNorm (Qwen3, Gemma 3)
//! -> rotary embedding (interleaved for GGUF llama, whose q/k are permuted for it; half-split
//! otherwise; optionally on the first `rope_dims` only: Phi-3) -> grouped-query attention (scaled,
//! optionally soft-capped, optionally within a sliding window) -> output projection
//! (-> RMSNorm: Gemma 3) -> residual -> RMSNorm -> SiLU- or GELU-gated MLP (-> RMSNorm: Gemma 3)
//! -> residual.
//!
//! Invariant: `forward_rows` scores every new token against the cached keys plus its own
//! predecessors (causal, windowed where the layer says so), and appends exactly the new positions
//! to the cache. Unlike `cpu/decoder.rs` it does not promise bitwise row independence: cuBLAS (and
//! candle's CPU gemm for dense weights) picks its kernels by shape, so a k+1-token verify can round
//! differently from single steps, and greedy speculative output equals plain greedy output except
//! at near-ties (the GPU check counts them). On the CPU with weights specrs' kernels run (Q4_0,
//! Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) every matmul is row-independent and attention is computed one
//! query row at a time, so there the two are equal.
//! Attention runs in f32 over the cache (kept in the model's dtype: f32 for quantized weights,
//! bf16/f16 for dense ones), which keeps those differences at the matmuls' rounding.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::ops::{rms_norm, softmax_last_dim};
use candle_nn::rotary_emb::{rope, rope_i};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;
use crate::model::config::DecoderConfig;
use crate::model::forward::check_token_ids;
use crate::model::hf_dir::HfWeights;
use crate::model::kernels::qlinear::QLinear;
use crate::model::layout::{
    block_tensor, block_weight, global_tensor, global_weight, projections, Family, Global, Naming, Projection, Role,
};
use crate::model::llama_config::LlamaConfig;
use crate::model::random;
use crate::model::rope::{Pairing, Rope};
use crate::model::{select_vocab, CausalLm, ForwardBatch, ForwardOutput, GgufWeights, ModelInfo, Tap};

/// How `Decoder::random` stores its weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightFormat {
    Dense(DType),
    Quantized(GgmlDType),
}

enum Weight {
    /// specrs' own CPU kernels (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K): each weight block is read
    /// once for up to 8 rows, so a verify pass costs little more than one step, and rows never
    /// change each other.
    Native(QLinear),
    Quantized(QMatMul),
    /// `[out_features, in_features]`, in the activation dtype.
    Dense(Tensor),
}

struct Linear {
    weight: Weight,
    /// `[out_features]`, in the activation dtype.
    bias: Option<Tensor>,
}

impl Linear {
    fn new(weight: Weight) -> Self {
        Self { weight, bias: None }
    }

    /// `[n, in_features]` -> `[n, out_features]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::Quantized(w) => w.forward(x)?,
            Weight::Dense(w) => x.matmul(&w.t()?)?,
            Weight::Native(w) => {
                let n = x.dim(0)?;
                let rows = w.forward_rows(&x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, n)?;
                Tensor::from_vec(rows, (n, w.out_features()), x.device())?
            }
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// A quantized weight: specrs' native kernel where it has one for this type on the CPU, candle's
/// quantized matmul otherwise (other types, and CUDA).
fn quantized_weight(t: Arc<QTensor>) -> Result<Weight> {
    if t.device().is_cpu() {
        let native = QLinear::new(t.clone())?;
        if native.is_native() {
            return Ok(Weight::Native(native));
        }
    }
    Ok(Weight::Quantized(QMatMul::from_arc(t)?))
}

/// Projections of one input (q/k/v, or gate/up) computed by one matmul whose output is split:
/// stored fused (Phi-3), or dense weights stacked at load. On a GPU a decode step is dozens of
/// small launches per layer, and each one saved is time saved.
enum Projections {
    Separate(Vec<Linear>),
    Fused { linear: Linear, widths: Vec<usize> },
}

impl Projections {
    /// Stacks dense weights (and their biases); quantized ones stay separate.
    fn new(linears: Vec<Linear>) -> Result<Self> {
        let dense: Option<Vec<&Tensor>> = linears
            .iter()
            .map(|l| match &l.weight {
                Weight::Dense(w) => Some(w),
                Weight::Quantized(_) | Weight::Native(_) => None,
            })
            .collect();
        let Some(weights) = dense else { return Ok(Projections::Separate(linears)) };
        let widths = weights.iter().map(|w| w.dim(0)).collect::<candle_core::Result<Vec<_>>>()?;
        let weight = Weight::Dense(Tensor::cat(&weights, 0)?);
        let bias = if linears.iter().any(|l| l.bias.is_some()) {
            let parts = linears
                .iter()
                .zip(&widths)
                .map(|(l, &width)| match &l.bias {
                    Some(b) => Ok(b.clone()),
                    None => Ok(Tensor::zeros(width, weights[0].dtype(), weights[0].device())?),
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::cat(&parts, 0)?)
        } else {
            None
        };
        Ok(Projections::Fused { linear: Linear { weight, bias }, widths })
    }

    /// `[n, in_features]` -> one `[n, width]` tensor per projection.
    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(linears) => linears.iter().map(|l| l.forward(x)).collect(),
            Projections::Fused { linear, widths } => {
                let y = linear.forward(x)?;
                let mut start = 0;
                widths
                    .iter()
                    .map(|&width| {
                        start += width;
                        Ok(y.narrow(1, start - width, width)?)
                    })
                    .collect()
            }
        }
    }
}

struct Block {
    attn_norm: Tensor,
    /// q, k, v.
    qkv: Projections,
    /// `[head_dim]` f32, per-head RMSNorm of q and k before the rotation.
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    wo: Linear,
    post_attn_norm: Option<Tensor>,
    ffn_norm: Tensor,
    /// gate, up.
    gate_up: Projections,
    w_down: Linear,
    post_ffn_norm: Option<Tensor>,
}

/// `[context_length, rope_dims / 2]` f32 rotary tables.
struct RopeTables {
    cos: Tensor,
    sin: Tensor,
}

pub struct Decoder {
    info: ModelInfo,
    config: DecoderConfig,
    /// Dtype of the hidden state between blocks: f32 for quantized weights, else the weights'.
    dtype: DType,
    /// `[vocab_size, hidden_size]` in `dtype`.
    embed: Tensor,
    blocks: Vec<Block>,
    final_norm: Tensor,
    lm_head: Linear,
    global_rope: RopeTables,
    /// For sliding-window layers when their base differs.
    local_rope: Option<RopeTables>,
    device: Device,
    weight_bytes: usize,
}

impl GgufWeights<'_> {
    /// `{name}.weight`, with `{name}.bias` when the file has one.
    fn linear(&mut self, name: &str) -> Result<Linear> {
        let weight = quantized_weight(self.qtensor(&format!("{name}.weight"))?)?;
        let bias = self.optional(&format!("{name}.bias"), Self::vector)?;
        Ok(Linear { weight, bias })
    }

    fn projections(&mut self, stored: Projection) -> Result<Projections> {
        match stored {
            Projection::Fused { tensor, widths } => Ok(Projections::Fused { linear: self.linear(&tensor)?, widths }),
            Projection::Separate(tensors) => {
                Projections::new(tensors.iter().map(|t| self.linear(t)).collect::<Result<_>>()?)
            }
        }
    }

    /// A small tensor used in f32 (norms, biases).
    fn vector(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(self.device)?)
    }
}

impl Decoder {
    /// A GGUF file of a family `families.rs` knows, on `device`.
    pub fn from_gguf(gguf: &mut GgufFile, config: DecoderConfig, device: &Device) -> Result<Self> {
        let mut w = GgufWeights::new(gguf, &config, device)?;
        let family = Family::of(&config);
        let global = |g| global_weight(Naming::Gguf, g);
        let embed_q = w.qtensor(&global(Global::Embedding))?;
        // The lookup table is dequantized once (as candle's own quantized llama does): a gather
        // from quantized blocks has no CUDA kernel.
        let embed = embed_q.dequantize(device)?;
        let lm_head = if config.tie_word_embeddings {
            Linear::new(quantized_weight(embed_q)?)
        } else {
            w.linear(global_tensor(Naming::Gguf, Global::Output))?
        };
        let final_norm = w.vector(&global(Global::FinalNorm))?;
        let blocks = (0..config.num_layers)
            .map(|i| {
                let t = |role| block_tensor(Naming::Gguf, &family, i, role);
                let tw = |role| block_weight(Naming::Gguf, &family, i, role);
                // Phi-3 stores q/k/v as one tensor, and gate/up as one `ffn_up` twice as wide.
                let (qkv, gate_up) = projections(Naming::Gguf, &config, i, |name| w.gguf.has_tensor(name));
                let (qkv, gate_up) = (w.projections(qkv)?, w.projections(gate_up)?);
                Ok(Block {
                    attn_norm: w.vector(&tw(Role::AttnNorm))?,
                    qkv,
                    q_norm: w.optional(&tw(Role::QNorm), GgufWeights::vector)?,
                    k_norm: w.optional(&tw(Role::KNorm), GgufWeights::vector)?,
                    wo: w.linear(&t(Role::AttnOutput))?,
                    post_attn_norm: w.optional(&tw(Role::PostAttnNorm), GgufWeights::vector)?,
                    ffn_norm: w.vector(&tw(Role::FfnNorm))?,
                    gate_up,
                    w_down: w.linear(&t(Role::Down))?,
                    post_ffn_norm: w.optional(&tw(Role::PostFfnNorm), GgufWeights::vector)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weight_bytes = w.num_bytes;
        Self::assemble(config, DType::F32, embed, blocks, final_norm, lm_head, device, weight_bytes)
    }

    /// A Hugging Face safetensors model (`hf_dir::open`), with transformers' tensor names.
    pub fn from_hf(w: &mut HfWeights, config: DecoderConfig) -> Result<Self> {
        let c = &config;
        let family = Family::of(c);
        let (hidden, ffn, vocab) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (q_width, kv_width) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        // Gemma's RMSNorm multiplies by (1 + weight); the stored weight is the offset.
        let norm = |w: &mut HfWeights, name: &str, width: usize| -> Result<Tensor> {
            let t = w.tensor(name, &[width])?;
            Ok(if family.hf_norm_offset { (t + 1.0)? } else { t })
        };
        // As in gguf_layout.rs: Qwen3 and Gemma 3 need their q/k norms, Qwen2 its q/k/v biases.
        let (qk_norm_required, qkv_bias_required) = (family.qk_norm, family.qkv_bias);
        let f32_norm = |w: &mut HfWeights, name: &str| -> Result<Option<Tensor>> {
            if !w.has(name) && !qk_norm_required {
                return Ok(None);
            }
            Ok(Some(norm(w, name, c.head_dim)?.to_dtype(DType::F32)?))
        };
        let linear_with = |w: &mut HfWeights, name: &str, rows: usize, cols: usize, bias_required: bool| {
            let bias_name = format!("{name}.bias");
            let bias =
                if bias_required { Some(w.tensor(&bias_name, &[rows])?) } else { w.optional(&bias_name, &[rows])? };
            Ok::<_, Error>(Linear { weight: Weight::Dense(w.tensor(&format!("{name}.weight"), &[rows, cols])?), bias })
        };
        let linear = |w: &mut HfWeights, name: &str, rows: usize, cols: usize| linear_with(w, name, rows, cols, false);
        let embed = w.tensor(&global_weight(Naming::Hf, Global::Embedding), &[vocab, hidden])?;
        let lm_head = if w.has(&global_weight(Naming::Hf, Global::Output)) && !c.tie_word_embeddings {
            linear(w, global_tensor(Naming::Hf, Global::Output), vocab, hidden)?
        } else {
            Linear::new(Weight::Dense(embed.clone()))
        };
        let final_norm = norm(w, &global_weight(Naming::Hf, Global::FinalNorm), hidden)?;
        let blocks = (0..c.num_layers)
            .map(|i| {
                let t = |role| block_tensor(Naming::Hf, &family, i, role);
                let tw = |role| block_weight(Naming::Hf, &family, i, role);
                let qkv = if w.has(&tw(Role::Qkv)) {
                    Projections::Fused {
                        linear: linear(w, &t(Role::Qkv), q_width + 2 * kv_width, hidden)?,
                        widths: vec![q_width, kv_width, kv_width],
                    }
                } else {
                    let bias = qkv_bias_required;
                    Projections::new(vec![
                        linear_with(w, &t(Role::Q), q_width, hidden, bias)?,
                        linear_with(w, &t(Role::K), kv_width, hidden, bias)?,
                        linear_with(w, &t(Role::V), kv_width, hidden, bias)?,
                    ])?
                };
                let gate_up = if w.has(&tw(Role::GateUp)) {
                    Projections::Fused { linear: linear(w, &t(Role::GateUp), 2 * ffn, hidden)?, widths: vec![ffn, ffn] }
                } else {
                    Projections::new(vec![
                        linear(w, &t(Role::Gate), ffn, hidden)?,
                        linear(w, &t(Role::Up), ffn, hidden)?,
                    ])?
                };
                let sandwich = |w: &mut HfWeights, role| -> Result<Option<Tensor>> {
                    if family.sandwich_norms {
                        Ok(Some(norm(w, &tw(role), hidden)?))
                    } else {
                        Ok(None)
                    }
                };
                let (post_attn_norm, post_ffn_norm) =
                    (sandwich(w, Role::PostAttnNorm)?, sandwich(w, Role::PostFfnNorm)?);
                let ffn_norm = norm(w, &tw(Role::FfnNorm), hidden)?;
                Ok(Block {
                    attn_norm: norm(w, &tw(Role::AttnNorm), hidden)?,
                    qkv,
                    q_norm: f32_norm(w, &tw(Role::QNorm))?,
                    k_norm: f32_norm(w, &tw(Role::KNorm))?,
                    wo: linear(w, &t(Role::AttnOutput), hidden, q_width)?,
                    post_attn_norm,
                    ffn_norm,
                    gate_up,
                    w_down: linear(w, &t(Role::Down), hidden, ffn)?,
                    post_ffn_norm,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (dtype, device, num_bytes) = (w.dtype, w.device.clone(), w.num_bytes);
        Self::assemble(config, dtype, embed, blocks, final_norm, lm_head, &device, num_bytes)
    }

    /// Seeded random weights for a Llama with transformers' layout: linear weights with standard
    /// deviation 1/sqrt(fan_in), so activations stay O(1) at any depth; norms of ones; embedding
    /// rows of unit RMS. Dense weights are bf16/f16/f32; quantized ones go through candle's
    /// quantized matmul exactly as a GGUF file's do (embedding dense in f32). The same seed gives
    /// the same model on every device.
    pub fn random(config: &LlamaConfig, seed: u64, format: WeightFormat, device: &Device) -> Result<Self> {
        let dtype = match format {
            WeightFormat::Dense(dtype @ (DType::BF16 | DType::F16 | DType::F32)) => dtype,
            WeightFormat::Dense(other) => {
                return Err(Error::config(format!("dense random weights come in bf16, f16 or f32, not {other:?}")))
            }
            WeightFormat::Quantized(_) => DType::F32,
        };
        let mut stream = 0u64;
        let mut num_bytes = 0usize;
        let mut draw = |rows: usize, cols: usize, on: &Device| -> Result<Tensor> {
            stream += 1;
            random::uniform((rows, cols), 1.0 / (cols as f32).sqrt(), seed, stream, dtype, on)
        };
        let mut linear = |rows: usize, cols: usize| -> Result<Linear> {
            let weight = match format {
                WeightFormat::Dense(_) => {
                    num_bytes += rows * cols * dtype.size_in_bytes();
                    Weight::Dense(draw(rows, cols, device)?)
                }
                WeightFormat::Quantized(q) => {
                    if !cols.is_multiple_of(q.block_size()) {
                        return Err(Error::config(format!(
                            "{q:?} packs rows in blocks of {} values, and this config has a {cols}-wide matrix; \
                             pick sizes divisible by {0} or another dtype",
                            q.block_size()
                        )));
                    }
                    let w = QTensor::quantize_onto(&draw(rows, cols, &Device::Cpu)?, q, device)?;
                    num_bytes += w.storage_size_in_bytes();
                    quantized_weight(Arc::new(w))?
                }
            };
            Ok(Linear::new(weight))
        };
        let (hidden, ffn, vocab) = (config.hidden_size, config.intermediate_size, config.vocab_size);
        let kv_width = config.num_kv_heads() * config.head_dim();
        let blocks = (0..config.num_hidden_layers)
            .map(|_| {
                Ok(Block {
                    attn_norm: Tensor::ones(hidden, dtype, device)?,
                    qkv: Projections::new(vec![
                        linear(hidden, hidden)?,
                        linear(kv_width, hidden)?,
                        linear(kv_width, hidden)?,
                    ])?,
                    q_norm: None,
                    k_norm: None,
                    wo: linear(hidden, hidden)?,
                    post_attn_norm: None,
                    ffn_norm: Tensor::ones(hidden, dtype, device)?,
                    gate_up: Projections::new(vec![linear(ffn, hidden)?, linear(ffn, hidden)?])?,
                    w_down: linear(hidden, ffn)?,
                    post_ffn_norm: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = linear(vocab, hidden)?;
        let embed = (draw(vocab, hidden, device)? * (hidden as f64).sqrt())?;
        num_bytes += vocab * hidden * dtype.size_in_bytes();
        let final_norm = Tensor::ones(hidden, dtype, device)?;
        let config = DecoderConfig::from_llama(config);
        Self::assemble(config, dtype, embed, blocks, final_norm, lm_head, device, num_bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: DecoderConfig,
        dtype: DType,
        embed: Tensor,
        blocks: Vec<Block>,
        final_norm: Tensor,
        lm_head: Linear,
        device: &Device,
        weight_bytes: usize,
    ) -> Result<Self> {
        let tables = |theta: f32, factor: f32| -> Result<RopeTables> {
            let half = config.rope_dims / 2;
            let factors = match (&config.rope_freq_factors, factor) {
                (Some(f), _) => Some(f.iter().map(|x| x * factor).collect::<Vec<_>>()),
                (None, f) if f != 1.0 => Some(vec![f; half]),
                (None, _) => None,
            };
            let (cos, sin) = Rope::new(config.rope_dims, theta, 1.0, factors.as_deref(), Pairing::Halves)
                .tables(0, config.context_length);
            let table = |t: Vec<f32>| Tensor::from_vec(t, (config.context_length, half), device);
            Ok(RopeTables { cos: table(cos)?, sin: table(sin)? })
        };
        let global_rope = tables(config.rope_theta, config.rope_linear_factor)?;
        let local_rope = if config.sliding_layers.iter().any(|&s| s)
            && (config.rope_theta_local != config.rope_theta || config.rope_linear_factor != 1.0)
        {
            Some(tables(config.rope_theta_local, 1.0)?)
        } else {
            None
        };
        // On the CPU its quantized matmuls run on the kernel set (`kernels/qlinear.rs`).
        let kernels = if device.is_cpu() { crate::model::kernels::checked_kernels()?.name } else { "cuda" };
        Ok(Self {
            info: ModelInfo::of(&config, kernels),
            dtype,
            embed: embed.to_dtype(dtype)?,
            blocks,
            final_norm: final_norm.to_dtype(dtype)?,
            lm_head,
            global_rope,
            local_rope,
            device: device.clone(),
            weight_bytes,
            config,
        })
    }

    /// `[n, heads * head_dim]` -> `[heads, n, head_dim]` f32, normed per head when the family
    /// says so, then rotated for `positions` (`[n]` u32).
    fn heads(
        &self,
        x: &Tensor,
        num_heads: usize,
        norm: Option<&Tensor>,
        layer: usize,
        positions: &Tensor,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let head_dim = self.config.head_dim;
        let heads = x.to_dtype(DType::F32)?.reshape((n, num_heads, head_dim))?.transpose(0, 1)?.contiguous()?;
        let heads = match norm {
            Some(weight) => rms_norm(&heads, weight, self.config.rms_eps)?,
            None => heads,
        };
        let tables = match (&self.local_rope, self.config.sliding_layers[layer]) {
            (Some(local), true) => local,
            _ => &self.global_rope,
        };
        let cos = tables.cos.index_select(positions, 0)?; // [n, rope_dims / 2]
        let sin = tables.sin.index_select(positions, 0)?;
        let rotate = |x: &Tensor| -> Result<Tensor> {
            let x = x.contiguous()?.unsqueeze(0)?; // [1, heads, n, rope_dims]
            let rotated = if self.config.rope_interleaved { rope_i(&x, &cos, &sin)? } else { rope(&x, &cos, &sin)? };
            Ok(rotated.squeeze(0)?)
        };
        let dims = self.config.rope_dims;
        if dims == head_dim {
            return rotate(&heads);
        }
        let rotated = rotate(&heads.narrow(2, 0, dims)?)?;
        Ok(Tensor::cat(&[rotated, heads.narrow(2, dims, head_dim - dims)?], 2)?)
    }

    fn forward_layers(&self, batch: &ForwardBatch, caches: &mut [&mut KvCache]) -> Result<ForwardOutput> {
        let c = &self.config;
        let pasts: Vec<usize> = caches.iter().map(|cache| cache.len()).collect();
        batch.check(self.blocks.len(), c.vocab_size, &pasts)?;
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.reserve(batch.seq_range(s).len())?;
        }
        let n = batch.num_rows();
        let eps = c.rms_eps;
        let num_blocks = batch.exit_layer.unwrap_or(self.blocks.len());
        let positions: Vec<u32> = batch.positions.iter().map(|&p| p as u32).collect();
        let positions = Tensor::new(positions.as_slice(), &self.device)?;
        // Tree sequences: each row's ancestors (root first, itself last) within the sequence.
        let paths: Vec<Option<Vec<Vec<usize>>>> = (0..batch.num_seqs())
            .map(|s| (!batch.is_chain(s)).then(|| batch.seq_range(s).map(|row| batch.path(s, row)).collect()))
            .collect();

        let ids = Tensor::new(batch.tokens.as_slice(), &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?; // [n, hidden]
        if let Some(scale) = c.embed_scale {
            x = (x * scale as f64)?;
        }
        let mut taps: Vec<Option<Tensor>> = vec![None; batch.taps.len()];
        let capture = |taps: &mut Vec<Option<Tensor>>, after: usize, x: &Tensor| -> Result<()> {
            for (slot, tap) in taps.iter_mut().zip(&batch.taps) {
                if *tap == Tap::Residual(after) {
                    *slot = Some(x.to_dtype(DType::F32)?);
                }
            }
            Ok(())
        };
        capture(&mut taps, 0, &x)?;
        for (layer, block) in self.blocks[..num_blocks].iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, eps)?;
            let [q, k, v]: [Tensor; 3] = block.qkv.forward(&h)?.try_into().map_err(|_| shape_bug("qkv"))?;
            let q = self.heads(&q, c.num_heads, block.q_norm.as_ref(), layer, &positions)?; // [heads, n, hd]
            let k = self.heads(&k, c.num_kv_heads, block.k_norm.as_ref(), layer, &positions)?; // [kv_heads, n, hd]
            let v = v.to_dtype(DType::F32)?.reshape((n, c.num_kv_heads, c.head_dim))?.transpose(0, 1)?; // [kv_heads, n, hd]
            let window = c.sliding_window.filter(|_| c.sliding_layers[layer]);
            let mut attns = Vec::with_capacity(batch.num_seqs());
            for (s, cache) in caches.iter_mut().enumerate() {
                let rows = batch.seq_range(s);
                let (start, len, past) = (rows.start, rows.len(), pasts[s]);
                cache.append_tensors(layer, &k.narrow(1, start, len)?, &v.narrow(1, start, len)?)?;
                let (k_all, v_all) = cache.layer_tensors(layer, past + len)?; // [kv_heads, past + len, hd]
                                                                              // Attention runs in f32 over what the cache holds in the model's dtype.
                let (k_all, v_all) = (k_all.to_dtype(DType::F32)?, v_all.to_dtype(DType::F32)?);
                let q_seq = q.narrow(1, start, len)?;
                let scores = Scores { scale: c.attention_scale, logit_softcap: c.attn_logit_softcap, window };
                attns.push(match &paths[s] {
                    None => attention(&q_seq, &k_all, &v_all, past, scores)?,
                    Some(paths) => tree_attention(&q_seq, &k_all, &v_all, past, paths, scores)?,
                });
            }
            let attn = Tensor::cat(&attns, 0)?; // [n, heads * hd]
            let mut out = block.wo.forward(&attn.to_dtype(self.dtype)?)?; // [n, hidden]
            if let Some(norm) = &block.post_attn_norm {
                out = rms_norm(&out, norm, eps)?;
            }
            x = (x + out)?;

            let h = rms_norm(&x, &block.ffn_norm, eps)?;
            let [gate, up]: [Tensor; 2] = block.gate_up.forward(&h)?.try_into().map_err(|_| shape_bug("gate_up"))?;
            let gate = if c.gelu { gate.gelu()? } else { gate.silu()? };
            let mut mlp = block.w_down.forward(&(gate * up)?)?; // [n, ffn] -> [n, hidden]
            if let Some(norm) = &block.post_ffn_norm {
                mlp = rms_norm(&mlp, norm, eps)?;
            }
            x = (x + mlp)?;
            capture(&mut taps, layer + 1, &x)?;
        }
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.commit(batch.seq_range(s).len());
        }

        let final_normed =
            if batch.taps.contains(&Tap::FinalNorm) { Some(rms_norm(&x, &self.final_norm, eps)?) } else { None };
        let logits = if batch.logit_rows.is_empty() {
            Tensor::zeros((0, c.vocab_size), DType::F32, &self.device)?
        } else {
            let rows: Vec<u32> = batch.logit_rows.iter().map(|&r| r as u32).collect();
            let rows = Tensor::new(rows.as_slice(), &self.device)?;
            let normed = match &final_normed {
                Some(normed) => normed.index_select(&rows, 0)?,
                None => rms_norm(&x.index_select(&rows, 0)?, &self.final_norm, eps)?,
            };
            self.logits(&normed)?
        };
        let hidden = taps
            .into_iter()
            .zip(&batch.taps)
            .map(|(captured, tap)| match tap {
                Tap::FinalNorm => Ok(final_normed.as_ref().expect("computed above").to_dtype(DType::F32)?),
                Tap::Residual(_) => captured.ok_or_else(|| Error::Internal(format!("tap {tap:?} was not captured"))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ForwardOutput { logits, hidden })
    }

    /// The LM head and the final soft-cap: `[rows, hidden]` final-normed -> `[rows, vocab]` f32.
    fn logits(&self, normed: &Tensor) -> Result<Tensor> {
        let logits = self.lm_head.forward(&normed.to_dtype(self.dtype)?)?.to_dtype(DType::F32)?;
        match self.config.final_logit_softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }
}

fn shape_bug(what: &str) -> Error {
    Error::Internal(format!("{what}: wrong number of projections"))
}

/// cap * tanh(x / cap).
fn softcap(x: &Tensor, cap: f32) -> Result<Tensor> {
    Ok(((x / cap as f64)?.tanh()? * cap as f64)?)
}

/// How attention scores are formed: `scale * q·k`, soft-capped, within a window of keys.
#[derive(Debug, Clone, Copy)]
struct Scores {
    scale: f32,
    logit_softcap: Option<f32>,
    /// Keys a query sees, itself included.
    window: Option<usize>,
}

/// Tree attention: row i of `q` (`[num_heads, n, head_dim]`) sees the `past` cached keys and the
/// new rows `paths[i]` (its ancestors, itself last) of `k`, `v` (`[num_kv_heads, past + n,
/// head_dim]`). Each row gathers exactly the keys it sees, in position order, and runs as the
/// last row of a chain over them, so a node computes what its root-to-node path run as a chain
/// computes for it (with the same kernels on the CPU).
fn tree_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    paths: &[Vec<usize>],
    scores: Scores,
) -> Result<Tensor> {
    // The cache views are strided (a prefix of each layer's buffer); gathers need them whole.
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let rows = paths
        .iter()
        .enumerate()
        .map(|(i, path)| {
            let cells: Vec<u32> = (0..past).chain(path.iter().map(|a| past + a)).map(|c| c as u32).collect();
            let cells = Tensor::new(cells.as_slice(), q.device())?;
            let (k, v) = (k.index_select(&cells, 1)?, v.index_select(&cells, 1)?);
            attention(&q.narrow(1, i, 1)?, &k, &v, past + path.len() - 1, scores)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&rows, 0)?)
}

/// Plain causal attention (no window, no soft-cap) for the heads' own layers
/// (`proposer/heads/layer.rs`); the shapes are `attention`'s.
pub(crate) fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scale: f32) -> Result<Tensor> {
    attention(q, k, v, past, Scores { scale, logit_softcap: None, window: None })
}

/// Causal grouped-query attention in f32. `q`: `[num_heads, n, head_dim]` for positions
/// `past..past + n`; `k`, `v`: `[num_kv_heads, past + n, head_dim]`. Returns `[n, num_heads *
/// head_dim]`. Query heads sharing a kv head are folded into its rows, so keys and values are
/// read once per kv head and never repeated. With a `window`, the query at position p sees keys
/// p - window + 1..=p; keys no query of this step sees are not read at all.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scores_of: Scores) -> Result<Tensor> {
    let Scores { scale, logit_softcap, window } = scores_of;
    let (num_heads, n, head_dim) = q.dims3()?;
    if n > 1 && q.device().is_cpu() {
        // One query row at a time over exactly the keys it sees: the same matmul shapes as a
        // single-token step, so on the CPU a verify pass rounds like the steps it replaces.
        let rows = (0..n)
            .map(|i| {
                let visible = past + i + 1;
                let row = q.narrow(1, i, 1)?;
                attention(&row, &k.narrow(1, 0, visible)?, &v.narrow(1, 0, visible)?, past + i, scores_of)
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok(Tensor::cat(&rows, 0)?);
    }
    let num_kv_heads = k.dim(0)?;
    let first_key = window.map_or(0, |w| (past + 1).saturating_sub(w));
    let (k, v) = (k.narrow(1, first_key, past + n - first_key)?, v.narrow(1, first_key, past + n - first_key)?);
    let total = k.dim(1)?;
    let groups = num_heads / num_kv_heads;
    let q = q.reshape((num_kv_heads, groups * n, head_dim))?;
    let mut scores = (q.matmul(&k.t()?)? * scale as f64)?; // [kv_heads, groups * n, total]
    if let Some(cap) = logit_softcap {
        scores = softcap(&scores, cap)?;
    }
    if n > 1 {
        // Row i (position past + i) sees key j (position first_key + j) when it is not in the
        // future and, with a window, not too far in the past.
        let mask: Vec<f32> = (0..n)
            .flat_map(|i| {
                (0..total).map(move |j| {
                    let (query, key) = (past + i, first_key + j);
                    let visible = key <= query && window.is_none_or(|w| query - key < w);
                    if visible {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, total), q.device())?;
        scores = scores.reshape((num_kv_heads, groups, n, total))?.broadcast_add(&mask)?.reshape((
            num_kv_heads,
            groups * n,
            total,
        ))?;
    }
    let out = softmax_last_dim(&scores)?.matmul(&v)?; // [kv_heads, groups * n, head_dim]
    Ok(out.reshape((num_heads, n, head_dim))?.transpose(0, 1)?.reshape((n, num_heads * head_dim))?)
}

impl CausalLm for Decoder {
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
        KvCache::on_device(
            i.num_layers,
            i.num_kv_heads,
            i.head_dim,
            capacity,
            i.context_length,
            self.dtype,
            &self.device,
        )
    }

    fn forward_batch(&self, batch: &ForwardBatch, caches: &mut [&mut KvCache]) -> Result<ForwardOutput> {
        self.forward_layers(batch, caches)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        check_token_ids(tokens, self.config.vocab_size)?;
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed.index_select(&ids, 0)?.to_dtype(DType::F32)?) // [n, hidden]
    }

    fn lm_head(&self, hidden: &Tensor, vocab_subset: Option<&[u32]>) -> Result<Tensor> {
        select_vocab(self.logits(hidden)?, vocab_subset, self.config.vocab_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LogitRows;

    fn tiny() -> LlamaConfig {
        LlamaConfig::from_json(
            r#"{"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 64}"#,
        )
        .unwrap()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    /// A prefill, single steps, and a multi-token step over a truncated cache give the logits of
    /// one teacher-forced forward over the whole sequence.
    fn check_cached_steps_match_one_forward(model: &Decoder) {
        let tokens: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % 97).collect();
        let mut cache = model.new_cache(4).unwrap();
        let whole = model.forward(&tokens, &mut cache).unwrap(); // [12, vocab]

        let mut cache = model.new_cache(4).unwrap();
        let prefill = model.forward(&tokens[..5], &mut cache).unwrap();
        let step = model.forward(&tokens[5..6], &mut cache).unwrap();
        // A rejected draft: three wrong tokens scored, then rolled back.
        model.forward(&[1, 2, 3], &mut cache).unwrap();
        cache.truncate(6);
        let verify = model.forward(&tokens[6..], &mut cache).unwrap();
        let pieces = Tensor::cat(&[prefill, step, verify], 0).unwrap();
        let diff = max_abs_diff(&whole, &pieces);
        assert!(diff < 1e-4, "max |logit difference| {diff}");
        let last = model.forward_rows(&tokens[..3], &mut model.new_cache(3).unwrap(), LogitRows::Last).unwrap();
        assert!(max_abs_diff(&last, &whole.narrow(0, 2, 1).unwrap()) < 1e-4);
    }

    #[test]
    fn cached_steps_match_one_forward() {
        check_cached_steps_match_one_forward(
            &Decoder::random(&tiny(), 3, WeightFormat::Dense(DType::F32), &Device::Cpu).unwrap(),
        );
    }

    /// The family flags keep the cache invariant: a Gemma-3-like model (sliding window of 4 on
    /// two of three layers with their own RoPE base, soft-capping, GELU, embedding scale, partial
    /// rotary) still scores split forwards like one.
    #[test]
    fn family_flags_keep_cached_steps_equal() {
        let mut model = Decoder::random(&tiny(), 5, WeightFormat::Dense(DType::F32), &Device::Cpu).unwrap();
        let c = &mut model.config;
        c.sliding_window = Some(4);
        c.sliding_layers = vec![true, false, true];
        c.rope_theta_local = 100.0;
        c.attn_logit_softcap = Some(5.0);
        c.final_logit_softcap = Some(3.0);
        c.gelu = true;
        c.embed_scale = Some(2.0);
        c.rope_dims = 4;
        let rebuilt = Decoder::assemble(
            model.config.clone(),
            model.dtype,
            model.embed.clone(),
            std::mem::take(&mut model.blocks),
            model.final_norm.clone(),
            Linear::new(Weight::Dense(model.embed.clone())),
            &Device::Cpu,
            0,
        )
        .unwrap();
        check_cached_steps_match_one_forward(&rebuilt);
        // The cap holds, and the window changes what far-apart tokens see.
        let tokens: Vec<u32> = (0..12).collect();
        let logits = rebuilt.forward(&tokens, &mut rebuilt.new_cache(12).unwrap()).unwrap();
        assert!(logits.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap() <= 3.0);
    }

    /// bf16 and q8_0 weights are the f32 model's rounded: the logits agree to their precision.
    #[test]
    fn rounded_weights_track_f32() {
        let tokens: Vec<u32> = (0..8u32).collect();
        let logits = |format| {
            let model = Decoder::random(&tiny(), 11, format, &Device::Cpu).unwrap();
            model.forward(&tokens, &mut model.new_cache(8).unwrap()).unwrap()
        };
        let f32_logits = logits(WeightFormat::Dense(DType::F32));
        let scale = f32_logits.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        for format in [WeightFormat::Dense(DType::BF16), WeightFormat::Quantized(GgmlDType::Q8_0)] {
            let diff = max_abs_diff(&f32_logits, &logits(format));
            assert!(diff < 0.1 * scale, "{format:?}: max |difference| {diff} at logit scale {scale}");
        }
    }

    /// A window of w: the query at position p attends to exactly keys p - w + 1..=p, in a
    /// multi-row step and in a single-row one.
    #[test]
    fn sliding_window_sees_exactly_the_last_keys() {
        let device = Device::Cpu;
        // One head of dim 1; value j at key j, so the output is the mean of the visible keys'
        // indices when all scores are equal (q = 0).
        let (past, n, w) = (5, 3, 3);
        let q = Tensor::zeros((1, n, 1), DType::F32, &device).unwrap();
        let k = Tensor::zeros((1, past + n, 1), DType::F32, &device).unwrap();
        let v = Tensor::arange(0f32, (past + n) as f32, &device).unwrap().reshape((1, past + n, 1)).unwrap();
        let out = attention(&q, &k, &v, past, Scores { scale: 1.0, logit_softcap: None, window: Some(w) })
            .unwrap()
            .flatten_all()
            .unwrap();
        // Positions 5, 6, 7 see {3,4,5}, {4,5,6}, {5,6,7}.
        assert_eq!(out.to_vec1::<f32>().unwrap(), [4.0, 5.0, 6.0]);
        let single = attention(
            &q.narrow(1, 0, 1).unwrap(),
            &k,
            &v,
            past + n - 1,
            Scores { scale: 1.0, logit_softcap: None, window: Some(w) },
        )
        .unwrap();
        assert_eq!(single.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [6.0]);
    }
}
