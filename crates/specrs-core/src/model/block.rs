//! One decoder block for both backends: the weights a block holds (`Block`), how one input's
//! projections are held (`Projections`), and `load_block`, the one place that walks a block's
//! roles (`layout.rs`) and decides which weights a family requires. Each backend brings a
//! `BlockReader` (its linear and vector types and how it reads a tensor: GGUF on the CPU, GGUF,
//! HF directories and seeded random weights in candle); the forwards stay per backend, since
//! their kernels differ.
//!
//! Invariant: every backend's block of a model holds the same weights, read by the same names
//! with the same requiredness, so the backends cannot run different models from one file.

use super::config::DecoderConfig;
use super::layout::{block_tensor, block_weight, projections, Family, Naming, Projection, Role};
use crate::error::Result;

/// A decoder block's weights: `L` is the backend's linear layer, `V` its norm vector.
pub struct Block<L, V> {
    /// `[hidden]`
    pub attn_norm: V,
    /// q, k, v.
    pub qkv: Projections<L>,
    /// `[head_dim]`, the per-head RMSNorm of q and k before the rotation: Qwen3, Gemma 3.
    pub q_norm: Option<V>,
    pub k_norm: Option<V>,
    /// `[hidden, num_heads * head_dim]`
    pub wo: L,
    /// `[hidden]`, after attention, before the residual: Gemma 3's sandwich.
    pub post_attn_norm: Option<V>,
    /// `[hidden]`
    pub ffn_norm: V,
    /// gate, up.
    pub gate_up: Projections<L>,
    /// `[hidden, intermediate]`
    pub w_down: L,
    /// `[hidden]`, after the MLP, before the residual: Gemma 3's sandwich.
    pub post_ffn_norm: Option<V>,
}

/// Projections of one input: separate matrices, or one matrix whose output rows are cut into
/// `widths` (stored fused, as Phi-3's q/k/v and gate/up are, or stacked at load by a backend).
pub enum Projections<L> {
    Separate(Vec<L>),
    Fused { linear: L, widths: Vec<usize> },
}

/// When the loader reads a weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The family requires it: a file without it is an error, not another model.
    Required,
    /// Read when the file holds it.
    IfStored,
    /// Not read: the family has no such weight, and in this format its name may be another's.
    Never,
}

impl Need {
    /// Whether to read a weight the file holds (`stored`) or does not hold.
    pub fn reads(self, stored: bool) -> bool {
        match self {
            Need::Required => true,
            Need::IfStored => stored,
            Need::Never => false,
        }
    }
}

/// How one backend reads one format's tensors. Shapes are the config's: a reader checks them
/// (HF directories) or relies on a check made before (GGUF files, `gguf_layout.rs`).
pub trait BlockReader {
    type Linear;
    type Vector;

    /// Whether the file holds tensor `name`.
    fn has(&self, name: &str) -> bool;

    /// `{tensor}.weight` `[rows, cols]`, and `{tensor}.bias` `[rows]` when `bias` reads it.
    fn linear(&mut self, tensor: &str, rows: usize, cols: usize, bias: Need) -> Result<Self::Linear>;

    /// A norm weight `name` `[len]`.
    fn norm(&mut self, name: &str, len: usize) -> Result<Self::Vector>;

    /// A per-head q/k norm weight `name` `[head_dim]`: `norm`, unless the backend holds these
    /// in another dtype than the block's other norms.
    fn head_norm(&mut self, name: &str, len: usize) -> Result<Self::Vector> {
        self.norm(name, len)
    }

    /// One input's separately stored projections as the backend runs them: separate, unless it
    /// stacks them into one matmul (candle, for dense weights).
    fn separate(&mut self, linears: Vec<Self::Linear>) -> Result<Projections<Self::Linear>> {
        Ok(Projections::Separate(linears))
    }
}

/// Block `layer` of a model with `config`, its tensors named by `naming`.
pub fn load_block<R: BlockReader>(
    reader: &mut R,
    naming: Naming,
    config: &DecoderConfig,
    layer: usize,
) -> Result<Block<R::Linear, R::Vector>> {
    let c = config;
    let family = Family::of(c);
    let t = |role| block_tensor(naming, &family, layer, role);
    let tw = |role| block_weight(naming, &family, layer, role);
    let (hidden, q_width) = (c.hidden_size, c.num_heads * c.head_dim);
    // As in gguf_layout.rs (which has already refused a GGUF file without them): Qwen2 needs its
    // q/k/v biases, Qwen3 and Gemma 3 their q/k norms, Gemma 3 its sandwich norms. Another
    // family's GGUF file may hold sandwich norms (gguf_layout.rs lets it) and runs with them; in
    // an HF directory another family has none, and transformers names its ffn norm
    // `post_attention_layernorm`, the sandwich's post-attention name.
    let if_family = |required: bool| if required { Need::Required } else { Need::IfStored };
    let sandwich = match naming {
        Naming::Hf if !family.sandwich_norms => Need::Never,
        _ => if_family(family.sandwich_norms),
    };
    let (qkv, gate_up) = projections(naming, c, layer, |name| reader.has(name));
    // The read order is the forward's: `Decoder::random` draws its weights in it.
    Ok(Block {
        attn_norm: reader.norm(&tw(Role::AttnNorm), hidden)?,
        qkv: load_projections(reader, qkv, hidden, if_family(family.qkv_bias))?,
        q_norm: read_norm(reader, &tw(Role::QNorm), c.head_dim, if_family(family.qk_norm), R::head_norm)?,
        k_norm: read_norm(reader, &tw(Role::KNorm), c.head_dim, if_family(family.qk_norm), R::head_norm)?,
        wo: reader.linear(&t(Role::AttnOutput), hidden, q_width, Need::IfStored)?,
        post_attn_norm: read_norm(reader, &tw(Role::PostAttnNorm), hidden, sandwich, R::norm)?,
        ffn_norm: reader.norm(&tw(Role::FfnNorm), hidden)?,
        gate_up: load_projections(reader, gate_up, hidden, Need::IfStored)?,
        w_down: reader.linear(&t(Role::Down), hidden, c.intermediate_size, Need::IfStored)?,
        post_ffn_norm: read_norm(reader, &tw(Role::PostFfnNorm), hidden, sandwich, R::norm)?,
    })
}

/// `read(reader, name, len)` when `need` reads it.
fn read_norm<R: BlockReader>(
    reader: &mut R,
    name: &str,
    len: usize,
    need: Need,
    read: fn(&mut R, &str, usize) -> Result<R::Vector>,
) -> Result<Option<R::Vector>> {
    if need.reads(reader.has(name)) {
        read(reader, name, len).map(Some)
    } else {
        Ok(None)
    }
}

/// The projections `stored` of one `[.., cols]` input; `separate_bias` says when the separate
/// matrices' biases are read (a fused matrix's bias is read when stored).
fn load_projections<R: BlockReader>(
    reader: &mut R,
    stored: Projection,
    cols: usize,
    separate_bias: Need,
) -> Result<Projections<R::Linear>> {
    match stored {
        Projection::Fused { tensor, widths } => {
            let linear = reader.linear(&tensor, widths.iter().sum(), cols, Need::IfStored)?;
            Ok(Projections::Fused { linear, widths })
        }
        Projection::Separate { tensors, widths } => {
            let linears = tensors
                .iter()
                .zip(&widths)
                .map(|(tensor, &rows)| reader.linear(tensor, rows, cols, separate_bias))
                .collect::<Result<Vec<_>>>()?;
            reader.separate(linears)
        }
    }
}
