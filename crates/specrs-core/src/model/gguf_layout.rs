//! The tensors a GGUF model must hold (and the ones it may hold) for its `DecoderConfig`, with the
//! shape the config implies for each: the one shape check both GGUF decoders (`cpu/decoder.rs`,
//! `candle/decoder.rs`) go through, through `GgufWeights`.
//!
//! Names come from `layout.rs`; shapes follow llama.cpp's loader (`llama-model.cpp`) for these
//! families, in candle's order (rows first: a `[out_features, in_features]` matrix is GGUF's `{in, out}`). Qwen2's q/k/v
//! biases, Qwen3's q/k norms and Gemma 3's q/k and sandwich norms are required, as llama.cpp
//! requires them: a file without them would run as another model, not fail.
//!
//! Invariant: `GgufLayout::check` succeeds only when every required tensor of every layer exists,
//! every tensor of the layout that the file holds has exactly its expected shape, and the file
//! holds no block at or past `block_count`; it reads no tensor data, so a malformed file is refused
//! before any weight is loaded or any kernel runs. `GgufWeights` reads only tensors listed here.

use std::collections::HashMap;

use super::config::DecoderConfig;
use super::layout::{block_tensor, block_weight, global_weight, Family, Global, Naming, Role};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Every tensor name a decoder may read, with its expected shape.
pub(crate) struct GgufLayout {
    expected: HashMap<String, Vec<usize>>,
}

impl GgufLayout {
    /// The expected shape of `name`, or None when no decoder reads a tensor of that name.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.expected.get(name).map(Vec::as_slice)
    }

    /// Checks `gguf`'s tensors against `config` (see the module invariant).
    pub fn check(gguf: &GgufFile, config: &DecoderConfig) -> Result<Self> {
        let mut b = Builder { gguf, config, expected: HashMap::new() };
        let c = config;
        let (vocab, hidden, ffn) = (c.vocab_size, c.hidden_size, c.intermediate_size);
        // `families::validate` bounds every size by MAX_SIZE (2^24), so these products fit.
        let (q_width, kv_width) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let family = Family::of(c);
        let global = |g| global_weight(Naming::Gguf, g);
        b.tensor(&global(Global::Embedding), vec![vocab, hidden], "[vocabulary, embedding_length]", true)?;
        let untied = !c.tie_word_embeddings;
        b.tensor(&global(Global::Output), vec![vocab, hidden], "[vocabulary, embedding_length]", untied)?;
        b.tensor(&global(Global::FinalNorm), vec![hidden], "[embedding_length]", true)?;
        b.tensor("rope_freqs.weight", vec![c.rope_dims / 2], "[rope.dimension_count / 2]", false)?;
        for i in 0..c.num_layers {
            let t = |role| block_tensor(Naming::Gguf, &family, i, role);
            let tw = |role| block_weight(Naming::Gguf, &family, i, role);
            b.tensor(&tw(Role::AttnNorm), vec![hidden], "[embedding_length]", true)?;
            if gguf.has_tensor(&tw(Role::Qkv)) {
                let width = q_width + 2 * kv_width;
                b.linear(&t(Role::Qkv), width, hidden, "(head_count + 2 head_count_kv) x key_length", false)?;
            } else {
                let bias = family.qkv_bias;
                b.linear(&t(Role::Q), q_width, hidden, "head_count x key_length", bias)?;
                b.linear(&t(Role::K), kv_width, hidden, "head_count_kv x key_length", bias)?;
                b.linear(&t(Role::V), kv_width, hidden, "head_count_kv x key_length", bias)?;
            }
            let qk_norm = family.qk_norm;
            b.tensor(&tw(Role::QNorm), vec![c.head_dim], "[key_length]", qk_norm)?;
            b.tensor(&tw(Role::KNorm), vec![c.head_dim], "[key_length]", qk_norm)?;
            b.tensor(
                &tw(Role::AttnOutput),
                vec![hidden, q_width],
                "[embedding_length, head_count x key_length]",
                true,
            )?;
            b.tensor(&format!("{}.bias", t(Role::AttnOutput)), vec![hidden], "[embedding_length]", false)?;
            let sandwich = family.sandwich_norms;
            b.tensor(&tw(Role::PostAttnNorm), vec![hidden], "[embedding_length]", sandwich)?;
            b.tensor(&tw(Role::FfnNorm), vec![hidden], "[embedding_length]", true)?;
            if gguf.has_tensor(&tw(Role::Gate)) {
                b.linear(&t(Role::Gate), ffn, hidden, "feed_forward_length", false)?;
                b.linear(&t(Role::Up), ffn, hidden, "feed_forward_length", false)?;
            } else {
                // Phi-3: gate and up in one matrix of twice the width.
                b.linear(&t(Role::GateUp), 2 * ffn, hidden, "2 x feed_forward_length (fused gate and up)", false)?;
            }
            b.tensor(&tw(Role::Down), vec![hidden, ffn], "[embedding_length, feed_forward_length]", true)?;
            b.tensor(&format!("{}.bias", t(Role::Down)), vec![hidden], "[embedding_length]", false)?;
            b.tensor(&tw(Role::PostFfnNorm), vec![hidden], "[embedding_length]", sandwich)?;
        }
        b.no_extra_blocks()?;
        Ok(GgufLayout { expected: b.expected })
    }
}

struct Builder<'a> {
    gguf: &'a GgufFile,
    config: &'a DecoderConfig,
    expected: HashMap<String, Vec<usize>>,
}

impl Builder<'_> {
    fn path(&self) -> String {
        self.gguf.path.display().to_string()
    }

    /// `{name}.weight` `[rows, cols]` (rows described by `rows_are`), and `{name}.bias` `[rows]`,
    /// required when `bias_required`.
    fn linear(&mut self, name: &str, rows: usize, cols: usize, rows_are: &str, bias_required: bool) -> Result<()> {
        self.tensor(&format!("{name}.weight"), vec![rows, cols], &format!("[{rows_are}, embedding_length]"), true)?;
        self.tensor(&format!("{name}.bias"), vec![rows], &format!("[{rows_are}]"), bias_required)
    }

    /// Lists `name` with shape `want` (`formula` says which metadata gives it); checks the file's.
    fn tensor(&mut self, name: &str, want: Vec<usize>, formula: &str, required: bool) -> Result<()> {
        match self.gguf.tensor_dims(name) {
            None if required => {
                return Err(Error::model_load(format!(
                    "{} has no tensor '{name}', which a {} model with {} layers needs; the file is incomplete \
                     or was written for another architecture: re-convert the model with llama.cpp's \
                     convert_hf_to_gguf.py",
                    self.path(),
                    self.config.architecture,
                    self.config.num_layers
                )))
            }
            Some(got) if got != want => {
                return Err(Error::model_load(format!(
                    "{}: tensor '{name}' has shape {got:?}, but the metadata implies {want:?} ({formula}); the \
                     tensor or the metadata is corrupt, or they belong to different models: re-convert the \
                     model with llama.cpp's convert_hf_to_gguf.py",
                    self.path()
                )))
            }
            _ => {}
        }
        self.expected.insert(name.to_string(), want);
        Ok(())
    }

    /// A tensor of block `i >= block_count` means the metadata undercounts the layers, and the
    /// model would silently run without them.
    fn no_extra_blocks(&self) -> Result<()> {
        let beyond = self
            .gguf
            .tensor_names()
            .into_iter()
            .filter_map(|name| {
                let layer: usize = name.strip_prefix("blk.")?.split('.').next()?.parse().ok()?;
                (layer >= self.config.num_layers).then_some(name)
            })
            .min();
        match beyond {
            None => Ok(()),
            Some(name) => Err(Error::model_load(format!(
                "{}: tensor '{name}' belongs to a layer past the {} that metadata '{}.block_count' gives; the \
                 metadata is corrupt: re-convert the model with llama.cpp's convert_hf_to_gguf.py",
                self.path(),
                self.config.num_layers,
                self.config.architecture
            ))),
        }
    }
}
