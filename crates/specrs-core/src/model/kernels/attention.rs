//! Causal grouped-query attention over the f16 KV cache, on the CPU, row by row, optionally
//! within a sliding window.
//!
//! Invariant: a query row's output depends only on that row and the cached keys/values at
//! positions up to its own, summed in a fixed order. A token therefore gets bitwise the same
//! result whether it is decoded alone or inside a k+1-token verification pass.
//!
//! Why not candle's matmul + softmax: its matmul blocks differently for 1 and for n rows, and the
//! resulting ~1e-6 differences are not harmless here. Every quantized matmul rounds its input
//! activations to int8, so a tiny difference can flip a rounding step; on SmolLM2 that moved
//! logits by up to ~1.0 and flipped greedy tokens between batched and single-token forwards (the
//! same effect makes llama.cpp's batched verification diverge from its plain decoding).
//!
//! Precision and order: keys/values are f16, the query and probabilities f32. Each score sums
//! value d into lane d % 8 with fused multiply-adds and reduces the lanes in one fixed tree,
//! 8 keys at a time (the tree is the same for each); the softmax is normalized in f32
//! (sum in f64, 8 cells at a time from cell 0, masked cells zero); each output dimension is one
//! fused-multiply-add chain over the cells in order, kept in registers. None of this depends on
//! the other rows of the forward.

use half::f16;

use super::ggml_math::{hsum8, hsum8_of};
use super::parallel::for_each_chunk_mut;
use super::{kernels, reference, KernelSet};
use crate::error::{Error, Result};
use crate::kv_cache::Slots;

#[derive(Debug, Clone, Copy)]
pub struct HeadShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct Attention {
    pub shape: HeadShape,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Keys a query sees, itself included (sliding-window layers).
    pub window: Option<usize>,
}

/// What one query row sees of its sequence's layer cache `kv` (rows of `kv_heads * head_dim`,
/// addressed through its slots): cells `0..prefix` in place, then the cells at slots `extra` (a
/// tree node's ancestors after the cache, itself last). Cell `j` of that list is position `j`: it keeps that
/// index in every summation order, wherever its slot is, so a tree node sums exactly as its
/// root-to-node path run as a chain. The query's own position is the last cell's.
#[derive(Debug, Clone, Copy)]
pub struct RowView<'a> {
    pub kv: &'a Slots<'a>,
    pub prefix: usize,
    pub extra: &'a [usize],
}

impl RowView<'_> {
    fn num_cells(&self) -> usize {
        self.prefix + self.extra.len()
    }

    /// The slot of cell `j`.
    #[inline]
    fn slot(&self, j: usize) -> usize {
        if j < self.prefix {
            j
        } else {
            self.extra[j - self.prefix]
        }
    }
}

/// The value rows one query row attends, cell by cell: cell `j`'s row is `len` values at
/// `offset` of cache row `view.slot(first + j)` (rows `stride` apart). What a set's
/// `weighted_sum` reads.
pub struct ValueRows<'a> {
    pub view: &'a RowView<'a>,
    pub first: usize,
    pub stride: usize,
    pub offset: usize,
    pub len: usize,
}

impl<'a> ValueRows<'a> {
    #[inline]
    pub fn row(&self, j: usize) -> &'a [f16] {
        &self.view.kv.values_from(self.view.slot(self.first + j), self.stride)[self.offset..][..self.len]
    }

    /// Cells `j..` whose rows lie `stride` apart in one run (cells held in place, to the end of
    /// their run: one buffer, or one block): cell j's row from `offset` on, to the run's end, and
    /// how many cells the run holds (at least 1; an extra cell is a run of its own). A kernel
    /// resolves a slot per run instead of per row, which a paged cache's block lookup needs.
    #[inline]
    pub fn run(&self, j: usize) -> (&'a [f16], usize) {
        let cell = self.first + j;
        let slot = self.view.slot(cell);
        let cells = if cell < self.view.prefix { (self.view.prefix - cell).min(self.view.kv.run_len(slot)) } else { 1 };
        (&self.view.kv.values_from(slot, self.stride)[self.offset..], cells)
    }
}

impl Attention {
    /// `q`: `[n, heads * head_dim]` (rotated) for positions `past..past + n` of one chain; `k`,
    /// `v`: the layer's cache `[>= past + n, kv_heads * head_dim]` holding those positions.
    /// Returns `[n, heads * head_dim]`.
    pub fn forward<'a>(&self, q: &[f32], k: &'a [f16], v: &'a [f16], past: usize) -> Result<Vec<f32>> {
        let q_width = self.shape.num_heads * self.shape.head_dim;
        let n = q.len().checked_div(q_width).unwrap_or(0);
        let kv = Slots::Identity { k, v };
        let rows: Vec<RowView> = (0..n).map(|i| RowView { kv: &kv, prefix: past + i + 1, extra: &[] }).collect();
        self.forward_rows(q, &rows)
    }

    /// `q`: `[rows.len(), heads * head_dim]` (rotated), row i seeing what `rows[i]` says (rows
    /// may belong to different sequences and caches). Returns `[rows.len(), heads * head_dim]`.
    /// The views are checked here, before the SIMD kernels index the caches unchecked.
    pub fn forward_rows<'a>(&self, q: &[f32], rows: &[RowView<'a>]) -> Result<Vec<f32>> {
        self.forward_rows_with(kernels(), q, rows)
    }

    /// `forward_rows` on `set`, a set this CPU runs (`available_sets`).
    pub fn forward_rows_with<'a>(&self, set: &KernelSet, q: &[f32], rows: &[RowView<'a>]) -> Result<Vec<f32>> {
        let HeadShape { num_heads, num_kv_heads, head_dim } = self.shape;
        let kv_dim = num_kv_heads * head_dim;
        let q_width = num_heads * head_dim;
        if q_width == 0
            || num_kv_heads == 0
            || !num_heads.is_multiple_of(num_kv_heads)
            || q.len() != rows.len() * q_width
        {
            return Err(Error::Internal(format!(
                "attention: {} query values for {} rows of {num_heads} heads of {head_dim} sharing {num_kv_heads} kv heads",
                q.len(),
                rows.len()
            )));
        }
        for row in rows {
            let last_slot = row.extra.iter().copied().max().unwrap_or(0).max(row.prefix);
            let needed = if row.extra.is_empty() { row.prefix } else { last_slot + 1 };
            let (num_keys, num_values) = row.kv.num_values();
            if row.num_cells() == 0 || num_keys < needed * kv_dim || num_values < needed * kv_dim {
                return Err(Error::Internal(format!(
                    "attention: the cache holds {num_keys} keys and {num_values} values, fewer than {needed} positions of {kv_dim}",
                )));
            }
        }
        let group = num_heads / num_kv_heads;
        // The sets' vector kernels take whole 8-lane vectors; other head sizes run the reference.
        let vector = if head_dim.is_multiple_of(8) { set } else { &reference::KERNELS };
        let mut out = vec![0f32; q.len()];
        // One work item per (row, head): `head_dim` outputs.
        for_each_chunk_mut(&mut out, head_dim, |item, out| {
            let (i, head) = (item / num_heads, item % num_heads);
            let view = &rows[i];
            let kv_off = (head / group) * head_dim;
            let query = &q[item * head_dim..(item + 1) * head_dim];
            let pos = view.num_cells() - 1;
            let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            // Cells before `first` are masked: zero after the exponential, so they change no sum
            // and are skipped, but cells keep their index for the summation order.
            let mut weights = vec![0f32; pos + 1 - first];
            // The cells held in place are runs of rows `kv_dim` apart (one, or one per block; each
            // key's score is the same whatever run it is computed in); the extra ones one each.
            let in_place = view.prefix.saturating_sub(first).min(weights.len());
            // SAFETY: the set runs on this CPU; the cache holds rows first..prefix and every
            // extra slot (checked above), and `vector` takes this head size.
            unsafe {
                let mut j = 0;
                while j < in_place {
                    let run = view.kv.run_len(first + j).min(in_place - j);
                    (vector.scaled_dots)(
                        query,
                        &view.kv.keys_from(first + j, kv_dim)[kv_off..],
                        kv_dim,
                        self.scale,
                        &mut weights[j..j + run],
                    );
                    j += run;
                }
                for j in in_place..weights.len() {
                    let slot = view.slot(first + j);
                    (vector.scaled_dots)(
                        query,
                        &view.kv.keys_from(slot, kv_dim)[kv_off..],
                        kv_dim,
                        self.scale,
                        &mut weights[j..j + 1],
                    );
                }
            }
            let max = weights.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            // SAFETY: the set runs on this CPU.
            unsafe { (set.softmax_exps)(&mut weights, max) };
            // llama.cpp sums the row 8 cells at a time from cell 0; whole masked chunks add 0, and
            // the first visible cell sits `lead` cells into its chunk.
            let lead = first % 8;
            let head = weights.len().min(8 - lead);
            let first_chunk = hsum8_of(|c| if c < lead { 0.0 } else { weights.get(c - lead).copied().unwrap_or(0.0) });
            let total = weights[head..].chunks(8).fold(first_chunk as f64, |sum, c| sum + hsum8(c) as f64);
            let inv = (1.0 / total) as f32;
            for w in weights.iter_mut() {
                *w *= inv;
            }
            let values = ValueRows { view, first, stride: kv_dim, offset: kv_off, len: head_dim };
            // SAFETY: the set runs on this CPU; every value row holds `head_dim` values (the views
            // were checked), and `vector` takes this head size.
            unsafe { (vector.weighted_sum)(&values, &weights, out) };
        });
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0) - 0.5)
            .collect()
    }

    fn to_f16(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }

    fn attention(shape: HeadShape, window: Option<usize>) -> Attention {
        Attention { shape, scale: 1.0 / (shape.head_dim as f32).sqrt(), window }
    }

    #[test]
    fn batched_rows_equal_single_rows_bitwise() {
        for (head_dim, window, n) in
            (1..=17).flat_map(|n| [(8, None, n), (32, Some(3), n), (64, None, n), (72, Some(9), n)])
        {
            let shape = HeadShape { num_heads: 4, num_kv_heads: 2, head_dim };
            let (past, q_width, kv_width) = (3 + n % 5, 4 * head_dim, 2 * head_dim);
            let attn = attention(shape, window);
            let q = pseudo_random(n * q_width, 1);
            let k = to_f16(&pseudo_random((past + n) * kv_width, 2));
            let v = to_f16(&pseudo_random((past + n) * kv_width, 3));
            let batched = attn.forward(&q, &k, &v, past).unwrap();
            for i in 0..n {
                let single = attn.forward(&q[i * q_width..(i + 1) * q_width], &k, &v, past + i).unwrap();
                assert_eq!(&batched[i * q_width..(i + 1) * q_width], &single[..], "head_dim {head_dim}");
            }
        }
    }

    /// Against a plain softmax attention over exactly the keys in the window.
    #[test]
    fn matches_a_plain_softmax_attention() {
        for (head_dim, window) in [(8, None), (32, None), (64, Some(2))] {
            let shape = HeadShape { num_heads: 2, num_kv_heads: 1, head_dim };
            let past = 2;
            let q = pseudo_random(2 * head_dim, 4);
            let (k, v) = (to_f16(&pseudo_random(3 * head_dim, 5)), to_f16(&pseudo_random(3 * head_dim, 6)));
            let out = attention(shape, window).forward(&q, &k, &v, past).unwrap();
            let first = window.map_or(0, |w| past + 1 - w);
            for h in 0..2 {
                let qh = &q[h * head_dim..(h + 1) * head_dim];
                let s: Vec<f32> = (first..=past)
                    .map(|j| {
                        (0..head_dim).map(|d| qh[d] * k[j * head_dim + d].to_f32()).sum::<f32>()
                            / (head_dim as f32).sqrt()
                    })
                    .collect();
                let z: f32 = s.iter().map(|x| x.exp()).sum();
                for d in 0..head_dim {
                    let want: f32 = (first..=past).map(|j| s[j - first].exp() / z * v[j * head_dim + d].to_f32()).sum();
                    let got = out[h * head_dim + d];
                    assert!((got - want).abs() < 2e-3, "head_dim {head_dim}: {got} vs {want}");
                }
            }
        }
    }

    /// A cache shorter than the positions the query needs, or a query that is not whole rows, is
    /// an error before the kernels read the cache unchecked.
    #[test]
    fn short_cache_or_partial_query_is_an_error() {
        let shape = HeadShape { num_heads: 2, num_kv_heads: 1, head_dim: 32 };
        let attn = attention(shape, None);
        let (q, cache) = (pseudo_random(2 * 64, 1), to_f16(&pseudo_random(3 * 32, 2)));
        assert!(attn.forward(&q, &cache, &cache, 1).is_ok()); // positions 1, 2 of 3
        assert!(attn.forward(&q, &cache, &cache, 2).unwrap_err().to_string().contains("fewer than 4 positions"));
        assert!(attn.forward(&q[..100], &cache, &cache, 0).unwrap_err().to_string().contains("100 query values"));
    }

    /// Every set's dots equal the scalar reference bitwise.
    #[test]
    fn every_sets_dots_equal_the_reference() {
        let (head_dim, rows) = (64, 5);
        let query = pseudo_random(head_dim, 7);
        let keys = to_f16(&pseudo_random(rows * head_dim, 8));
        for set in crate::model::kernels::available_sets() {
            let mut out = vec![0f32; rows];
            // SAFETY: the set runs on this CPU; `keys` holds `rows` rows of `head_dim`.
            unsafe { (set.scaled_dots)(&query, &keys, head_dim, 0.5, &mut out) };
            for (j, s) in out.iter().enumerate() {
                assert_eq!(*s, reference::dot(&keys[j * head_dim..(j + 1) * head_dim], &query) * 0.5, "{}", set.name);
            }
        }
    }
}
