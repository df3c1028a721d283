//! The CPU decoder: GGUF models of every family `families.rs` reads (llama/mistral: SmolLM2,
//! Llama 2/3; qwen2; qwen3; gemma3; phi3), on specrs's own CPU kernels.
//!
//! A block: RMSNorm -> q/k/v projections (one fused matrix: Phi-3; + biases: Qwen2) -> (per-head
//! q/k RMSNorm: Qwen3, Gemma) -> RoPE (interleaved pairs for GGUF llama, whose q/k were permuted
//! for it; halves otherwise; on the first `rope_dims` only: partial rotary; a base of its own on
//! Gemma's sliding-window layers) -> grouped-query attention over the f16 cache (windowed where
//! the layer says so) -> output projection (-> RMSNorm: Gemma) -> residual -> RMSNorm -> SiLU or
//! GELU (Gemma) gated MLP (gate and up fused: Phi-3) (-> RMSNorm: Gemma) -> residual. The block's
//! weights are `model/block.rs`'s, loaded by its one loader through `GgufReader`.
//!
//! Invariant: a token's logits are bitwise the same however the sequence was split into forwards
//! (prefill, single steps, a k+1-token verify pass): every step is row-independent (quantized
//! matmuls quantize each activation row on its own; attention is computed row by row, see
//! `attention.rs`). Greedy speculative decoding is therefore exactly plain greedy decoding.
//!
//! Numerics (README "Numerics"): int8 activation quantization per row and 32-value block with the
//! weights repacked at load (`repack.rs`; the AVX2 fallback `qlinear.rs`/`kquants.rs` keeps
//! llama.cpp's orders), the f16 KV cache (`attention.rs`), RMSNorm with an f64 sum of squares,
//! ggml's RoPE angles (`rope.rs`), its exponential and f16 GELU table (`ggml_math.rs`), and the
//! attention scale where llama.cpp's graphs apply it (the query before q·k for Gemma and Phi-3,
//! the scores for the others). Against llama.cpp and transformers the logits agree at a
//! tolerance (tests/test_golden.py), not bit for bit.
//!
//! Performance notes: the hidden state stays in plain `Vec<f32>` rows between the kernels (no
//! per-op tensor allocation); the LM head runs only on the rows that need logits (prefill needs
//! one). Tried and dropped: candle's matmul + softmax attention, with KV heads expanded or with
//! query heads folded into rows; both changed logits by up to ~1 between batched and single-token
//! forwards.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::{KvCache, PagedPool, Slots};
use crate::model::block::{self, load_block, BlockReader, Need, Projections};
use crate::model::config::DecoderConfig;
use crate::model::forward::check_token_ids;
use crate::model::kernels::attention::{Attention, HeadShape, RowView};
use crate::model::kernels::ggml_math::{geglu, swiglu};
use crate::model::kernels::qlinear::QLinear;
use crate::model::layout::{global_weight, Family, Global, Naming};
use crate::model::rope::{Pairing, Rope};
use crate::model::{select_vocab, CausalLm, ForwardBatch, ForwardOutput, GgufWeights, ModelInfo, Tap};

/// A quantized matrix and its bias, when the file has one.
struct Linear {
    weight: QLinear,
    /// `[out_features]`
    bias: Option<Vec<f32>>,
}

impl Linear {
    /// Bytes held: the weight and the f32 bias.
    fn bytes(&self) -> usize {
        self.weight.resident_bytes() + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }

    /// `[n, in_features]` -> `[n, out_features]`; the bias is added as ggml adds it, after.
    fn forward(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let mut y = self.weight.forward_rows(x, n)?;
        self.add_bias(&mut y);
        Ok(y)
    }

    /// `y`: `[n, out_features]`.
    fn add_bias(&self, y: &mut [f32]) {
        if let Some(bias) = &self.bias {
            y.chunks_mut(bias.len()).for_each(|row| add_assign(row, bias));
        }
    }
}

impl Projections<Linear> {
    fn bytes(&self) -> usize {
        match self {
            Projections::Separate(linears) => linears.iter().map(Linear::bytes).sum(),
            Projections::Fused { linear, .. } => linear.bytes(),
        }
    }

    /// `[n, in_features]` -> one `[n, width]` matrix per projection.
    fn forward(&self, x: &[f32], n: usize) -> Result<Vec<Vec<f32>>> {
        match self {
            Projections::Separate(linears) => {
                let weights: Vec<&QLinear> = linears.iter().map(|l| &l.weight).collect();
                let mut outs = QLinear::forward_many(&weights, x, n)?;
                for (y, linear) in outs.iter_mut().zip(linears) {
                    linear.add_bias(y);
                }
                Ok(outs)
            }
            Projections::Fused { linear, widths } => {
                let y = linear.forward(x, n)?;
                let row_len: usize = widths.iter().sum();
                let mut parts: Vec<Vec<f32>> = widths.iter().map(|w| Vec::with_capacity(n * w)).collect();
                for row in y.chunks(row_len) {
                    let mut start = 0;
                    for (part, &width) in parts.iter_mut().zip(widths) {
                        part.extend_from_slice(&row[start..start + width]);
                        start += width;
                    }
                }
                Ok(parts)
            }
        }
    }
}

/// The block (`model/block.rs`) with quantized matrices and f32 norms.
type Block = block::Block<Linear, Vec<f32>>;

impl Block {
    /// Bytes of weights one row's pass through the block reads: every matrix, bias and norm.
    fn step_weight_bytes(&self) -> usize {
        let norms = [&self.q_norm, &self.k_norm, &self.post_attn_norm, &self.post_ffn_norm];
        let f32s = self.attn_norm.len()
            + self.ffn_norm.len()
            + norms.iter().flat_map(|n| n.iter()).map(Vec::len).sum::<usize>();
        self.qkv.bytes() + self.wo.bytes() + self.gate_up.bytes() + self.w_down.bytes() + 4 * f32s
    }
}

pub struct CpuDecoder {
    info: ModelInfo,
    config: DecoderConfig,
    /// The token embedding table; None when the tied LM head is repacked and serves the lookup
    /// from its tiles (the same values), so the table is not held twice.
    embed: Option<Arc<QTensor>>,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    lm_head: QLinear,
    global_rope: Rope,
    /// Sliding-window layers' rotation (Gemma: base 10000).
    local_rope: Option<Rope>,
    /// Gemma and Phi-3 multiply q by the attention scale before q·k (llama.cpp's graphs), the
    /// others scale q·k inside the softmax; the two round differently unless the scale is a power
    /// of two.
    scale_query: bool,
    device: Device,
    weight_bytes: usize,
    /// Bytes of weights a single-row step reads (`CausalLm::step_weight_bytes`).
    step_weight_bytes: usize,
}

impl GgufWeights<'_> {
    /// Norm weights and biases are small and used in f32.
    fn f32_vec(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self.qtensor(name)?.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
    }
}

/// Reads a GGUF file's blocks into this backend's types. The shapes were checked against the
/// same config before (`GgufWeights::new`), so the reader does not take them again.
struct GgufReader<'r, 'a>(&'r mut GgufWeights<'a>);

impl BlockReader for GgufReader<'_, '_> {
    type Linear = Linear;
    type Vector = Vec<f32>;

    fn has(&self, name: &str) -> bool {
        self.0.gguf.has_tensor(name)
    }

    fn linear(&mut self, tensor: &str, _rows: usize, _cols: usize, bias: Need) -> Result<Linear> {
        let weight = QLinear::new(self.0.qtensor(&format!("{tensor}.weight"))?)?;
        let bias = self.0.read_if(bias, &format!("{tensor}.bias"), GgufWeights::f32_vec)?;
        Ok(Linear { weight, bias })
    }

    fn norm(&mut self, name: &str, _len: usize) -> Result<Vec<f32>> {
        self.0.f32_vec(name)
    }
}

impl CpuDecoder {
    /// Whether this config fits this implementation: every GGUF family but one with attention
    /// soft-capping (none of llama.cpp's graphs for these families has it). Anything else runs on
    /// `candle/decoder.rs`.
    pub fn runs(config: &DecoderConfig) -> bool {
        crate::model::families::GGUF_ARCHITECTURES.contains(&config.architecture.as_str())
            && config.attn_logit_softcap.is_none()
    }

    /// `config` comes from `families::from_gguf` and passed `runs`.
    pub fn load(gguf: &mut GgufFile, config: DecoderConfig) -> Result<Self> {
        let device = Device::Cpu;
        let mut w = GgufWeights::new(gguf, &config, &device)?;
        let family = Family::of(&config);
        let global = |g| global_weight(Naming::Gguf, g);
        let embed = w.qtensor(&global(Global::Embedding))?;
        let lm_head = if config.tie_word_embeddings {
            QLinear::new(embed.clone())?
        } else {
            QLinear::new(w.qtensor(&global(Global::Output))?)?
        };
        let final_norm = w.f32_vec(&global(Global::FinalNorm))?;
        let mut reader = GgufReader(&mut w);
        let blocks = (0..config.num_layers)
            .map(|i| load_block(&mut reader, Naming::Gguf, &config, i))
            .collect::<Result<Vec<_>>>()?;
        let weight_bytes = w.num_bytes;
        let step_weight_bytes = lm_head.resident_bytes()
            + 4 * final_norm.len()
            + blocks.iter().map(Block::step_weight_bytes).sum::<usize>();
        // A tied head that is repacked holds the table's values: the lookup reads its tiles.
        let head_serves_lookup = config.tie_word_embeddings && matches!(lm_head, QLinear::Repacked { .. });
        let embed = (!head_serves_lookup).then_some(embed);
        let pairing = if config.rope_interleaved { Pairing::Interleaved } else { Pairing::Halves };
        let factors = config.rope_freq_factors.as_deref();
        let rope = |base: f32, freq_scale: f32| Rope::new(config.rope_dims, base, freq_scale, factors, pairing);
        let global_rope = rope(config.rope_theta, 1.0 / config.rope_linear_factor);
        let local_rope = config.sliding_layers.iter().any(|&s| s).then(|| rope(config.rope_theta_local, 1.0));
        Ok(Self {
            info: ModelInfo::of(&config, crate::model::kernels::checked_kernels()?.name),
            embed,
            blocks,
            final_norm,
            lm_head,
            global_rope,
            local_rope,
            scale_query: family.scale_query,
            device,
            weight_bytes,
            step_weight_bytes,
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

fn shape_bug(what: &str) -> Error {
    Error::Internal(format!("{what}: wrong number of projections"))
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

    fn step_weight_bytes(&self) -> usize {
        self.step_weight_bytes
    }

    fn kv_read_bytes(&self, context: usize) -> usize {
        // The host cache holds f16 (`kv_cache/contiguous.rs`).
        self.config.kv_read_bytes(context, 2)
    }

    fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let i = &self.info;
        Ok(KvCache::new(i.num_layers, i.num_kv_heads * i.head_dim, capacity, i.context_length))
    }

    fn new_paged_pool(&self, block_size: usize, num_blocks: usize) -> Result<Arc<PagedPool>> {
        let i = &self.info;
        PagedPool::new(i.num_layers, i.num_kv_heads * i.head_dim, block_size, num_blocks)
    }

    fn forward_batch(&self, batch: &ForwardBatch, caches: &mut [&mut KvCache]) -> Result<ForwardOutput> {
        let c = &self.config;
        let pasts: Vec<usize> = caches.iter().map(|cache| cache.len()).collect();
        batch.check(self.blocks.len(), c.vocab_size, &pasts)?;
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.reserve(batch.seq_range(s).len())?;
        }
        let n = batch.num_rows();
        let (eps, head_dim, hidden) = (c.rms_eps, c.head_dim, c.hidden_size);
        let kv_width = c.num_kv_heads * head_dim;
        let shape = HeadShape { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim };
        let num_blocks = batch.exit_layer.unwrap_or(self.blocks.len());
        let global_angles = self.global_rope.tables_at(&batch.positions);
        let local_angles = self.local_rope.as_ref().map(|rope| rope.tables_at(&batch.positions));
        // What each row sees after its cache's old positions: its chain predecessors in place, or
        // a tree node's ancestors at their slots (`attention::RowView`).
        let mut sees: Vec<(usize, usize, Vec<usize>)> = Vec::with_capacity(n); // (seq, prefix, extra)
        for (s, &past) in pasts.iter().enumerate() {
            let chain = batch.is_chain(s);
            for (i, row) in batch.seq_range(s).enumerate() {
                if chain {
                    sees.push((s, past + i + 1, Vec::new()));
                } else {
                    sees.push((s, past, batch.path(s, row).iter().map(|a| past + a).collect()));
                }
            }
        }

        let mut x: Vec<f32> = self.embed(&batch.tokens)?.flatten_all()?.to_vec1()?; // [n, hidden]
        if let Some(scale) = c.embed_scale {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let mut taps: Vec<Option<Vec<f32>>> = vec![None; batch.taps.len()];
        let mut capture = |after: usize, x: &[f32]| {
            for (slot, tap) in taps.iter_mut().zip(&batch.taps) {
                if *tap == Tap::Residual(after) {
                    *slot = Some(x.to_vec());
                }
            }
        };
        capture(0, &x);
        for (layer, block) in self.blocks[..num_blocks].iter().enumerate() {
            let sliding = c.sliding_layers[layer];
            let (rope, (cos, sin)) = match (&self.local_rope, &local_angles) {
                (Some(rope), Some(angles)) if sliding => (rope, angles),
                _ => (&self.global_rope, &global_angles),
            };
            let h = rms_norm(&x, &block.attn_norm, eps);
            // [n, heads * hd], [n, kv_heads * hd], [n, kv_heads * hd]
            let [q, k, v]: [Vec<f32>; 3] = block.qkv.forward(&h, n)?.try_into().map_err(|_| shape_bug("qkv"))?;
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
            for (s, cache) in caches.iter_mut().enumerate() {
                let rows = batch.seq_range(s);
                let kv = rows.start * kv_width..rows.end * kv_width;
                cache.append(layer, &k[kv.clone()], &v[kv])?;
            }
            let layers: Vec<Slots> = caches.iter().map(|cache| cache.host_layer(layer)).collect::<Result<_>>()?;
            let views: Vec<RowView> =
                sees.iter().map(|(s, prefix, extra)| RowView { kv: &layers[*s], prefix: *prefix, extra }).collect();
            let window = c.sliding_window.filter(|_| sliding);
            let attn = Attention { shape, scale: score_scale, window }.forward_rows(&q, &views)?;
            let out = norm_if(block.wo.forward(&attn, n)?, block.post_attn_norm.as_ref(), eps);
            add_assign(&mut x, &out);

            let h = rms_norm(&x, &block.ffn_norm, eps);
            // [n, ffn] each
            let [mut gate, up]: [Vec<f32>; 2] =
                block.gate_up.forward(&h, n)?.try_into().map_err(|_| shape_bug("gate_up"))?;
            if c.gelu {
                geglu(&mut gate, &up);
            } else {
                swiglu(&mut gate, &up);
            }
            let down = norm_if(block.w_down.forward(&gate, n)?, block.post_ffn_norm.as_ref(), eps);
            add_assign(&mut x, &down);
            capture(layer + 1, &x);
        }
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.commit(batch.seq_range(s).len());
        }

        // The final norm is per row: normalizing every row for a tap gives the logit rows the
        // same values as normalizing those rows alone.
        let final_normed = batch.taps.contains(&Tap::FinalNorm).then(|| rms_norm(&x, &self.final_norm, eps));
        let logit_input: Vec<f32> = batch
            .logit_rows
            .iter()
            .flat_map(|&row| match &final_normed {
                Some(normed) => normed[row * hidden..(row + 1) * hidden].to_vec(),
                None => rms_norm(&x[row * hidden..(row + 1) * hidden], &self.final_norm, eps),
            })
            .collect();
        let num_logit_rows = batch.logit_rows.len();
        let logits = self.logits(&logit_input, num_logit_rows)?;
        let hidden_states = taps
            .into_iter()
            .zip(&batch.taps)
            .map(|(captured, tap)| {
                let values = match tap {
                    Tap::FinalNorm => final_normed.clone(),
                    Tap::Residual(_) => captured,
                }
                .ok_or_else(|| Error::Internal(format!("tap {tap:?} was not captured")))?;
                Ok(Tensor::from_vec(values, (n, hidden), &self.device)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ForwardOutput { logits, hidden: hidden_states, carried: None })
    }

    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        check_token_ids(tokens, self.config.vocab_size)?;
        let Some(table) = &self.embed else {
            // [n, hidden] from the tied head's tiles.
            let rows = self.lm_head.dequantize_rows(tokens).expect("a repacked tied head (see load)");
            return Ok(Tensor::from_vec(rows, (tokens.len(), self.config.hidden_size), &self.device)?);
        };
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(table.embedding(&ids)?) // [n, hidden]
    }

    fn lm_head(&self, hidden: &Tensor, vocab_subset: Option<&[u32]>) -> Result<Tensor> {
        let rows = hidden.dim(0)?;
        let logits = self.logits(&hidden.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1()?, rows)?;
        select_vocab(logits, vocab_subset, self.config.vocab_size)
    }
}

impl CpuDecoder {
    /// The LM head and the final soft-cap: `[num_rows, hidden]` final-normed rows -> logits
    /// `[num_rows, vocab]`.
    fn logits(&self, normed: &[f32], num_rows: usize) -> Result<Tensor> {
        let vocab = self.lm_head.out_features();
        if num_rows == 0 {
            return Ok(Tensor::zeros((0, vocab), candle_core::DType::F32, &self.device)?);
        }
        let mut logits = self.lm_head.forward_rows(normed, num_rows)?;
        if let Some(cap) = self.config.final_logit_softcap {
            // ggml's order: scale by 1/cap, tanh, scale by cap.
            let inv = 1.0 / cap;
            logits.iter_mut().for_each(|v| *v = (*v * inv).tanh() * cap);
        }
        Ok(Tensor::from_vec(logits, (num_rows, vocab), &self.device)?)
    }
}
