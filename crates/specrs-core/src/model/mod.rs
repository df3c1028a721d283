//! Target and draft models: the `CausalLm` trait and one file per architecture family.
//!
//! Two backends of one block, reading one description of each family (`config.rs` for the sizes
//! and flags `families.rs` reads from GGUF keys and HF configs, `layout.rs` for the tensor names
//! and the family's required weights): `cpu/`, GGUF files on the CPU with bitwise row
//! independence, and `candle/`, in candle ops on any device: HF safetensors directories, seeded
//! random models, and everything on CUDA. `loader.rs` picks. The block's weights and their one
//! loader are shared (`block.rs`: each backend reads tensors into its own types); its forward is
//! each backend's. Neither backend imports the other's files: the CPU kernels both use (quantized
//! matmuls, attention, ggml's math) are in `kernels/`, the rotary embedding in `rope.rs`.
//!
//! The contract is `CausalLm::forward_batch` (`forward.rs`): many sequences, chains or token
//! trees, explicit positions, logits for the rows asked for and hidden states at taps; the
//! single-sequence calls (`forward_rows`, `forward_early_exit`) are built on it.
//!
//! Invariant: a forward scores every row it is asked to (verification needs the logits of all
//! k+1 positions from one pass) and leaves each cache holding exactly its old positions plus the
//! new ones; the caller rolls back with `KvCache::truncate` (a chain) or `KvCache::keep` (the
//! accepted path of a tree).

pub(crate) mod block;
pub mod candle;
pub mod config;
pub mod cpu;
pub mod families;
pub mod forward;
pub(crate) mod gguf_layout;
pub mod hf_dir;
pub mod kernels;
pub mod layout;
pub mod llama_config;
pub mod loader;
pub mod random;
pub mod rope;

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::{KvCache, PagedPool};
use block::Need;
pub use candle::step_graphs::{EagerReason, GraphMode, GraphStatus};
pub use config::DecoderConfig;
use forward::check_token_ids;
pub use forward::{Carried, CarriedWords, ForwardBatch, ForwardOutput, LogitRows, SeqRows, Tap};
use gguf_layout::GgufLayout;

/// Shape facts every caller needs (cache sizing, context checks, vocabulary size).
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub architecture: String,
    pub vocab_size: usize,
    pub context_length: usize,
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Width of the hidden states the taps return.
    pub hidden_size: usize,
    /// What the model multiplies its embedding rows by before the first block (Gemma:
    /// sqrt(hidden_size)); `CausalLm::embed` returns them unscaled.
    pub embed_scale: Option<f32>,
    /// The kernels its forward runs on: the CPU kernel set's name (`kernels::KernelSet::name`)
    /// for models on the CPU, "cuda" on a GPU. What the measured costs depend on.
    pub kernels: &'static str,
}

impl ModelInfo {
    pub fn of(config: &DecoderConfig, kernels: &'static str) -> Self {
        Self {
            architecture: config.architecture.clone(),
            vocab_size: config.vocab_size,
            context_length: config.context_length,
            num_layers: config.num_layers,
            num_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            hidden_size: config.hidden_size,
            embed_scale: config.embed_scale,
            kernels,
        }
    }
}

pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;

    fn device(&self) -> &Device;

    /// Bytes of weights held in memory.
    fn weight_bytes(&self) -> usize;

    /// Bytes of weights one single-row step reads: every matrix, norm and the LM head, not the
    /// embedding table (one row of it is gathered; a tied table is read whole as the LM head).
    fn step_weight_bytes(&self) -> usize;

    /// Bytes of KV cache one single-row step reads at `context` positions (keys and values of
    /// every layer; a sliding-window layer reads its window).
    fn kv_read_bytes(&self, context: usize) -> usize;

    /// Bytes one single-row decode step reads at `context` positions: its weights and its KV
    /// cache. Over the device's read bandwidth (`bandwidth::read_bandwidth`) it is the step's bound.
    fn step_read_bytes(&self, context: usize) -> usize {
        self.step_weight_bytes() + self.kv_read_bytes(context)
    }

    /// A cache for one sequence with `capacity` positions allocated up front.
    fn new_cache(&self, capacity: usize) -> Result<KvCache>;

    /// A pool of `num_blocks` blocks of `block_size` positions for this model's paged caches
    /// (`KvCache::paged`), where `new_cache` keeps its rows: f16 on the host, or tensors in the
    /// model's dtype on its device.
    fn new_paged_pool(&self, block_size: usize, num_blocks: usize) -> Result<Arc<PagedPool>>;

    /// The contract (`forward.rs`): one forward over `batch`'s sequences, `caches[s]` holding
    /// sequence `s`'s past. Every new row is appended to its cache; logits come back for
    /// `batch.logit_rows`, hidden states for `batch.taps`.
    fn forward_batch(&self, batch: &ForwardBatch, caches: &mut [&mut KvCache]) -> Result<ForwardOutput>;

    /// Captures this model's paged steps in `mode` (CUDA graphs) within `budget_bytes`
    /// (`candle/step_graphs.rs`); a model that captures nothing (the CPU decoder) runs eagerly.
    fn capture_steps(&self, _mode: GraphMode, _budget_bytes: usize) {}

    /// Where this model's captured steps stand; None for a model that captures none.
    fn step_graph_status(&self) -> Option<GraphStatus> {
        None
    }

    /// The token embedding rows `[tokens.len(), hidden_size]` f32, shared with heads (EAGLE's
    /// input). Unscaled: `ModelInfo::embed_scale` says what the model itself multiplies by.
    fn embed(&self, tokens: &[u32]) -> Result<Tensor>;

    /// The LM head (with the final soft-cap where the family has one) on final-normed hidden
    /// rows `[n, hidden_size]`: logits `[n, vocab_size]`, or `[n, subset.len()]` for the
    /// vocabulary rows `vocab_subset` (a draft vocabulary). `lm_head` of the `FinalNorm` tap
    /// equals the forward's logits.
    fn lm_head(&self, hidden: &Tensor, vocab_subset: Option<&[u32]>) -> Result<Tensor>;

    /// One sequence's `tokens` as a chain after `cache` (positions from `cache.len()`): logits
    /// `[num_rows, vocab_size]`, `num_rows` being `tokens.len()` for `LogitRows::All`, 1 for
    /// `Last`, 0 for `None`.
    fn forward_rows(&self, tokens: &[u32], cache: &mut KvCache, rows: LogitRows) -> Result<Tensor> {
        let batch = ForwardBatch::chain(tokens, cache.len(), rows)?;
        Ok(self.forward_batch(&batch, &mut [cache])?.logits)
    }

    /// Early exit (the layer-skip draft): only the first `num_layers` blocks, then the final norm
    /// and the LM head. Keys and values are written to layers `0..num_layers` only; the positions
    /// still count in `cache.len()`, so the caller truncates them away before a full forward.
    /// Because every block is row-independent, those layers' entries equal what a full forward
    /// writes for the same tokens.
    fn forward_early_exit(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        num_layers: usize,
        rows: LogitRows,
    ) -> Result<Tensor> {
        let mut batch = ForwardBatch::chain(tokens, cache.len(), rows)?;
        batch.exit_layer = Some(num_layers);
        Ok(self.forward_batch(&batch, &mut [cache])?.logits)
    }

    /// Logits `[tokens.len(), vocab_size]` for every new position.
    fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        self.forward_rows(tokens, cache, LogitRows::All)
    }
}

/// Keeps `logits`' columns `vocab_subset` (`[n, vocab]` -> `[n, subset.len()]`), each id checked.
pub(crate) fn select_vocab(logits: Tensor, vocab_subset: Option<&[u32]>, vocab_size: usize) -> Result<Tensor> {
    let Some(subset) = vocab_subset else { return Ok(logits) };
    check_token_ids(subset, vocab_size)?;
    let ids = Tensor::new(subset, logits.device())?;
    Ok(logits.index_select(&ids, 1)?)
}

/// Reads a GGUF file's tensors by name onto a device and counts the bytes loaded; each model
/// file adds the typed readers it needs. Built only after `GgufLayout::check` passed, so every
/// tensor of every layer has the shape the config implies before the first one is read.
pub(crate) struct GgufWeights<'a> {
    pub gguf: &'a mut GgufFile,
    layout: GgufLayout,
    pub device: &'a Device,
    pub num_bytes: usize,
}

impl<'a> GgufWeights<'a> {
    /// Checks every tensor `config` implies (`gguf_layout.rs`), then reads on demand.
    pub fn new(gguf: &'a mut GgufFile, config: &DecoderConfig, device: &'a Device) -> Result<Self> {
        let layout = GgufLayout::check(gguf, config)?;
        Ok(Self { gguf, layout, device, num_bytes: 0 })
    }

    pub fn qtensor(&mut self, name: &str) -> Result<Arc<QTensor>> {
        let Some(want) = self.layout.shape(name) else {
            return Err(Error::Internal(format!(
                "a decoder read tensor '{name}', which gguf_layout.rs does not check"
            )));
        };
        let t = self.gguf.tensor(name, self.device)?;
        if t.shape().dims() != want {
            return Err(Error::model_load(format!(
                "{}: tensor '{name}' was read with shape {:?}, expected {want:?}; the file is corrupt, fetch it again",
                self.gguf.path.display(),
                t.shape().dims()
            )));
        }
        self.num_bytes += t.storage_size_in_bytes();
        Ok(Arc::new(t))
    }

    /// `read(self, name)` when `need` reads tensor `name` (biases, the norms some families add).
    pub fn read_if<T>(&mut self, need: Need, name: &str, read: fn(&mut Self, &str) -> Result<T>) -> Result<Option<T>> {
        if need.reads(self.gguf.has_tensor(name)) {
            read(self, name).map(Some)
        } else {
            Ok(None)
        }
    }
}
