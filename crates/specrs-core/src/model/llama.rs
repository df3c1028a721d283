//! Llama-architecture decoder (SmolLM2, Llama 2/3, Mistral) on GGUF weights.
//!
//! Pre-norm blocks: RMSNorm -> grouped-query attention with interleaved RoPE (GGUF stores q/k
//! permuted for it) -> residual -> RMSNorm -> SwiGLU MLP -> residual. Matmuls run on the quantized
//! weights through candle's `QMatMul`.
//!
//! Invariant: a token's logits are bitwise the same however the sequence was split into forwards
//! (prefill, single steps, a k+1-token verify pass): every step is row-independent (quantized
//! matmuls quantize each activation row on its own; attention is computed row by row, see
//! `attention.rs`). Greedy speculative decoding is therefore exactly plain greedy decoding.
//!
//! Performance notes: the LM head runs only on the rows that need logits (prefill needs one).
//! Attention reads the cache in place, without expanding the KV heads. Tried and dropped:
//! candle's matmul + softmax attention, with KV heads expanded or with query heads folded into
//! rows; both changed logits by up to ~1 between batched and single-token forwards.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Storage, Tensor};
use candle_nn::ops::{rms_norm, silu};

use super::attention::{apply_rope, causal_attention, HeadShape};
use super::qlinear::QLinear;
use super::{CausalLm, LogitRows, ModelInfo};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;

struct Block {
    attn_norm: Tensor,
    wq: QLinear,
    wk: QLinear,
    wv: QLinear,
    wo: QLinear,
    ffn_norm: Tensor,
    w_gate: QLinear,
    w_up: QLinear,
    w_down: QLinear,
}

pub struct Llama {
    info: ModelInfo,
    num_heads: usize,
    rms_eps: f32,
    embed: Arc<QTensor>,
    blocks: Vec<Block>,
    final_norm: Tensor,
    lm_head: QLinear,
    /// `[context_length, head_dim / 2]` rotary tables.
    cos: Vec<f32>,
    sin: Vec<f32>,
    device: Device,
    weight_bytes: usize,
}

impl Llama {
    pub fn load(gguf: &mut GgufFile, arch: &str, device: &Device) -> Result<Self> {
        let key = |k: &str| format!("{arch}.{k}");
        let num_layers = gguf.get_usize(&key("block_count"))?;
        let hidden = gguf.get_usize(&key("embedding_length"))?;
        let num_heads = gguf.get_usize(&key("attention.head_count"))?;
        let num_kv_heads = gguf.opt_usize(&key("attention.head_count_kv"))?.unwrap_or(num_heads);
        let rms_eps = gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_theta = gguf.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let context_length = gguf.get_usize(&key("context_length"))?;
        let path = gguf.path.display().to_string();
        if num_heads == 0 || hidden % num_heads != 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::model_load(format!(
                "{path}: inconsistent attention shape (embedding {hidden}, {num_heads} heads, \
                 {num_kv_heads} kv heads); the GGUF metadata is corrupt"
            )));
        }
        let head_dim = hidden / num_heads;
        let rope_dim = gguf.opt_usize(&key("rope.dimension_count"))?.unwrap_or(head_dim);
        if rope_dim != head_dim {
            return Err(Error::model_load(format!(
                "{path}: partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported"
            )));
        }

        let mut w = WeightLoader { gguf: &mut *gguf, device, num_bytes: 0 };
        let embed = w.qtensor("token_embd.weight")?;
        let (vocab_size, embed_hidden) = embed.shape().dims2()?;
        if embed_hidden != hidden {
            return Err(Error::model_load(format!(
                "{path}: token_embd has width {embed_hidden} but embedding_length is {hidden}; the file is corrupt"
            )));
        }
        let lm_head = if w.gguf.has_tensor("output.weight") {
            w.matmul("output.weight")?
        } else {
            QLinear::new(embed.clone())? // tied embeddings
        };
        let final_norm = w.vector("output_norm.weight")?;
        let blocks = (0..num_layers)
            .map(|i| {
                let name = |part: &str| format!("blk.{i}.{part}.weight");
                Ok(Block {
                    attn_norm: w.vector(&name("attn_norm"))?,
                    wq: w.matmul(&name("attn_q"))?,
                    wk: w.matmul(&name("attn_k"))?,
                    wv: w.matmul(&name("attn_v"))?,
                    wo: w.matmul(&name("attn_output"))?,
                    ffn_norm: w.vector(&name("ffn_norm"))?,
                    w_gate: w.matmul(&name("ffn_gate"))?,
                    w_up: w.matmul(&name("ffn_up"))?,
                    w_down: w.matmul(&name("ffn_down"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weight_bytes = w.num_bytes;
        for (name, want) in [
            ("blk.0.attn_q.weight", vec![hidden, hidden]),
            ("blk.0.attn_k.weight", vec![num_kv_heads * head_dim, hidden]),
        ] {
            let got = gguf.tensor_dims(name).unwrap_or_default();
            if got != want {
                return Err(Error::model_load(format!(
                    "{path}: tensor '{name}' has shape {got:?}, the metadata implies {want:?}; the file is corrupt"
                )));
            }
        }

        // Llama 3.1-style frequency scaling ships as a tensor of per-dimension divisors.
        let freq_factors = if gguf.has_tensor("rope_freqs.weight") {
            Some(gguf.tensor("rope_freqs.weight", &Device::Cpu)?.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
        } else {
            None
        };
        let (cos, sin) = rope_tables(head_dim, rope_theta, context_length, freq_factors.as_deref());

        Ok(Self {
            info: ModelInfo {
                architecture: arch.to_string(),
                vocab_size,
                context_length,
                num_layers,
                num_kv_heads,
                head_dim,
            },
            num_heads,
            rms_eps,
            embed,
            blocks,
            final_norm,
            lm_head,
            cos,
            sin,
            device: device.clone(),
            weight_bytes,
        })
    }
}

/// Reads tensors by name and counts the bytes loaded.
struct WeightLoader<'a> {
    gguf: &'a mut GgufFile,
    device: &'a Device,
    num_bytes: usize,
}

impl WeightLoader<'_> {
    fn qtensor(&mut self, name: &str) -> Result<Arc<QTensor>> {
        let t = self.gguf.tensor(name, self.device)?;
        self.num_bytes += t.storage_size_in_bytes();
        Ok(Arc::new(t))
    }

    fn matmul(&mut self, name: &str) -> Result<QLinear> {
        QLinear::new(self.qtensor(name)?)
    }

    /// Norm weights are small and used in f32.
    fn vector(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(self.device)?)
    }
}

/// cos/sin tables `[max_len, head_dim / 2]` for interleaved RoPE.
fn rope_tables(head_dim: usize, theta: f32, max_len: usize, freq_factors: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| {
            let f = 1.0 / theta.powf(2.0 * i as f32 / head_dim as f32);
            f / freq_factors.map_or(1.0, |ff| ff[i])
        })
        .collect();
    let angles = (0..max_len).flat_map(|pos| inv_freq.iter().map(move |f| pos as f32 * f));
    (angles.clone().map(f32::cos).collect(), angles.map(f32::sin).collect())
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
        KvCache::new(i.num_layers, i.num_kv_heads, i.head_dim, capacity, i.context_length, DType::F32, &self.device)
    }

    fn forward_rows(&self, tokens: &[u32], cache: &mut KvCache, rows: LogitRows) -> Result<Tensor> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::Internal("forward called with no tokens".into()));
        }
        let past = cache.len();
        cache.reserve(n)?;
        let (num_heads, num_kv_heads, head_dim) = (self.num_heads, self.info.num_kv_heads, self.info.head_dim);

        let ids = Tensor::new(tokens, &self.device)?;
        let mut x = self.embed.embedding(&ids)?.unsqueeze(0)?; // [1, n, hidden]
        let shape = HeadShape { num_heads, num_kv_heads, head_dim };
        let to_rows = |t: Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };

        for (layer, block) in self.blocks.iter().enumerate() {
            let h = rms_norm(&x, &block.attn_norm, self.rms_eps)?;
            let mut q = to_rows(block.wq.forward(&h)?)?; // [n, heads * hd]
            let mut k = to_rows(block.wk.forward(&h)?)?; // [n, kv_heads * hd]
            apply_rope(&mut q, num_heads, head_dim, past, &self.cos, &self.sin);
            apply_rope(&mut k, num_kv_heads, head_dim, past, &self.cos, &self.sin);
            let kv_dim = num_kv_heads * head_dim;
            let k = Tensor::from_vec(k, (n, kv_dim), &self.device)?;
            let v = block.wv.forward(&h)?.reshape((n, kv_dim))?;
            cache.append(layer, &k, &v)?;
            let (k_cache, v_cache) = cache.buffers(layer);
            let attn = {
                let (k_store, k_layout) = k_cache.storage_and_layout();
                let (v_store, v_layout) = v_cache.storage_and_layout();
                match (&*k_store, &*v_store) {
                    (Storage::Cpu(k_cpu), Storage::Cpu(v_cpu)) => {
                        let k_all = &k_cpu.as_slice::<f32>()?[k_layout.start_offset()..];
                        let v_all = &v_cpu.as_slice::<f32>()?[v_layout.start_offset()..];
                        causal_attention(&q, k_all, v_all, past, shape)
                    }
                    _ => return Err(Error::Device("attention is implemented for the CPU only".into())),
                }
            };
            let attn = Tensor::from_vec(attn, (1, n, num_heads * head_dim), &self.device)?;
            x = (x + block.wo.forward(&attn)?)?;

            let h = rms_norm(&x, &block.ffn_norm, self.rms_eps)?;
            let mlp = (silu(&block.w_gate.forward(&h)?)? * block.w_up.forward(&h)?)?;
            x = (x + block.w_down.forward(&mlp)?)?;
        }
        cache.commit(n);

        if rows == LogitRows::Last {
            x = x.narrow(1, n - 1, 1)?;
        }
        let x = rms_norm(&x, &self.final_norm, self.rms_eps)?;
        Ok(self.lm_head.forward(&x)?.squeeze(0)?.to_dtype(DType::F32)?.contiguous()?) // [rows, vocab]
    }
}
