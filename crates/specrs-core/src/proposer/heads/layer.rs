//! One decoder layer in candle ops with its own KV cache: the transformer block of the EAGLE,
//! EAGLE-3 and MTP heads (a Llama block: attention with RoPE and grouped-query heads, q/k biases
//! (Qwen2) and per-head q/k norms (Qwen3) where the checkpoint has them, then a SiLU-gated MLP,
//! each added to the residual).
//!
//! The caller forms the attention input and the residual, because that is where the heads differ:
//! EAGLE-1 feeds its `fc` output unnormed to both, EAGLE-3 feeds
//! `[input_norm(embedding); hidden_norm(fc out)]` (2H wide) to attention and the fc output to the
//! residual, MTP feeds `input_norm(x)` and `x`. The post-attention norm, the MLP and both residual
//! additions are the layer's.
//!
//! Rows come as a chain after the cache, or as token-tree rows (`TreeRows`: EAGLE-2's batched draft
//! steps), where each row attends to the context rows of the cache, its own ancestors' rows and
//! itself only. Both run on the candle decoder's attention (`model/candle/attention.rs`): a tree
//! row gathers the keys it sees and runs as the last row of a chain over them, so it computes
//! what a chain run of its path computes for its last row (bitwise on the CPU; on a GPU, where a
//! chain's rows run as one matmul, up to its rounding).
//!
//! DFlash's layers use the same weights two other ways: context rows only write their keys and
//! values (`append_context`), and a block's rows attend to the cache and to each other without
//! being written (`forward_block`).
//!
//! Invariant: `forward` appends exactly its rows to the cache, after the rows it held, so
//! `KvCache::truncate` rolls drafts back; `forward_block` leaves the cache as it was.

use candle_core::{DType, Device, Tensor};
use candle_nn::ops::rms_norm;
use candle_nn::rotary_emb::{rope, rope_i};

use super::weights::{HeadWeights, Linear};
use crate::error::{Error, Result};
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::candle::attention::{causal_attention, full_attention, tree_attention, Scores};
use crate::model::rope::{Pairing, Rope};
use std::sync::Arc;

/// The sizes and flags of a head's decoder layer.
#[derive(Debug, Clone)]
pub struct LayerShape {
    pub hidden_size: usize,
    /// Width of the attention input: `hidden_size`, or `2 * hidden_size` for EAGLE-3.
    pub attn_input_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// GGUF llama heads were converted with q/k permuted for interleaved pairs.
    pub rope_pairing: Pairing,
    /// Longest context the head's cache may hold.
    pub max_positions: usize,
}

/// Tensor names of one layer (HF style by default; `gguf` for llama.cpp's).
pub struct LayerNames {
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    pub q_norm: String,
    pub k_norm: String,
    pub post_attention_norm: String,
    pub gate: String,
    pub up: String,
    pub down: String,
}

impl LayerNames {
    /// transformers' names under `prefix` (e.g. "layers.0", "midlayer", "model.layers.30").
    pub fn hf(prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}.{s}");
        Self {
            q: n("self_attn.q_proj"),
            k: n("self_attn.k_proj"),
            v: n("self_attn.v_proj"),
            o: n("self_attn.o_proj"),
            q_norm: n("self_attn.q_norm.weight"),
            k_norm: n("self_attn.k_norm.weight"),
            post_attention_norm: n("post_attention_layernorm.weight"),
            gate: n("mlp.gate_proj"),
            up: n("mlp.up_proj"),
            down: n("mlp.down_proj"),
        }
    }

    /// llama.cpp's names under `prefix` (e.g. "blk.0").
    pub fn gguf(prefix: &str) -> Self {
        let n = |s: &str| format!("{prefix}.{s}");
        Self {
            q: n("attn_q"),
            k: n("attn_k"),
            v: n("attn_v"),
            o: n("attn_output"),
            q_norm: n("attn_q_norm.weight"),
            k_norm: n("attn_k_norm.weight"),
            post_attention_norm: n("ffn_norm.weight"),
            gate: n("ffn_gate"),
            up: n("ffn_up"),
            down: n("ffn_down"),
        }
    }
}

/// Where a forward's new rows sit, and what each attends to.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// A chain from this position: each row sees every row the cache held and its predecessors.
    Chain(usize),
    /// Token-tree rows.
    Tree(&'a TreeRows<'a>),
}

/// Token-tree rows drafted inside a head's cache: new row i sees the cache's first `context` rows
/// (the context positions), the rows `ancestors[i]` (the draft rows of its own path) and itself;
/// not the other draft rows the cache holds, not the other new rows.
#[derive(Debug, Clone, Copy)]
pub struct TreeRows<'a> {
    pub context: usize,
    /// `[n]` each new row's position.
    pub positions: &'a [usize],
    /// `[n]` each new row's ancestors' cache rows, increasing, in `context..` and before the new
    /// rows.
    pub ancestors: &'a [Vec<usize>],
}

impl Rows<'_> {
    /// Positions of the `n` new rows.
    pub fn positions(&self, n: usize) -> Vec<usize> {
        match self {
            Rows::Chain(first) => (*first..first + n).collect(),
            Rows::Tree(tree) => tree.positions.to_vec(),
        }
    }
}

impl TreeRows<'_> {
    /// Per new row, the cache rows it sees, in position order: the context rows, its ancestors'
    /// rows and its own (`past + i` in a cache that held `past` rows before these `n`).
    fn key_cells(&self, n: usize, past: usize) -> Result<Vec<Vec<usize>>> {
        if self.positions.len() != n || self.ancestors.len() != n || self.context > past {
            return Err(Error::Internal(format!(
                "tree rows: {n} rows with {} positions and {} ancestor lists over {} context rows of {past}",
                self.positions.len(),
                self.ancestors.len(),
                self.context
            )));
        }
        self.ancestors
            .iter()
            .enumerate()
            .map(|(i, ancestors)| {
                if ancestors.windows(2).any(|w| w[0] >= w[1])
                    || ancestors.iter().any(|&a| a < self.context || a >= past)
                {
                    return Err(Error::Internal(format!(
                        "tree row {i}: ancestor rows {ancestors:?} must increase within {}..{past}",
                        self.context
                    )));
                }
                Ok((0..self.context).chain(ancestors.iter().copied()).chain([past + i]).collect())
            })
            .collect()
    }
}

pub struct HeadLayer {
    shape: LayerShape,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3-style per-head RMSNorm of q and k before the rotation, `[head_dim]` each.
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// `[hidden_size]`
    post_attention_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
    rope: Rope,
    device: Device,
}

impl HeadLayer {
    /// How many weights one row through the layer multiplies (its linear layers').
    pub fn num_weights(&self) -> usize {
        [&self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down].iter().map(|l| l.num_weights()).sum()
    }

    /// How many weights a row's keys and values multiply (`append_context`'s).
    pub fn num_kv_weights(&self) -> usize {
        self.k.num_weights() + self.v.num_weights()
    }

    pub fn load(w: &mut HeadWeights, names: &LayerNames, shape: LayerShape) -> Result<Self> {
        let s = &shape;
        let (q_width, kv_width) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        Ok(Self {
            q: w.linear(&names.q, q_width, s.attn_input_size)?,
            k: w.linear(&names.k, kv_width, s.attn_input_size)?,
            v: w.linear(&names.v, kv_width, s.attn_input_size)?,
            o: w.linear(&names.o, s.hidden_size, q_width)?,
            q_norm: w.optional(&names.q_norm, &[s.head_dim])?,
            k_norm: w.optional(&names.k_norm, &[s.head_dim])?,
            post_attention_norm: w.tensor(&names.post_attention_norm, &[s.hidden_size])?,
            gate: w.linear(&names.gate, s.intermediate_size, s.hidden_size)?,
            up: w.linear(&names.up, s.intermediate_size, s.hidden_size)?,
            down: w.linear(&names.down, s.hidden_size, s.intermediate_size)?,
            rope: Rope::new(s.head_dim, s.rope_theta, 1.0, None, shape.rope_pairing),
            device: w.device().clone(),
            shape,
        })
    }

    pub fn shape(&self) -> &LayerShape {
        &self.shape
    }

    /// A cache for this layer holding up to `capacity` positions at first.
    pub fn new_cache(&self, capacity: usize, kv_bytes: &Arc<KvBytes>) -> Result<KvCache> {
        let s = &self.shape;
        let cache =
            KvCache::on_device(1, s.num_kv_heads, s.head_dim, capacity, s.max_positions, DType::F32, &self.device)?;
        Ok(cache.tracked_by(kv_bytes.clone()))
    }

    /// `attn_input` `[n, attn_input_size]`, `residual` `[n, hidden_size]`, both f32, at the
    /// positions `rows` gives: the layer's output `[n, hidden_size]` (residual stream after
    /// attention and MLP, before any final norm). Appends the n rows to `cache`; a chain row
    /// attends to every row the cache held before plus its predecessors, a tree row to what
    /// `TreeRows` says. Keys carry their own positions, so a cache may skip positions (MTP layers
    /// cycled over draft steps).
    pub fn forward(&self, attn_input: &Tensor, residual: &Tensor, cache: &mut KvCache, rows: Rows) -> Result<Tensor> {
        let n = attn_input.dim(0)?;
        let past = cache.len();
        cache.reserve(n)?;
        let rope = self.rope_tables(&rows.positions(n))?;
        let q =
            self.split_heads(self.q.forward(attn_input)?, self.shape.num_heads, self.q_norm.as_ref(), Some(&rope))?;
        let (k, v) = self.keys_values(attn_input, &rope)?;
        cache.append_tensors(0, &k, &v)?;
        let (k_all, v_all) = cache.layer_tensors(0, past + n)?; // [kv_heads, past + n, hd]
        let attn = match rows {
            Rows::Chain(_) => causal_attention(&q, &k_all, &v_all, past, self.scale())?, // [n, heads * hd]
            Rows::Tree(tree) => {
                tree_attention(&q, &k_all, &v_all, &tree.key_cells(n, past)?, Scores::plain(self.scale()))?
            }
        };
        cache.commit(n);
        self.finish(&attn, residual)
    }

    /// DFlash's context rows: the keys and values of `x` `[n, attn_input_size]` at positions
    /// `start..start + n`, appended to `cache`. They are never queries, so the rows run no
    /// attention and no MLP.
    pub fn append_context(&self, x: &Tensor, start: usize, cache: &mut KvCache) -> Result<()> {
        let n = x.dim(0)?;
        cache.reserve(n)?;
        let (k, v) = self.keys_values(x, &self.rope_tables(&(start..start + n).collect::<Vec<_>>())?)?;
        cache.append_tensors(0, &k, &v)?;
        cache.commit(n);
        Ok(())
    }

    /// DFlash's block: rows `attn_input` `[n, attn_input_size]` (residual `[n, hidden_size]`) at
    /// positions `first..first + n`, each attending to every row `cache` holds and to the block's
    /// rows: all of them, or (`causal`) those before it and itself. The output `[n, hidden_size]`
    /// as `forward`'s; the cache is only read.
    pub fn forward_block(
        &self,
        attn_input: &Tensor,
        residual: &Tensor,
        cache: &KvCache,
        first: usize,
        causal: bool,
    ) -> Result<Tensor> {
        let n = attn_input.dim(0)?;
        let past = cache.len();
        let rope = self.rope_tables(&(first..first + n).collect::<Vec<_>>())?;
        let q =
            self.split_heads(self.q.forward(attn_input)?, self.shape.num_heads, self.q_norm.as_ref(), Some(&rope))?;
        let (k, v) = self.keys_values(attn_input, &rope)?; // [kv_heads, n, hd]
        let (k_all, v_all) = if past == 0 {
            (k, v)
        } else {
            let (k_past, v_past) = cache.layer_tensors(0, past)?;
            (Tensor::cat(&[&k_past, &k], 1)?, Tensor::cat(&[&v_past, &v], 1)?) // [kv_heads, past + n, hd]
        };
        let attn = if causal {
            causal_attention(&q, &k_all, &v_all, past, self.scale())?
        } else {
            full_attention(&q, &k_all, &v_all, self.scale())?
        };
        self.finish(&attn, residual)
    }

    fn scale(&self) -> f32 {
        1.0 / (self.shape.head_dim as f32).sqrt()
    }

    /// RoPE's cos and sin `[n, head_dim / 2]` at `positions`.
    fn rope_tables(&self, positions: &[usize]) -> Result<(Tensor, Tensor)> {
        let (cos, sin) = self.rope.tables_at(positions);
        let shape = (positions.len(), self.shape.head_dim / 2);
        Ok((Tensor::from_vec(cos, shape, &self.device)?, Tensor::from_vec(sin, shape, &self.device)?))
    }

    /// `x` `[n, num_heads * head_dim]` as heads `[num_heads, n, head_dim]`, each RMS-normed by
    /// `norm` and rotated by `rotation` (RoPE's tables) where given.
    fn split_heads(
        &self,
        x: Tensor,
        num_heads: usize,
        norm: Option<&Tensor>,
        rotation: Option<&(Tensor, Tensor)>,
    ) -> Result<Tensor> {
        let s = &self.shape;
        let n = x.dim(0)?;
        let x = x.reshape((n, num_heads, s.head_dim))?.transpose(0, 1)?.contiguous()?; // [heads, n, hd]
        let x = match norm {
            Some(weight) => rms_norm(&x, weight, s.rms_eps)?,
            None => x,
        };
        let Some((cos, sin)) = rotation else { return Ok(x) };
        let x = x.unsqueeze(0)?;
        let rotated = match s.rope_pairing {
            Pairing::Interleaved => rope_i(&x, cos, sin)?,
            Pairing::Halves => rope(&x, cos, sin)?,
        };
        Ok(rotated.squeeze(0)?)
    }

    /// Rotated, normed keys and values `[num_kv_heads, n, head_dim]` of `x` `[n, attn_input_size]`.
    fn keys_values(&self, x: &Tensor, rope: &(Tensor, Tensor)) -> Result<(Tensor, Tensor)> {
        let kv_heads = self.shape.num_kv_heads;
        let k = self.split_heads(self.k.forward(x)?, kv_heads, self.k_norm.as_ref(), Some(rope))?;
        let v = self.split_heads(self.v.forward(x)?, kv_heads, None, None)?;
        Ok((k, v))
    }

    /// The rest of the layer after attention `[n, num_heads * head_dim]`: the output projection
    /// added to `residual`, then the post-attention norm and the MLP, added too.
    fn finish(&self, attn: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let x = (residual + self.o.forward(attn)?)?;
        let h = rms_norm(&x, &self.post_attention_norm, self.shape.rms_eps)?;
        let mlp = self.down.forward(&(self.gate.forward(&h)?.silu()? * self.up.forward(&h)?)?)?;
        Ok((x + mlp)?)
    }
}
