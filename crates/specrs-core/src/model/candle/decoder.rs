//! The shared decoder-only transformer, written with candle tensor ops so it runs on any candle
//! device: every family on CUDA, and on the CPU what `cpu/decoder.rs` does not run (HF safetensors
//! directories, seeded random models, GGUF with attention soft-capping). Llama, Mistral, Qwen2/2.5,
//! Qwen3, Gemma 3 and Phi-3 are one block with flags (`DecoderConfig`); which GGUF keys set them
//! is in `families.rs`. Weights are GGUF tensors (specrs' kernels on the CPU, candle's quantized
//! matmul on CUDA) or dense bf16/f16/f32 tensors (safetensors, seeded random weights), each block
//! loaded by `model/block.rs`'s one loader through this file's readers (`GgufReader`, `HfReader`,
//! `RandomReader`). Attention is `attention.rs`'s.
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
//! to the cache. On CUDA it does not promise bitwise row independence: cuBLAS picks its kernels by
//! shape, so a k+1-token verify can round differently from single steps, and greedy speculative
//! output equals plain greedy output except at near-ties (the GPU check counts them). On the CPU
//! specrs' kernels run every dense weight (f32, bf16, f16: `kernels/dense.rs`) and the quantized
//! ones they have (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), each row-independent, and attention is
//! computed one query row at a time, so there the two are equal.
//! Attention runs in f32 over the cache (kept in the model's dtype: f32 for quantized weights,
//! bf16/f16 for dense ones), which keeps those differences at the matmuls' rounding.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::ops::rms_norm;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::{KvCache, PagedPool};
use crate::model::block::{self, load_block, BlockReader, Need, Projections};
use crate::model::candle::attention::{attention, softcap, tree_attention, Scores};
use crate::model::candle::fused::{act_mul, add_rms_norm, qkv_heads, HeadsSpec, QkvHeads};
use crate::model::candle::paged_attention::{PagedStep, StepWords};
use crate::model::candle::step_buffer::StepBuffers;
use crate::model::candle::step_graphs::{
    activation_bytes, ActivationDims, GraphKey, GraphMode, GraphStatus, LaunchPlan, StepGraphs, StepTensors,
};
use crate::model::candle::step_shape::{Padding, StepShape};
use crate::model::candle::upload;
use crate::model::config::DecoderConfig;
use crate::model::forward::check_token_ids;
use crate::model::forward::Carried;
use crate::model::hf_dir::HfWeights;
use crate::model::kernels::qlinear::QLinear;
use crate::model::kernels::{self, dense};
use crate::model::layout::{global_tensor, global_weight, Family, Global, Naming};
use crate::model::llama_config::LlamaConfig;
use crate::model::random;
use crate::model::rope::{Pairing, Rope};
use crate::model::{select_vocab, CausalLm, ForwardBatch, ForwardOutput, GgufWeights, ModelInfo, Tap};

/// The paged pool a forward's caches are on, and each sequence's block table.
type PagedCaches<'c> = (Arc<PagedPool>, Vec<&'c [u32]>);

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
    /// `[out_features, in_features]`, in the activation dtype. On the CPU specrs' dense kernels
    /// (`kernels/dense.rs`) run it, whose rows never change each other; candle's gemm elsewhere.
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

    /// `[n, in_features]` -> `[n, out_features]`, in `x`'s dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::Quantized(w) => quantized_forward(w, x)?,
            Weight::Dense(w) => dense_forward(w, x)?,
            Weight::Native(w) => {
                let n = x.dim(0)?;
                let rows = w.forward_rows(&x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?, n)?;
                Tensor::from_vec(rows, (n, w.out_features()), x.device())?.to_dtype(x.dtype())?
            }
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// Its bias, and a dense weight, in `dtype` (the model's activations').
    fn cast(&mut self, dtype: DType) -> Result<()> {
        if let Weight::Dense(w) = &mut self.weight {
            *w = w.to_dtype(dtype)?;
        }
        self.bias = self.bias.take().map(|b| b.to_dtype(dtype)).transpose()?;
        Ok(())
    }

    /// Bytes a forward reads from this layer: its weight as stored, and its bias.
    fn bytes(&self) -> usize {
        let tensor_bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let weight = match &self.weight {
            Weight::Native(w) => w.resident_bytes(),
            Weight::Quantized(QMatMul::QTensor(q)) => q.storage_size_in_bytes(),
            Weight::Quantized(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) | Weight::Dense(t) => tensor_bytes(t),
        };
        weight + self.bias.as_ref().map_or(0, tensor_bytes)
    }
}

/// `x [n, in_features]` times a dense `w [out_features, in_features]`: specrs' CPU kernels on the
/// CPU, candle's matmul elsewhere. The launch count runs candle's on the CPU too, the path CUDA
/// takes, as the one launch it is there (`launches.rs`).
fn dense_forward(w: &Tensor, x: &Tensor) -> Result<Tensor> {
    #[cfg(test)]
    if crate::model::candle::launches::GPU_GEMMS.with(std::cell::Cell::get) {
        return crate::model::candle::launches::one_launch(|| Ok(x.matmul(&w.t()?)?));
    }
    match dense::forward(kernels::kernels(), w, x)? {
        Some(y) => Ok(y),
        None => Ok(x.matmul(&w.t()?)?),
    }
}

/// Bytes one single-row step reads from a block: every projection and norm once.
fn block_bytes(block: &Block) -> usize {
    let projections = |p: &Projections<Linear>| match p {
        Projections::Separate(linears) => linears.iter().map(Linear::bytes).sum(),
        Projections::Fused { linear, .. } => linear.bytes(),
    };
    let norms = [
        Some(&block.attn_norm),
        block.q_norm.as_ref(),
        block.k_norm.as_ref(),
        block.post_attn_norm.as_ref(),
        Some(&block.ffn_norm),
        block.post_ffn_norm.as_ref(),
    ];
    let norm_bytes: usize = norms.into_iter().flatten().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum();
    projections(&block.qkv) + block.wo.bytes() + projections(&block.gate_up) + block.w_down.bytes() + norm_bytes
}

/// `x [n, in_features]` times a quantized `w`, in `x`'s dtype: on CUDA candle's MMVQ / MMQ
/// kernels read bf16 (or f16, f32) activations as they are, for the GGML types they run
/// (`MMQ_TYPES`); elsewhere (the CPU's kernels, other types) through f32.
fn quantized_forward(w: &QMatMul, x: &Tensor) -> Result<Tensor> {
    let direct = match w {
        QMatMul::QTensor(q) => x.dtype() == DType::F32 || (x.device().is_cuda() && MMQ_TYPES.contains(&q.dtype())),
        QMatMul::Tensor(_) | QMatMul::TensorF16(_) => false,
    };
    if direct {
        return Ok(w.forward(&x.contiguous()?)?);
    }
    Ok(w.forward(&x.to_dtype(DType::F32)?)?.to_dtype(x.dtype())?)
}

/// The GGML types candle's CUDA quantized matmuls take bf16 activations for (candle-core
/// `quantized/fast_mmvq.rs` and `fast_mmq.rs`).
const MMQ_TYPES: [GgmlDType; 10] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// The activations (and KV cache) of a model with quantized weights on `device`: bf16 on CUDA,
/// where the quantized matmuls read them as they are and the cache read per step halves; f32
/// on the CPU, whose quantized kernels take f32.
fn quantized_activations(device: &Device) -> DType {
    #[cfg(test)]
    if QUANTIZED_BF16.with(std::cell::Cell::get) {
        return DType::BF16; // the CUDA path's dtypes, run on the CPU
    }
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

/// A quantized weight: specrs' native kernel where it has one for this type on the CPU, candle's
/// quantized matmul otherwise (other types, and CUDA); an unquantized GGML tensor (F32, F16,
/// BF16) dense, cast to the activation dtype with the rest (`Decoder::assemble`).
fn quantized_weight(t: Arc<QTensor>) -> Result<Weight> {
    if matches!(t.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
        return Ok(Weight::Dense(t.dequantize(&t.device())?));
    }
    if t.device().is_cpu() {
        let native = QLinear::new(t.clone())?;
        if native.is_native() {
            return Ok(Weight::Native(native));
        }
    }
    Ok(Weight::Quantized(QMatMul::from_arc(t)?))
}

/// Stacks one input's separate projections (q/k/v, or gate/up) and their biases into one
/// matrix, so they run as one matmul whose output is split: on a GPU a decode step is dozens of
/// small launches per layer, and each one saved is time saved. Dense weights stack in their
/// dtype; quantized ones when they share one GGML type (a quantized row is whole blocks, so the
/// stacked tensor's bytes are theirs end to end, and each output row is computed as before,
/// bitwise); a Q4_K_M file's Q6_K v beside Q4_K q and k stays separate.
fn stack_projections(linears: Vec<Linear>) -> Result<Projections<Linear>> {
    #[cfg(test)]
    let stacks = STACK_PROJECTIONS.with(std::cell::Cell::get);
    #[cfg(not(test))]
    let stacks = true;
    if !stacks {
        return Ok(Projections::Separate(linears));
    }
    let dense: Option<Vec<&Tensor>> = linears
        .iter()
        .map(|l| match &l.weight {
            Weight::Dense(w) => Some(w),
            Weight::Quantized(_) | Weight::Native(_) => None,
        })
        .collect();
    let (weight, widths) = match dense {
        Some(weights) => {
            let widths = weights.iter().map(|w| w.dim(0)).collect::<candle_core::Result<Vec<_>>>()?;
            (Weight::Dense(Tensor::cat(&weights, 0)?), widths)
        }
        None => match stack_quantized(&linears)? {
            Some(stacked) => stacked,
            None => return Ok(Projections::Separate(linears)),
        },
    };
    // A projection without a bias gets zeros beside the others' (Qwen2's q/k/v all have one).
    let bias = match linears.iter().find_map(|l| l.bias.as_ref()) {
        Some(some) => {
            let parts = linears
                .iter()
                .zip(&widths)
                .map(|(l, &width)| match &l.bias {
                    Some(b) => Ok(b.clone()),
                    None => Ok(Tensor::zeros(width, some.dtype(), some.device())?),
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::cat(&parts, 0)?)
        }
        None => None,
    };
    Ok(Projections::Fused { linear: Linear { weight, bias }, widths })
}

/// `linears`' quantized weights stacked into one (and their widths), when every one keeps its
/// tensor (`QLinear::qtensor`; a repacked CPU weight does not) and all share its GGML type and
/// input width; None otherwise.
fn stack_quantized(linears: &[Linear]) -> Result<Option<(Weight, Vec<usize>)>> {
    let tensors: Option<Vec<Arc<QTensor>>> = linears
        .iter()
        .map(|l| match &l.weight {
            Weight::Quantized(QMatMul::QTensor(q)) => Some(q.clone()),
            Weight::Native(native) => native.qtensor(),
            Weight::Quantized(_) | Weight::Dense(_) => None,
        })
        .collect();
    let Some(tensors) = tensors else { return Ok(None) };
    let dims = tensors.iter().map(|q| q.shape().dims2()).collect::<candle_core::Result<Vec<_>>>()?;
    let (dtype, cols) = (tensors[0].dtype(), dims[0].1);
    if tensors.iter().zip(&dims).any(|(q, &(_, c))| q.dtype() != dtype || c != cols) {
        return Ok(None);
    }
    let mut bytes = Vec::with_capacity(tensors.iter().map(|q| q.storage_size_in_bytes()).sum());
    for q in &tensors {
        bytes.extend_from_slice(&q.data()?); // a download at load, on CUDA
    }
    let widths: Vec<usize> = dims.iter().map(|&(rows, _)| rows).collect();
    let device = tensors[0].device();
    let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &device, dtype)?;
    let stacked = QTensor::new(storage, (widths.iter().sum::<usize>(), cols))?;
    Ok(Some((quantized_weight(Arc::new(stacked))?, widths)))
}

#[cfg(test)]
thread_local! {
    /// Whether this thread's loads stack projections (tests load a model both ways).
    pub(crate) static STACK_PROJECTIONS: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
    /// Whether this thread's quantized models run bf16 activations on the CPU too.
    pub(crate) static QUANTIZED_BF16: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Projections<Linear> {
    /// `[n, in_features]` -> `[n, sum of widths]`: the projections side by side (a fused matrix's
    /// one output; separate ones concatenated).
    fn forward_joined(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Projections::Separate(linears) => {
                Ok(Tensor::cat(&linears.iter().map(|l| l.forward(x)).collect::<Result<Vec<_>>>()?, 1)?)
            }
            Projections::Fused { linear, .. } => linear.forward(x),
        }
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

/// The block (`model/block.rs`) with candle linears, its norms in the model's dtype and its q/k
/// norms in f32 (q and k are normed in f32, `Decoder::heads`).
type Block = block::Block<Linear, Tensor>;

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
    /// Bytes of weights a single-row step reads (`CausalLm::step_weight_bytes`): the blocks, the
    /// final norm and the LM head, not the embedding table (a step looks up one of its rows).
    step_weight_bytes: usize,
    /// The static buffers paged steps write their descriptors into.
    step_buffers: Arc<StepBuffers>,
    /// Whether paged steps are padded to the captured shapes (`step_shape.rs`): with graphs on
    /// (eagerly the padding rows are work for nothing).
    pad_steps: std::sync::atomic::AtomicBool,
    /// The captured steps (`step_graphs.rs`).
    step_graphs: StepGraphs,
}

impl GgufWeights<'_> {
    /// `{name}.weight`, with `{name}.bias` when `bias` reads it.
    fn linear(&mut self, name: &str, bias: Need) -> Result<Linear> {
        let weight = quantized_weight(self.qtensor(&format!("{name}.weight"))?)?;
        let bias = self.read_if(bias, &format!("{name}.bias"), Self::vector)?;
        Ok(Linear { weight, bias })
    }

    /// A small tensor used in f32 (norms, biases).
    fn vector(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.qtensor(name)?.dequantize(self.device)?)
    }
}

/// Reads a GGUF file's blocks into this backend's types. The shapes were checked against the
/// same config before (`GgufWeights::new`), so the reader does not take them again.
struct GgufReader<'r, 'a>(&'r mut GgufWeights<'a>);

impl BlockReader for GgufReader<'_, '_> {
    type Linear = Linear;
    type Vector = Tensor;

    fn has(&self, name: &str) -> bool {
        self.0.gguf.has_tensor(name)
    }

    fn linear(&mut self, tensor: &str, _rows: usize, _cols: usize, bias: Need) -> Result<Linear> {
        self.0.linear(tensor, bias)
    }

    fn norm(&mut self, name: &str, _len: usize) -> Result<Tensor> {
        self.0.vector(name)
    }

    fn separate(&mut self, linears: Vec<Linear>) -> Result<Projections<Linear>> {
        stack_projections(linears)
    }
}

/// Reads a Hugging Face directory's tensors (dense, in the model's dtype), each checked against
/// the shape the config implies (`HfWeights::tensor`).
struct HfReader<'r> {
    weights: &'r mut HfWeights,
    /// Gemma's RMSNorm multiplies by (1 + weight); the stored weight is the offset.
    norm_offset: bool,
}

impl BlockReader for HfReader<'_> {
    type Linear = Linear;
    type Vector = Tensor;

    fn has(&self, name: &str) -> bool {
        self.weights.has(name)
    }

    fn linear(&mut self, tensor: &str, rows: usize, cols: usize, bias: Need) -> Result<Linear> {
        let bias_name = format!("{tensor}.bias");
        let bias = match bias {
            Need::Required => Some(self.weights.tensor(&bias_name, &[rows])?),
            Need::IfStored => self.weights.optional(&bias_name, &[rows])?,
            Need::Never => None,
        };
        let weight = Weight::Dense(self.weights.tensor(&format!("{tensor}.weight"), &[rows, cols])?);
        Ok(Linear { weight, bias })
    }

    fn norm(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let t = self.weights.tensor(name, &[len])?;
        Ok(if self.norm_offset { (t + 1.0)? } else { t })
    }

    fn separate(&mut self, linears: Vec<Linear>) -> Result<Projections<Linear>> {
        stack_projections(linears)
    }
}

/// Draws `Decoder::random`'s weights as the block loader asks for them: a Llama with no
/// optional weight, each matrix from its own stream of the seed, in the order drawn.
struct RandomReader<'d> {
    seed: u64,
    /// The last stream drawn.
    stream: u64,
    format: WeightFormat,
    /// What weights are drawn in (dense ones stay in it; quantized ones are drawn in f32).
    dtype: DType,
    device: &'d Device,
    num_bytes: usize,
}

impl RandomReader<'_> {
    /// `[rows, cols]` in `dtype` on `on`, with standard deviation 1/sqrt(cols): activations stay
    /// O(1) at any depth.
    fn draw(&mut self, rows: usize, cols: usize, on: &Device) -> Result<Tensor> {
        self.stream += 1;
        random::uniform((rows, cols), 1.0 / (cols as f32).sqrt(), self.seed, self.stream, self.dtype, on)
    }

    /// A `[rows, cols]` linear layer without bias, in `format`.
    fn matrix(&mut self, rows: usize, cols: usize) -> Result<Linear> {
        let weight = match self.format {
            WeightFormat::Dense(_) => {
                self.num_bytes += rows * cols * self.dtype.size_in_bytes();
                Weight::Dense(self.draw(rows, cols, self.device)?)
            }
            WeightFormat::Quantized(q) => {
                if !cols.is_multiple_of(q.block_size()) {
                    return Err(Error::config(format!(
                        "{q:?} packs rows in blocks of {} values, and this config has a {cols}-wide matrix; \
                         pick sizes divisible by {0} or another dtype",
                        q.block_size()
                    )));
                }
                let w = quantize_rows_in_parallel(&self.draw(rows, cols, &Device::Cpu)?, q, self.device)?;
                self.num_bytes += w.storage_size_in_bytes();
                quantized_weight(Arc::new(w))?
            }
        };
        Ok(Linear::new(weight))
    }
}

/// `src` `[rows, cols]` (on the CPU) quantized to `q` on `device`: bands of rows quantized on
/// the cores at once (candle's quantization runs on one; a quantized row is whole blocks, so the
/// bands' bytes end to end are the whole tensor's, bitwise), then placed on `device` once. A
/// random 8B model builds in a fraction of the time.
fn quantize_rows_in_parallel(src: &Tensor, q: GgmlDType, device: &Device) -> Result<QTensor> {
    use rayon::prelude::*;
    let (rows, cols) = src.dims2()?;
    let band = rows.div_ceil(rayon::current_num_threads().max(1)).max(1);
    let bands = (0..rows)
        .step_by(band)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|start| {
            // A storage of its own: candle quantizes a tensor's whole storage, whatever the view
            // (and `copy` keeps the view's offset into a clone of the whole).
            let n = band.min(rows - start);
            let values = src.narrow(0, start, n)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let part = QTensor::quantize(&Tensor::from_vec(values, (n, cols), &Device::Cpu)?, q)?;
            Ok(part.data()?.into_owned())
        })
        .collect::<Result<Vec<Vec<u8>>>>()?;
    let storage = QStorage::from_data(std::borrow::Cow::Owned(bands.concat()), device, q)?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

impl BlockReader for RandomReader<'_> {
    type Linear = Linear;
    type Vector = Tensor;

    /// A random model stores nothing beyond what the loader requires: separate projections, no
    /// bias, no optional norm.
    fn has(&self, _name: &str) -> bool {
        false
    }

    fn linear(&mut self, tensor: &str, rows: usize, cols: usize, bias: Need) -> Result<Linear> {
        if bias == Need::Required {
            return Err(Error::Internal(format!("random weights have no bias, and '{tensor}' needs one")));
        }
        self.matrix(rows, cols)
    }

    /// Norms of ones.
    fn norm(&mut self, _name: &str, len: usize) -> Result<Tensor> {
        Ok(Tensor::ones(len, self.dtype, self.device)?)
    }

    fn separate(&mut self, linears: Vec<Linear>) -> Result<Projections<Linear>> {
        stack_projections(linears)
    }
}

impl Decoder {
    /// A GGUF file of a family `families.rs` knows, on `device`.
    pub fn from_gguf(gguf: &mut GgufFile, config: DecoderConfig, device: &Device) -> Result<Self> {
        let mut w = GgufWeights::new(gguf, &config, device)?;
        let global = |g| global_weight(Naming::Gguf, g);
        let embed_q = w.qtensor(&global(Global::Embedding))?;
        // The lookup table is dequantized once (as candle's own quantized llama does): a gather
        // from quantized blocks has no CUDA kernel.
        let embed = embed_q.dequantize(device)?;
        let lm_head = if config.tie_word_embeddings {
            Linear::new(quantized_weight(embed_q)?)
        } else {
            w.linear(global_tensor(Naming::Gguf, Global::Output), Need::IfStored)?
        };
        let final_norm = w.vector(&global(Global::FinalNorm))?;
        let mut reader = GgufReader(&mut w);
        let blocks = (0..config.num_layers)
            .map(|i| load_block(&mut reader, Naming::Gguf, &config, i))
            .collect::<Result<Vec<_>>>()?;
        let weight_bytes = w.num_bytes;
        let dtype = quantized_activations(device);
        Self::assemble(config, dtype, embed, blocks, final_norm, lm_head, device, weight_bytes)
    }

    /// A Hugging Face safetensors model (`hf_dir::open`), with transformers' tensor names.
    pub fn from_hf(w: &mut HfWeights, config: DecoderConfig) -> Result<Self> {
        let c = &config;
        let (hidden, vocab) = (c.hidden_size, c.vocab_size);
        let mut reader = HfReader { weights: w, norm_offset: Family::of(c).hf_norm_offset };
        let embed = reader.weights.tensor(&global_weight(Naming::Hf, Global::Embedding), &[vocab, hidden])?;
        let lm_head = if reader.has(&global_weight(Naming::Hf, Global::Output)) && !c.tie_word_embeddings {
            reader.linear(global_tensor(Naming::Hf, Global::Output), vocab, hidden, Need::IfStored)?
        } else {
            Linear::new(Weight::Dense(embed.clone()))
        };
        let final_norm = reader.norm(&global_weight(Naming::Hf, Global::FinalNorm), hidden)?;
        let blocks =
            (0..c.num_layers).map(|i| load_block(&mut reader, Naming::Hf, c, i)).collect::<Result<Vec<_>>>()?;
        let (dtype, device, num_bytes) = (w.dtype, w.device.clone(), w.num_bytes);
        Self::assemble(config, dtype, embed, blocks, final_norm, lm_head, &device, num_bytes)
    }

    /// Seeded random weights for a Llama with transformers' layout: linear weights with standard
    /// deviation 1/sqrt(fan_in), so activations stay O(1) at any depth; norms of ones; embedding
    /// rows of unit RMS. Dense weights are bf16/f16/f32; quantized ones go through candle's
    /// quantized matmul exactly as a GGUF file's do (embedding dense in f32). The same seed gives
    /// the same model on every device.
    pub fn random(config: &LlamaConfig, seed: u64, format: WeightFormat, device: &Device) -> Result<Self> {
        Self::random_of(DecoderConfig::from_llama(config), seed, format, device)
    }

    /// [`Decoder::random`] of a decoder config: another family's graph (`config.architecture`)
    /// over the same random weights, where the family needs no weight they lack (a bias).
    pub(crate) fn random_of(config: DecoderConfig, seed: u64, format: WeightFormat, device: &Device) -> Result<Self> {
        // Quantized weights and their embedding are drawn in f32 whatever the device's activation
        // dtype, so one seed gives one model everywhere.
        let (drawn, dtype) = match format {
            WeightFormat::Dense(dtype @ (DType::BF16 | DType::F16 | DType::F32)) => (dtype, dtype),
            WeightFormat::Dense(other) => {
                return Err(Error::config(format!("dense random weights come in bf16, f16 or f32, not {other:?}")))
            }
            WeightFormat::Quantized(_) => (DType::F32, quantized_activations(device)),
        };
        let mut reader = RandomReader { seed, stream: 0, format, dtype: drawn, device, num_bytes: 0 };
        // The blocks draw first, then the LM head, then the embedding: the seeded models' order.
        let blocks = (0..config.num_layers)
            .map(|i| load_block(&mut reader, Naming::Hf, &config, i))
            .collect::<Result<Vec<_>>>()?;
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let lm_head = reader.matrix(vocab, hidden)?;
        let embed = (reader.draw(vocab, hidden, device)? * (hidden as f64).sqrt())?;
        let num_bytes = reader.num_bytes + vocab * hidden * dtype.size_in_bytes();
        let final_norm = Tensor::ones(hidden, dtype, device)?;
        Self::assemble(config, dtype, embed, blocks, final_norm, lm_head, device, num_bytes)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        config: DecoderConfig,
        dtype: DType,
        embed: Tensor,
        mut blocks: Vec<Block>,
        final_norm: Tensor,
        lm_head: Linear,
        device: &Device,
        weight_bytes: usize,
    ) -> Result<Self> {
        // Norms, biases and dense matrices in the activation dtype (a GGUF file's are f32 or
        // f16; casts of tensors already in it are free), but q and k's norms: `qkv_heads` norms
        // them in f32, so their weights are cast once here, not in every forward.
        let mut lm_head = lm_head;
        lm_head.cast(dtype)?;
        for block in &mut blocks {
            for norm in [&mut block.q_norm, &mut block.k_norm] {
                *norm = norm.take().map(|w| w.to_dtype(DType::F32)).transpose()?;
            }
            for norm in [&mut block.attn_norm, &mut block.ffn_norm] {
                *norm = norm.to_dtype(dtype)?;
            }
            for norm in [&mut block.post_attn_norm, &mut block.post_ffn_norm] {
                *norm = norm.take().map(|w| w.to_dtype(dtype)).transpose()?;
            }
            for projections in [&mut block.qkv, &mut block.gate_up] {
                match projections {
                    Projections::Separate(linears) => linears.iter_mut().try_for_each(|l| l.cast(dtype))?,
                    Projections::Fused { linear, .. } => linear.cast(dtype)?,
                }
            }
            block.wo.cast(dtype)?;
            block.w_down.cast(dtype)?;
        }
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
        let final_norm = final_norm.to_dtype(dtype)?;
        let step_weight_bytes = blocks.iter().map(block_bytes).sum::<usize>()
            + lm_head.bytes()
            + final_norm.elem_count() * dtype.size_in_bytes();
        Ok(Self {
            info: ModelInfo::of(&config, kernels),
            dtype,
            embed: embed.to_dtype(dtype)?,
            blocks,
            final_norm,
            lm_head,
            global_rope,
            local_rope,
            device: device.clone(),
            weight_bytes,
            step_weight_bytes,
            step_buffers: Arc::default(),
            pad_steps: std::sync::atomic::AtomicBool::new(false),
            step_graphs: StepGraphs::default(),
            config,
        })
    }

    fn forward_layers(&self, batch: &ForwardBatch, caches: &mut [&mut KvCache]) -> Result<ForwardOutput> {
        let c = &self.config;
        let pasts: Vec<usize> = caches.iter().map(|cache| cache.len()).collect();
        batch.check(self.blocks.len(), c.vocab_size, &pasts)?;
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.reserve(batch.seq_range(s).len())?;
        }
        let plan = LaunchPlan {
            num_blocks: batch.exit_layer.unwrap_or(self.blocks.len()),
            taps: batch.taps.clone(),
            logits: !batch.logit_rows.is_empty(),
        };
        let (tensors, carried) = match self.paged_pool(caches)? {
            Some((pool, tables)) => self.paged_forward(batch, &pasts, &pool, &tables, &plan)?,
            None => (self.contiguous_forward(batch, caches, &pasts, &plan)?, None),
        };
        for (s, cache) in caches.iter_mut().enumerate() {
            cache.commit(batch.seq_range(s).len());
        }
        // Of a step padded to a captured shape, the batch's rows (and logit rows) are the first.
        let hidden =
            tensors.hidden.into_iter().map(|h| Ok(h.narrow(0, 0, batch.num_rows())?)).collect::<Result<Vec<_>>>()?;
        let logits = match tensors.logits {
            Some(logits) => logits.narrow(0, 0, batch.logit_rows.len())?,
            None => Tensor::zeros((0, c.vocab_size), DType::F32, &self.device)?,
        };
        Ok(ForwardOutput { logits, hidden, carried })
    }

    /// The embedding of `ids [n]` and the plan's layers: the residual stream after them
    /// `[n, hidden]` and the residuals the plan taps (`[n, hidden]` f32, every row), each layer's
    /// attention by `attend(layer, qkv [n, (heads + 2 kv_heads) * hd], spec, scores)` ->
    /// `[n, heads * hd]`.
    fn run_layers(
        &self,
        ids: &Tensor,
        plan: &LaunchPlan,
        mut attend: impl FnMut(usize, &Tensor, &HeadsSpec, Scores) -> Result<Tensor>,
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let c = &self.config;
        let eps = c.rms_eps;
        let num_blocks = plan.num_blocks;
        let mut x = self.embed.index_select(ids, 0)?; // [n, hidden]
        if let Some(scale) = c.embed_scale {
            x = (x * scale as f64)?;
        }
        let mut taps: Vec<Option<Tensor>> = vec![None; plan.taps.len()];
        let capture = |taps: &mut Vec<Option<Tensor>>, after: usize, x: &Tensor| -> Result<()> {
            for (slot, tap) in taps.iter_mut().zip(&plan.taps) {
                if *tap == Tap::Residual(after) {
                    *slot = Some(x.to_dtype(DType::F32)?);
                }
            }
            Ok(())
        };
        capture(&mut taps, 0, &x)?;
        // The attention norm of the layer about to run: the first layer's here, each later one's
        // fused with the residual add that ends the layer before it.
        let mut h = match self.blocks.first() {
            Some(block) if num_blocks > 0 => rms_norm(&x, &block.attn_norm, eps)?,
            _ => x.clone(),
        };
        for (layer, block) in self.blocks[..num_blocks].iter().enumerate() {
            let tables = match (&self.local_rope, c.sliding_layers[layer]) {
                (Some(local), true) => local,
                _ => &self.global_rope,
            };
            let spec = HeadsSpec {
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: c.head_dim,
                rope_dims: c.rope_dims,
                interleaved: c.rope_interleaved,
                cos: &tables.cos,
                sin: &tables.sin,
                q_norm: block.q_norm.as_ref(),
                k_norm: block.k_norm.as_ref(),
                eps,
            };
            let qkv = block.qkv.forward_joined(&h)?; // [n, (heads + 2 kv_heads) * hd]
            let window = c.sliding_window.filter(|_| c.sliding_layers[layer]);
            let scores = Scores { scale: c.attention_scale, logit_softcap: c.attn_logit_softcap, window };
            let attn = attend(layer, &qkv, &spec, scores)?; // [n, heads * hd]
            let mut out = block.wo.forward(&attn.to_dtype(self.dtype)?)?; // [n, hidden]
            if let Some(norm) = &block.post_attn_norm {
                out = rms_norm(&out, norm, eps)?;
            }
            let (sum, ffn_in) = add_rms_norm(&x, &out.to_dtype(x.dtype())?, &block.ffn_norm, eps)?;
            x = sum;

            let [gate, up]: [Tensor; 2] =
                block.gate_up.forward(&ffn_in)?.try_into().map_err(|_| shape_bug("gate_up"))?;
            let mut mlp = block.w_down.forward(&act_mul(&gate, &up, c.gelu)?)?; // [n, ffn] -> [n, hidden]
            if let Some(norm) = &block.post_ffn_norm {
                mlp = rms_norm(&mlp, norm, eps)?;
            }
            let mlp = mlp.to_dtype(x.dtype())?;
            match self.blocks[..num_blocks].get(layer + 1) {
                Some(next) => (x, h) = add_rms_norm(&x, &mlp, &next.attn_norm, eps)?,
                None => x = (x + mlp)?, // the final norm runs on the logit rows only
            }
            capture(&mut taps, layer + 1, &x)?;
        }
        Ok((x, taps))
    }

    /// The step's outputs from the residual stream `x [n, hidden]` after its layers and the
    /// residuals `captured` for the plan's taps: the final norm where the plan taps it, and the LM
    /// head over the final norm of the rows `logit_rows` (`[L]` u32 on the device; None: no logits).
    fn finish(
        &self,
        x: &Tensor,
        captured: Vec<Option<Tensor>>,
        plan: &LaunchPlan,
        logit_rows: Option<Tensor>,
    ) -> Result<StepTensors> {
        let eps = self.config.rms_eps;
        let final_normed =
            if plan.taps.contains(&Tap::FinalNorm) { Some(rms_norm(x, &self.final_norm, eps)?) } else { None };
        let logits = match logit_rows {
            Some(rows) => {
                let normed = match &final_normed {
                    Some(normed) => normed.index_select(&rows, 0)?,
                    None => rms_norm(&x.index_select(&rows, 0)?, &self.final_norm, eps)?,
                };
                Some(self.logits(&normed)?)
            }
            None => None,
        };
        let hidden = captured
            .into_iter()
            .zip(&plan.taps)
            .map(|(captured, tap)| match tap {
                Tap::FinalNorm => Ok(final_normed.as_ref().expect("computed above").to_dtype(DType::F32)?),
                Tap::Residual(_) => captured.ok_or_else(|| Error::Internal(format!("tap {tap:?} was not captured"))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StepTensors { hidden, logits })
    }

    /// A forward over contiguous caches: each sequence's keys and values appended to its cache and
    /// attended per sequence (a tree's rows through their paths).
    fn contiguous_forward(
        &self,
        batch: &ForwardBatch,
        caches: &mut [&mut KvCache],
        pasts: &[usize],
        plan: &LaunchPlan,
    ) -> Result<StepTensors> {
        let c = &self.config;
        let positions: Vec<u32> = batch.positions.iter().map(|&p| p as u32).collect();
        let (ids, positions) = (upload(&batch.tokens, &self.device)?, upload(&positions, &self.device)?);
        // Tree sequences: the cache cells each row sees, its sequence's past, then its path within
        // the new rows (root first, itself last).
        let tree_sees: Vec<Option<Vec<Vec<usize>>>> = (0..batch.num_seqs())
            .map(|s| {
                let past = pasts[s];
                let sees = |row| (0..past).chain(batch.path(s, row).iter().map(|a| past + a)).collect();
                (!batch.is_chain(s)).then(|| batch.seq_range(s).map(sees).collect())
            })
            .collect();
        let (x, captured) = self.run_layers(&ids, plan, |layer, qkv, spec, scores| {
            // [heads + 2 kv_heads, n, hd] f32: q normed and rotated, then k, then v.
            let heads = qkv_heads(qkv, &positions, spec)?;
            let q = heads.narrow(0, 0, c.num_heads)?; // [heads, n, hd]
            let k = heads.narrow(0, c.num_heads, c.num_kv_heads)?; // [kv_heads, n, hd]
            let v = heads.narrow(0, c.num_heads + c.num_kv_heads, c.num_kv_heads)?; // [kv_heads, n, hd]
            let mut attns = Vec::with_capacity(batch.num_seqs());
            for (s, cache) in caches.iter_mut().enumerate() {
                let rows = batch.seq_range(s);
                let (start, len, past) = (rows.start, rows.len(), pasts[s]);
                cache.append_tensors(layer, &k.narrow(1, start, len)?, &v.narrow(1, start, len)?)?;
                let (k_all, v_all) = cache.layer_tensors(layer, past + len)?; // [kv_heads, past + len, hd]
                                                                              // Attention runs in f32 over what the cache holds in the model's dtype.
                let (k_all, v_all) = (k_all.to_dtype(DType::F32)?, v_all.to_dtype(DType::F32)?);
                let q_seq = q.narrow(1, start, len)?;
                attns.push(match &tree_sees[s] {
                    None => attention(&q_seq, &k_all, &v_all, past, scores)?,
                    Some(sees) => tree_attention(&q_seq, &k_all, &v_all, sees, scores)?,
                });
            }
            Ok(Tensor::cat(&attns, 0)?) // [n, heads * hd]
        })?;
        let logit_rows = match plan.logits {
            true => Some(upload(&batch.logit_rows.iter().map(|&r| r as u32).collect::<Vec<_>>(), &self.device)?),
            false => None,
        };
        self.finish(&x, captured, plan, logit_rows)
    }

    /// A forward over a device paged pool: the step's words written (ONE upload) and its launches
    /// run eagerly, captured or replayed (`step_graphs.rs`), padded to its captured shape when
    /// steps are padded.
    fn paged_forward(
        &self,
        batch: &ForwardBatch,
        pasts: &[usize],
        pool: &PagedPool,
        tables: &[&[u32]],
        plan: &LaunchPlan,
    ) -> Result<(StepTensors, Option<Carried>)> {
        let padding = match (self.pad_steps.load(std::sync::atomic::Ordering::Relaxed), pool.dummy_slot()) {
            (true, Some(dummy_slot)) => StepShape::of(batch).map(|shape| Padding::new(shape, dummy_slot, tables)),
            _ => None,
        };
        let words = StepWords::of(batch, pasts, tables, pool.block_size(), padding.as_ref())?;
        let key = padding.map(|p| GraphKey { shape: p.shape, table_width: p.table_width, plan: plan.clone() });
        let estimate = key.as_ref().map_or(0, |key| self.activation_bytes(key.shape.num_rows(), plan));
        self.step_graphs
            .run(key, &words, estimate, &self.step_buffers, &self.device, |step| self.step_launches(step, pool, plan))
    }

    /// A written paged step's launches (what a captured graph holds): every sequence's rows
    /// written and attended at once per layer, in one launch (k and v normed, rotated and written
    /// into their slots; each q head normed and rotated as it loads), the result in the pool's
    /// dtype, the model's.
    fn step_launches(&self, step: &PagedStep, pool: &PagedPool, plan: &LaunchPlan) -> Result<StepTensors> {
        let (x, captured) = self.run_layers(&step.tokens()?, plan, |layer, qkv, spec, scores| {
            let pool = pool.device_layer(layer).ok_or_else(|| shape_bug("paged pool layer"))?;
            step.write_and_attend(pool, qkv, &QkvHeads::new(spec)?, scores)
        })?;
        let logit_rows = if plan.logits { Some(step.logit_rows()?) } else { None };
        self.finish(&x, captured, plan, logit_rows)
    }

    /// [`activation_bytes`] of a captured step of `rows` rows under `plan`.
    fn activation_bytes(&self, rows: usize, plan: &LaunchPlan) -> usize {
        let c = &self.config;
        let dims = ActivationDims {
            hidden: c.hidden_size,
            qkv: (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
            attention: c.num_heads * c.head_dim,
            ffn: c.intermediate_size,
            vocab: c.vocab_size,
        };
        let logit_rows = if plan.logits { rows } else { 0 };
        activation_bytes(rows, logit_rows, plan.taps.len(), dims, self.dtype.size_in_bytes())
    }

    /// The device paged pool every sequence's cache is on, and their block tables (`None`:
    /// contiguous caches, attended per sequence); a forward mixing the two is refused.
    fn paged_pool<'c>(&self, caches: &'c [&mut KvCache]) -> Result<Option<PagedCaches<'c>>> {
        let blocks: Vec<_> = caches.iter().map(|cache| cache.device_blocks()).collect();
        if blocks.iter().all(Option::is_none) {
            return Ok(None);
        }
        let mixed = || Error::Internal("a forward mixes caches of one paged pool with others".into());
        let Some((pool, _)) = blocks[0] else { return Err(mixed()) };
        let mut tables = Vec::with_capacity(blocks.len());
        for entry in &blocks {
            match entry {
                Some((other, table)) if Arc::ptr_eq(pool, other) => tables.push(*table),
                _ => return Err(mixed()),
            }
        }
        Ok(Some((Arc::clone(pool), tables)))
    }

    /// Each captured step's buffer address (tests of static buffers).
    #[cfg(test)]
    pub(crate) fn graph_buffer_addresses(&self) -> Vec<usize> {
        self.step_graphs.buffer_addresses()
    }

    /// Pads paged steps to the captured shapes (`step_shape.rs`) when `on`; batches past the
    /// largest shape run as they are.
    pub(crate) fn pad_steps_to_shapes(&self, on: bool) {
        self.pad_steps.store(on, std::sync::atomic::Ordering::Relaxed);
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

    fn step_weight_bytes(&self) -> usize {
        self.step_weight_bytes
    }

    fn kv_read_bytes(&self, context: usize) -> usize {
        self.config.kv_read_bytes(context, self.dtype.size_in_bytes())
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

    fn new_paged_pool(&self, block_size: usize, num_blocks: usize) -> Result<Arc<PagedPool>> {
        let i = &self.info;
        PagedPool::on_device(
            i.num_layers,
            i.num_kv_heads * i.head_dim,
            block_size,
            num_blocks,
            self.dtype,
            &self.device,
        )
    }

    fn capture_steps(&self, mode: GraphMode, budget_bytes: usize) {
        self.step_graphs.set(mode, budget_bytes);
        self.pad_steps_to_shapes(mode != GraphMode::Off);
    }

    fn step_graph_status(&self) -> Option<GraphStatus> {
        Some(self.step_graphs.status())
    }

    fn forward_batch(&self, batch: &ForwardBatch, caches: &mut [&mut KvCache]) -> Result<ForwardOutput> {
        self.forward_layers(batch, caches)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        check_token_ids(tokens, self.config.vocab_size)?;
        let ids = upload(tokens, &self.device)?;
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

    /// `tiny` with widths K-quants can pack (multiples of 256).
    fn k_quant_sized() -> LlamaConfig {
        LlamaConfig::from_json(
            r#"{"vocab_size": 97, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
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

    /// A step reads every weight but the embedding table (the random model's head is its own
    /// matrix), and its KV: keys and values of every layer, a sliding layer's up to its window.
    #[test]
    fn a_step_reads_the_weights_but_the_embedding_and_its_kv() {
        let config = tiny();
        let model = Decoder::random(&config, 3, WeightFormat::Dense(DType::BF16), &Device::Cpu).unwrap();
        let (h, v) = (config.hidden_size, config.vocab_size);
        // The random model's weight_bytes counts its matrices; a step also reads 7 norms of
        // [hidden] (2 per layer and the final one).
        assert_eq!(model.step_weight_bytes(), model.weight_bytes() - v * h * 2 + 7 * h * 2);
        // 3 layers x (k + v) x 2 kv heads x head_dim 8 x 2 bytes per position.
        let row = 3 * 2 * 2 * 8 * 2;
        assert_eq!(model.kv_read_bytes(40), 40 * row);
        assert_eq!(model.step_read_bytes(40), model.step_weight_bytes() + 40 * row);
        let mut sliding = model.config.clone();
        (sliding.sliding_window, sliding.sliding_layers) = (Some(4), vec![true, false, true]);
        assert_eq!(sliding.kv_read_bytes(40, 2), (4 + 40 + 4) * row / 3);
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

    /// Quantized q/k/v and gate/up load as one stacked tensor each where their GGML type allows
    /// (Q5_K runs on candle's kernels here, which read it in place; Q8_0 and Q4_K may be
    /// repacked into tiles for specrs' own, which stack only where they are not), and every
    /// logit is the separate projections', bitwise.
    #[test]
    fn quantized_projections_stack_and_score_as_separate_ones() {
        let config = k_quant_sized();
        let tokens: Vec<u32> = (0..9u32).map(|i| (i * 31 + 3) % 97).collect();
        for q in [GgmlDType::Q5K, GgmlDType::Q8_0, GgmlDType::Q4K] {
            let load = |stack: bool| {
                STACK_PROJECTIONS.with(|s| s.set(stack));
                let model = Decoder::random(&config, 13, WeightFormat::Quantized(q), &Device::Cpu).unwrap();
                STACK_PROJECTIONS.with(|s| s.set(true));
                let logits = model.forward(&tokens, &mut model.new_cache(9).unwrap()).unwrap();
                let fused = matches!(model.blocks[0].qkv, Projections::Fused { .. })
                    && matches!(model.blocks[0].gate_up, Projections::Fused { .. });
                (logits.flatten_all().unwrap().to_vec1::<f32>().unwrap(), fused, model.weight_bytes())
            };
            let (stacked, fused, bytes) = load(true);
            let (separate, unfused, separate_bytes) = load(false);
            assert!(!unfused, "{q:?}");
            if q == GgmlDType::Q5K {
                assert!(fused, "Q5_K's projections stack");
            }
            assert_eq!(stacked, separate, "{q:?}: stacked projections score as separate ones");
            assert_eq!(bytes, separate_bytes, "{q:?}");
        }
    }

    /// Quantizing bands of rows at once gives candle's whole-tensor quantization, byte for byte.
    #[test]
    fn rows_quantized_in_parallel_are_the_whole_tensors_quantization() {
        for (q, rows, cols) in [(GgmlDType::Q4K, 37, 512), (GgmlDType::Q8_0, 5, 64), (GgmlDType::Q6K, 1, 256)] {
            let src = random::uniform((rows, cols), 1.0, 3, 1, DType::F32, &Device::Cpu).unwrap();
            let whole = QTensor::quantize(&src, q).unwrap();
            let parallel = quantize_rows_in_parallel(&src, q, &Device::Cpu).unwrap();
            assert_eq!(parallel.shape(), whole.shape());
            assert_eq!(parallel.data().unwrap(), whole.data().unwrap(), "{q:?} [{rows}, {cols}]");
        }
    }

    /// The CUDA path's dtypes for quantized weights, run on the CPU: bf16 activations, norms and
    /// KV over Q5_K (candle's kernels, through f32 here) and Q8_0 (specrs' own) weights. The
    /// logits track the f32-activation model's to bf16's precision, and split forwards over the
    /// cache score as one forward does.
    #[test]
    fn bf16_activations_over_quantized_weights_track_f32() {
        let config = k_quant_sized();
        let tokens: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % 97).collect();
        for q in [GgmlDType::Q5K, GgmlDType::Q8_0] {
            let load = |bf16: bool| {
                QUANTIZED_BF16.with(|b| b.set(bf16));
                let model = Decoder::random(&config, 17, WeightFormat::Quantized(q), &Device::Cpu).unwrap();
                QUANTIZED_BF16.with(|b| b.set(false));
                model
            };
            let (rounded, exact) = (load(true), load(false));
            assert_eq!(rounded.dtype, DType::BF16);
            assert_eq!(rounded.blocks[0].attn_norm.dtype(), DType::BF16);
            let logits = |m: &Decoder| m.forward(&tokens, &mut m.new_cache(12).unwrap()).unwrap();
            let f32_logits = logits(&exact);
            let scale = f32_logits.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let diff = max_abs_diff(&f32_logits, &logits(&rounded));
            assert!(diff < 0.1 * scale, "{q:?}: max |difference| {diff} at logit scale {scale}");
            check_cached_steps_match_one_forward(&rounded);
        }
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
}
