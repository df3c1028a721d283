//! Grouped-query attention in candle ops, f32, for the candle decoder and the heads' own layers
//! (`proposer/heads/layer.rs`): causal attention over a chain of new rows after a cache, and
//! tree attention, where each row sees a list of key cells (the cache's past and its own path).
//!
//! Invariant: a tree row gathers exactly the keys it sees, in position order, and runs as the
//! last row of a chain over them, so it computes what its path run as a chain computes for its
//! last row (bitwise on the CPU, where a multi-row chain also runs one query row at a time).

use candle_core::Tensor;
use candle_nn::ops::softmax_last_dim;

use crate::error::{Error, Result};

/// cap * tanh(x / cap).
pub(crate) fn softcap(x: &Tensor, cap: f32) -> Result<Tensor> {
    Ok(((x / cap as f64)?.tanh()? * cap as f64)?)
}

/// How attention scores are formed: `scale * q·k`, soft-capped, within a window of keys.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scores {
    pub scale: f32,
    pub logit_softcap: Option<f32>,
    /// Keys a query sees, itself included.
    pub window: Option<usize>,
}

impl Scores {
    /// `scale * q·k`, no soft-cap, no window (the heads' layers).
    pub fn plain(scale: f32) -> Self {
        Self { scale, logit_softcap: None, window: None }
    }
}

/// Tree attention: row i of `q` (`[num_heads, n, head_dim]`) sees the cells `sees[i]` of `k`, `v`
/// (`[num_kv_heads, cells, head_dim]`): in position order, its own cell last. Returns `[n,
/// num_heads * head_dim]`. Each row gathers exactly the keys it sees and runs as the last row of
/// a chain over them (see the module invariant); a window counts the gathered keys, which are
/// the positions of the row's path.
pub(crate) fn tree_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sees: &[Vec<usize>],
    scores: Scores,
) -> Result<Tensor> {
    // The cache views are strided (a prefix of each layer's buffer); gathers need them whole.
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let rows = sees
        .iter()
        .enumerate()
        .map(|(i, cells)| {
            let Some(own) = cells.len().checked_sub(1) else {
                return Err(Error::Internal(format!("tree attention: row {i} sees no key, not even its own")));
            };
            let cells: Vec<u32> = cells.iter().map(|&c| c as u32).collect();
            let cells = Tensor::new(cells.as_slice(), q.device())?;
            let (k, v) = (k.index_select(&cells, 1)?, v.index_select(&cells, 1)?); // [kv_heads, own + 1, hd]
            attention(&q.narrow(1, i, 1)?, &k, &v, own, scores)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&rows, 0)?)
}

/// Plain causal attention (no window, no soft-cap) for the heads' own layers; the shapes are
/// `attention`'s.
pub(crate) fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scale: f32) -> Result<Tensor> {
    attention(q, k, v, past, Scores::plain(scale))
}

/// Grouped-query attention in f32 where every row of `q` (`[num_heads, n, head_dim]`) sees every
/// key of `k`, `v` (`[num_kv_heads, total, head_dim]`), no mask: a DFlash block's rows, which
/// attend to the context and to each other both ways. Returns `[n, num_heads * head_dim]`.
pub(crate) fn full_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    let (num_heads, n, head_dim) = q.dims3()?;
    let num_kv_heads = k.dim(0)?;
    let q = q.reshape((num_kv_heads, (num_heads / num_kv_heads) * n, head_dim))?;
    let scores = (q.matmul(&k.t()?)? * scale as f64)?; // [kv_heads, groups * n, total]
    let out = softmax_last_dim(&scores)?.matmul(&v.contiguous()?)?; // [kv_heads, groups * n, head_dim]
    Ok(out.reshape((num_heads, n, head_dim))?.transpose(0, 1)?.reshape((n, num_heads * head_dim))?)
}

/// Causal grouped-query attention in f32. `q`: `[num_heads, n, head_dim]` for positions
/// `past..past + n`; `k`, `v`: `[num_kv_heads, past + n, head_dim]`. Returns `[n, num_heads *
/// head_dim]`. Query heads sharing a kv head are folded into its rows, so keys and values are
/// read once per kv head and never repeated. With a `window`, the query at position p sees keys
/// p - window + 1..=p; keys no query of this step sees are not read at all.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, past: usize, scores_of: Scores) -> Result<Tensor> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

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

    /// Tree rows that see a chain's cells compute the chain's rows bitwise (on the CPU), and a
    /// row that skips a cell computes what the chain without it computes.
    #[test]
    fn tree_rows_compute_their_paths_as_chains() {
        let device = Device::Cpu;
        // 4 query heads on 2 kv heads, head dim 8; 3 cached cells and 3 new rows.
        let (past, n) = (3, 3);
        let q = Tensor::randn(0f32, 1.0, (4, n, 8), &device).unwrap();
        let k = Tensor::randn(0f32, 1.0, (2, past + n, 8), &device).unwrap();
        let v = Tensor::randn(0f32, 1.0, (2, past + n, 8), &device).unwrap();
        let chain = causal_attention(&q, &k, &v, past, 0.5).unwrap(); // [n, 32]
        let sees: Vec<Vec<usize>> = (0..n).map(|i| (0..past + i + 1).collect()).collect();
        let tree = tree_attention(&q, &k, &v, &sees, Scores::plain(0.5)).unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&chain), bits(&tree));

        // The last row sees the past and itself only: new row 2 on a chain of cells 0, 1, 2, 5.
        let sees = [vec![0, 1, 2, past + 2]];
        let skip = tree_attention(&q.narrow(1, 2, 1).unwrap(), &k, &v, &sees, Scores::plain(0.5)).unwrap();
        let cells = Tensor::new(&[0u32, 1, 2, 5], &device).unwrap();
        let (k_path, v_path) = (k.index_select(&cells, 1).unwrap(), v.index_select(&cells, 1).unwrap());
        let path = causal_attention(&q.narrow(1, 2, 1).unwrap(), &k_path, &v_path, past, 0.5).unwrap();
        assert_eq!(bits(&skip), bits(&path));
    }
}
