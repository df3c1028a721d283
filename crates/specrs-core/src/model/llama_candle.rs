//! Llama-architecture decoder written with candle tensor ops, so it runs on any candle device: the
//! model behind `device="cuda"`. Weights are GGUF tensors (candle's quantized matmul, activations
//! in f32) or dense bf16/f16/f32 tensors (seeded random weights today; safetensors next).
//!
//! Same math as `llama.rs`: pre-norm blocks, RMSNorm -> grouped-query attention with rotary
//! embeddings -> residual -> RMSNorm -> SwiGLU MLP -> residual. GGUF stores q/k permuted for
//! interleaved RoPE (`rope_i`); dense weights use transformers' layout (half-split `rope`).
//!
//! Invariant: `forward_rows` scores every new token against the cached keys plus its own
//! predecessors (causal mask), and appends exactly the new positions to the cache. Unlike
//! `llama.rs` it does not promise bitwise row independence: cuBLAS picks its kernels by shape, so
//! a k+1-token verify can round differently from single steps, and greedy speculative output
//! equals plain greedy output except at near-ties (the GPU check counts them). Attention runs in
//! f32 over an f32 cache, which keeps those differences at the matmuls' rounding.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::ops::{rms_norm, softmax_last_dim};
use candle_nn::rotary_emb::{rope, rope_i};

use super::attention::rope_tables;
use super::llama_config::LlamaConfig;
use super::random;
use super::{check_exit_layer, CausalLm, LogitRows, ModelInfo};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;

/// How `CandleLlama::random` stores its weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WeightFormat {
    Dense(DType),
    Quantized(GgmlDType),
}

enum Linear {
    Quantized(QMatMul),
    /// `[out_features, in_features]`, in the activation dtype.
    Dense(Tensor),
}

impl Linear {
    /// `[n, in_features]` -> `[n, out_features]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Linear::Quantized(w) => w.forward(x)?,
            Linear::Dense(w) => x.matmul(&w.t()?)?,
        })
    }
}

/// Projections of one input: q/k/v, or gate/up. Dense weights are stacked into one matmul: on a
/// GPU a decode step is dozens of small launches per layer, and each one saved is time saved.
enum Projections {
    Separate(Vec<Linear>),
    /// `[sum(widths), in_features]`, in the activation dtype.
    Stacked {
        weight: Tensor,
        widths: Vec<usize>,
    },
}

impl Projections {
    /// `[n, in_features]` -> one `[n, width]` tensor per projection.
    fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(linears) => linears.iter().map(|l| l.forward(x)).collect(),
            Projections::Stacked { weight, widths } => {
                let y = x.matmul(&weight.t()?)?;
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

    /// Stacks dense weights; quantized ones stay separate.
    fn new(linears: Vec<Linear>) -> Result<Self> {
        let dense: Option<Vec<&Tensor>> = linears
            .iter()
            .map(|l| match l {
                Linear::Dense(w) => Some(w),
                Linear::Quantized(_) => None,
            })
            .collect();
        Ok(match dense {
            Some(weights) => Projections::Stacked {
                widths: weights.iter().map(|w| w.dim(0)).collect::<candle_core::Result<_>>()?,
                weight: Tensor::cat(&weights, 0)?,
            },
            None => Projections::Separate(linears),
        })
    }
}

struct Block {
    attn_norm: Tensor,
    /// q, k, v.
    qkv: Projections,
    wo: Linear,
    ffn_norm: Tensor,
    /// gate, up.
    gate_up: Projections,
    w_down: Linear,
}

pub struct CandleLlama {
    info: ModelInfo,
    config: LlamaConfig,
    /// Dtype of the hidden state between blocks: f32 for quantized weights, else the weights'.
    dtype: DType,
    /// `[vocab_size, hidden_size]` in `dtype`.
    embed: Tensor,
    blocks: Vec<Block>,
    final_norm: Tensor,
    lm_head: Linear,
    /// `[context_length, head_dim / 2]` f32 rotary tables.
    cos: Tensor,
    sin: Tensor,
    interleaved_rope: bool,
    device: Device,
    weight_bytes: usize,
}

/// Reads GGUF tensors by name onto the device and counts their bytes.
struct GgufWeights<'a> {
    gguf: &'a mut GgufFile,
    device: &'a Device,
    num_bytes: usize,
}

impl GgufWeights<'_> {
    fn qtensor(&mut self, name: &str) -> Result<Arc<QTensor>> {
        let t = self.gguf.tensor(name, self.device)?;
        self.num_bytes += t.storage_size_in_bytes();
        Ok(Arc::new(t))
    }

    fn linear(&mut self, name: &str) -> Result<Linear> {
        Ok(Linear::Quantized(QMatMul::from_arc(self.qtensor(name)?)?))
    }

    fn vector(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(self.device)?)
    }
}

impl CandleLlama {
    /// A llama-family GGUF file on `device`.
    pub fn from_gguf(gguf: &mut GgufFile, arch: &str, device: &Device) -> Result<Self> {
        let config = LlamaConfig::from_gguf(gguf, arch)?;
        let freq_factors = LlamaConfig::rope_freq_factors(gguf)?;
        let mut w = GgufWeights { gguf, device, num_bytes: 0 };
        let embed_q = w.qtensor("token_embd.weight")?;
        // The lookup table is dequantized once (as candle's own quantized llama does): a gather
        // from quantized blocks has no CUDA kernel.
        let embed = embed_q.dequantize(device)?;
        let lm_head = if config.tie_word_embeddings {
            Linear::Quantized(QMatMul::from_arc(embed_q)?)
        } else {
            w.linear("output.weight")?
        };
        let final_norm = w.vector("output_norm.weight")?;
        let blocks = (0..config.num_hidden_layers)
            .map(|i| {
                let name = |part: &str| format!("blk.{i}.{part}.weight");
                Ok(Block {
                    attn_norm: w.vector(&name("attn_norm"))?,
                    qkv: Projections::new(vec![
                        w.linear(&name("attn_q"))?,
                        w.linear(&name("attn_k"))?,
                        w.linear(&name("attn_v"))?,
                    ])?,
                    wo: w.linear(&name("attn_output"))?,
                    ffn_norm: w.vector(&name("ffn_norm"))?,
                    gate_up: Projections::new(vec![w.linear(&name("ffn_gate"))?, w.linear(&name("ffn_up"))?])?,
                    w_down: w.linear(&name("ffn_down"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weight_bytes = w.num_bytes;
        Self::assemble(
            arch,
            config,
            DType::F32,
            embed,
            blocks,
            final_norm,
            lm_head,
            freq_factors,
            true,
            device,
            weight_bytes,
        )
    }

    /// Seeded random weights with transformers' layout: linear weights with standard deviation
    /// 1/sqrt(fan_in), so activations stay O(1) at any depth; norms of ones; embedding rows of
    /// unit RMS. Dense weights are bf16/f16/f32; quantized ones go through candle's quantized
    /// matmul exactly as a GGUF file's do (embedding dense in f32). The same seed gives the same
    /// model on every device.
    pub fn random(config: LlamaConfig, seed: u64, format: WeightFormat, device: &Device) -> Result<Self> {
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
            Ok(match format {
                WeightFormat::Dense(_) => {
                    num_bytes += rows * cols * dtype.size_in_bytes();
                    Linear::Dense(draw(rows, cols, device)?)
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
                    Linear::Quantized(QMatMul::from_qtensor(w)?)
                }
            })
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
                    wo: linear(hidden, hidden)?,
                    ffn_norm: Tensor::ones(hidden, dtype, device)?,
                    gate_up: Projections::new(vec![linear(ffn, hidden)?, linear(ffn, hidden)?])?,
                    w_down: linear(hidden, ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = linear(vocab, hidden)?;
        let embed = (draw(vocab, hidden, device)? * (hidden as f64).sqrt())?;
        num_bytes += vocab * hidden * dtype.size_in_bytes();
        let final_norm = Tensor::ones(hidden, dtype, device)?;
        Self::assemble("llama", config, dtype, embed, blocks, final_norm, lm_head, None, false, device, num_bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        arch: &str,
        config: LlamaConfig,
        dtype: DType,
        embed: Tensor,
        blocks: Vec<Block>,
        final_norm: Tensor,
        lm_head: Linear,
        freq_factors: Option<Vec<f32>>,
        interleaved_rope: bool,
        device: &Device,
        weight_bytes: usize,
    ) -> Result<Self> {
        let head_dim = config.head_dim();
        let context = config.max_position_embeddings;
        let (cos, sin) = rope_tables(head_dim, config.rope_theta, context, freq_factors.as_deref());
        let table = |t: Vec<f32>| Tensor::from_vec(t, (context, head_dim / 2), device);
        Ok(Self {
            info: ModelInfo {
                architecture: arch.to_string(),
                vocab_size: config.vocab_size,
                context_length: context,
                num_layers: config.num_hidden_layers,
                num_kv_heads: config.num_kv_heads(),
                head_dim,
            },
            cos: table(cos)?,
            sin: table(sin)?,
            config,
            dtype,
            embed: embed.to_dtype(dtype)?,
            blocks,
            final_norm: final_norm.to_dtype(dtype)?,
            lm_head,
            interleaved_rope,
            device: device.clone(),
            weight_bytes,
        })
    }

    /// `[n, heads * head_dim]` -> `[heads, n, head_dim]` f32, rotated for positions `past..past + n`.
    fn rotated_heads(&self, x: &Tensor, num_heads: usize, past: usize) -> Result<Tensor> {
        let n = x.dim(0)?;
        let heads = x.to_dtype(DType::F32)?.reshape((n, num_heads, self.info.head_dim))?.transpose(0, 1)?;
        let heads = heads.contiguous()?.unsqueeze(0)?; // [1, heads, n, head_dim]
        let cos = self.cos.narrow(0, past, n)?;
        let sin = self.sin.narrow(0, past, n)?;
        let rotated = if self.interleaved_rope { rope_i(&heads, &cos, &sin)? } else { rope(&heads, &cos, &sin)? };
        Ok(rotated.squeeze(0)?)
    }

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
        let (num_heads, num_kv_heads) = (self.config.num_attention_heads, self.info.num_kv_heads);
        let eps = self.config.rms_norm_eps;

        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.index_select(&ids, 0)?; // [n, hidden]
        for (layer, block) in self.blocks[..num_layers].iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, eps)?;
            let [q, k, v]: [Tensor; 3] = block.qkv.forward(&h)?.try_into().map_err(|_| shape_bug("qkv"))?;
            let q = self.rotated_heads(&q, num_heads, past)?; // [heads, n, hd]
            let k = self.rotated_heads(&k, num_kv_heads, past)?; // [kv_heads, n, hd]
            let v = v.to_dtype(DType::F32)?.reshape((n, num_kv_heads, self.info.head_dim))?;
            cache.append_tensors(layer, &k, &v.transpose(0, 1)?)?;
            let (k_all, v_all) = cache.layer_tensors(layer, past + n)?; // [kv_heads, past + n, hd]
            let attn = attention(&q, &k_all, &v_all, past)?.to_dtype(self.dtype)?; // [n, heads * hd]
            x = (x + block.wo.forward(&attn)?)?;

            let h = rms_norm(&x, &block.ffn_norm, eps)?;
            let [gate, up]: [Tensor; 2] = block.gate_up.forward(&h)?.try_into().map_err(|_| shape_bug("gate_up"))?;
            let mlp = block.w_down.forward(&(gate.silu()? * up)?)?; // [n, ffn] -> [n, hidden]
            x = (x + mlp)?;
        }
        cache.commit(n);

        let x = match rows {
            LogitRows::All => x,
            LogitRows::Last => x.narrow(0, n - 1, 1)?,
        };
        let normed = rms_norm(&x, &self.final_norm, eps)?;
        Ok(self.lm_head.forward(&normed)?.to_dtype(DType::F32)?) // [rows, vocab]
    }
}

fn shape_bug(what: &str) -> Error {
    Error::Internal(format!("{what}: wrong number of projections"))
}

/// Causal grouped-query attention in f32. `q`: `[num_heads, n, head_dim]` for positions
/// `past..past + n`; `k`, `v`: `[num_kv_heads, past + n, head_dim]`. Returns `[n, num_heads *
/// head_dim]`. Query heads sharing a kv head are folded into its rows, so keys and values are
/// read once per kv head and never repeated.
fn attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize) -> Result<Tensor> {
    let (num_heads, n, head_dim) = q.dims3()?;
    let (num_kv_heads, total, _) = k.dims3()?;
    let groups = num_heads / num_kv_heads;
    let q = q.reshape((num_kv_heads, groups * n, head_dim))?;
    let scores = (q.matmul(&k.t()?)? / (head_dim as f64).sqrt())?; // [kv_heads, groups * n, total]
    let scores = if n > 1 {
        // Row i sees keys 0..=past + i.
        let mask: Vec<f32> =
            (0..n).flat_map(|i| (0..total).map(move |j| if j <= past + i { 0.0 } else { f32::NEG_INFINITY })).collect();
        let mask = Tensor::from_vec(mask, (n, total), q.device())?;
        scores.reshape((num_kv_heads, groups, n, total))?.broadcast_add(&mask)?.reshape((
            num_kv_heads,
            groups * n,
            total,
        ))?
    } else {
        scores
    };
    let out = softmax_last_dim(&scores)?.matmul(v)?; // [kv_heads, groups * n, head_dim]
    Ok(out.reshape((num_heads, n, head_dim))?.transpose(0, 1)?.reshape((n, num_heads * head_dim))?)
}

impl CausalLm for CandleLlama {
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
        KvCache::on_device(i.num_layers, i.num_kv_heads, i.head_dim, capacity, i.context_length, &self.device)
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

#[cfg(test)]
mod tests {
    use super::*;

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
    #[test]
    fn cached_steps_match_one_forward() {
        let model = CandleLlama::random(tiny(), 3, WeightFormat::Dense(DType::F32), &Device::Cpu).unwrap();
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

    /// bf16 and q8_0 weights are the f32 model's rounded: the logits agree to their precision.
    #[test]
    fn rounded_weights_track_f32() {
        let tokens: Vec<u32> = (0..8u32).collect();
        let logits = |format| {
            let model = CandleLlama::random(tiny(), 11, format, &Device::Cpu).unwrap();
            model.forward(&tokens, &mut model.new_cache(8).unwrap()).unwrap()
        };
        let f32_logits = logits(WeightFormat::Dense(DType::F32));
        let scale = f32_logits.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        for format in [WeightFormat::Dense(DType::BF16), WeightFormat::Quantized(GgmlDType::Q8_0)] {
            let diff = max_abs_diff(&f32_logits, &logits(format));
            assert!(diff < 0.1 * scale, "{format:?}: max |difference| {diff} at logit scale {scale}");
        }
    }
}
