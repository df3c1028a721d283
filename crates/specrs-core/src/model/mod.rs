//! Target and draft models: the `CausalLm` trait and one file per architecture family.
//!
//! Two implementations of one block with per-family flags (`families.rs`): `cpu_decoder.rs`, GGUF
//! files on the CPU with llama.cpp's numerics and bitwise row independence (hand-written AVX2
//! kernels), and `decoder.rs`, in candle ops on any device: HF safetensors directories, seeded
//! random models, and everything on CUDA. `load` picks.
//!
//! Invariant: `forward` scores EVERY new token (verification needs the logits of all k+1
//! positions from one pass) and leaves the cache holding exactly the old positions plus the new
//! ones; the caller rolls back with `KvCache::truncate`.

pub mod attention;
pub mod cpu_decoder;
pub mod decoder;
pub mod families;
pub mod ggml_math;
pub(crate) mod gguf_layout;
pub mod hf_dir;
pub mod kquants;
pub mod llama_config;
pub mod parallel;
pub mod qlinear;
pub mod random;
pub mod rope;

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;
use decoder::DecoderConfig;
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
}

/// Which positions of a forward get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Every new position: verification.
    All,
    /// Only the last new position: prefill and plain decoding (skips the LM head elsewhere).
    Last,
}

pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;

    fn device(&self) -> &Device;

    /// Bytes of weights held in memory.
    fn weight_bytes(&self) -> usize;

    /// A cache for one sequence with `capacity` positions allocated up front.
    fn new_cache(&self, capacity: usize) -> Result<KvCache>;

    /// Consumes `tokens` (new tokens only; their positions continue from `cache.len()`) and
    /// returns logits `[num_rows, vocab_size]`, where `num_rows` is `tokens.len()` for
    /// `LogitRows::All` and 1 for `LogitRows::Last`.
    fn forward_rows(&self, tokens: &[u32], cache: &mut KvCache, rows: LogitRows) -> Result<Tensor>;

    /// Early exit (the layer-skip draft): only the first `num_layers` blocks, then the final norm
    /// and the LM head. Keys and values are written to layers `0..num_layers` only; the positions
    /// still count in `cache.len()`, so the caller truncates them away before a full forward.
    /// Because every block is row-independent, those layers' entries equal what a full forward
    /// writes for the same tokens.
    fn forward_early_exit(
        &self,
        _tokens: &[u32],
        _cache: &mut KvCache,
        _num_layers: usize,
        _rows: LogitRows,
    ) -> Result<Tensor> {
        Err(Error::config(format!(
            "the {} model does not support early exit; use another speculative method than 'layer_skip'",
            self.info().architecture
        )))
    }

    /// Logits `[tokens.len(), vocab_size]` for every new position.
    fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        self.forward_rows(tokens, cache, LogitRows::All)
    }
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

    /// `read(self, name)` when the file has a tensor `name` (biases, the norms some families add).
    pub fn optional<T>(&mut self, name: &str, read: fn(&mut Self, &str) -> Result<T>) -> Result<Option<T>> {
        if self.gguf.has_tensor(name) {
            read(self, name).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Refuses token ids outside the vocabulary before they index the embedding table (out of range
/// on the CPU, undefined on a GPU). Every entry point checks its ids; this is the last guard, for
/// ids that reach a model another way (a draft model with a smaller vocabulary than its target's).
pub(crate) fn check_token_ids(tokens: &[u32], vocab_size: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab_size) {
        None => Ok(()),
        Some(bad) => Err(Error::config(format!(
            "token id {bad} is outside the model's vocabulary (size {vocab_size}); pass ids below {vocab_size}"
        ))),
    }
}

/// `forward_early_exit`'s bound: at least one block, at most all `num_blocks`.
pub(crate) fn check_exit_layer(num_layers: usize, num_blocks: usize) -> Result<()> {
    if num_layers == 0 || num_layers > num_blocks {
        return Err(Error::config(format!("exit_layer must be in 1..={num_blocks} for this model (got {num_layers})")));
    }
    Ok(())
}

/// Architectures `load` accepts, for error messages.
pub const SUPPORTED_ARCHITECTURES: &str =
    "llama (SmolLM2, Llama 2/3, Mistral), qwen2 (Qwen2/2.5), qwen3, gemma3 and phi3 (GGUF general.architecture)";

/// Opens a GGUF file and builds the model its `general.architecture` names.
pub fn load(gguf: &mut GgufFile, device: &Device) -> Result<Box<dyn CausalLm>> {
    let architecture = gguf.get_str("general.architecture")?.to_string();
    if !families::GGUF_ARCHITECTURES.contains(&architecture.as_str()) {
        return Err(Error::model_load(format!(
            "{}: unsupported architecture '{architecture}'; specrs runs {SUPPORTED_ARCHITECTURES}",
            gguf.path.display()
        )));
    }
    let config = families::from_gguf(gguf, &architecture)?;
    if device.is_cpu() && cpu_decoder::CpuDecoder::runs(&config) {
        return Ok(Box::new(cpu_decoder::CpuDecoder::load(gguf, config)?));
    }
    Ok(Box::new(decoder::Decoder::from_gguf(gguf, config, device)?))
}
