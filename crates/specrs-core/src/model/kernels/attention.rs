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

use super::ggml_math::{hsum8, hsum8_of, softmax_exps};
use super::parallel::for_each_chunk_mut;
use crate::error::{Error, Result};

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

/// What one query row sees of its sequence's layer cache `k`, `v` (`[capacity, kv_heads *
/// head_dim]`): cells `0..prefix` in place, then the cells at slots `extra` (a tree node's
/// ancestors after the cache, itself last). Cell `j` of that list is position `j`: it keeps that
/// index in every summation order, wherever its slot is, so a tree node sums exactly as its
/// root-to-node path run as a chain. The query's own position is the last cell's.
#[derive(Debug, Clone, Copy)]
pub struct RowView<'a> {
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub prefix: usize,
    pub extra: &'a [usize],
}

impl RowView<'_> {
    fn num_cells(&self) -> usize {
        self.prefix + self.extra.len()
    }

    /// The slot of cell `j`.
    fn slot(&self, j: usize) -> usize {
        if j < self.prefix {
            j
        } else {
            self.extra[j - self.prefix]
        }
    }
}

impl Attention {
    /// `q`: `[n, heads * head_dim]` (rotated) for positions `past..past + n` of one chain; `k`,
    /// `v`: the layer's cache `[>= past + n, kv_heads * head_dim]` holding those positions.
    /// Returns `[n, heads * head_dim]`.
    pub fn forward<'a>(&self, q: &[f32], k: &'a [f16], v: &'a [f16], past: usize) -> Result<Vec<f32>> {
        let q_width = self.shape.num_heads * self.shape.head_dim;
        let n = q.len().checked_div(q_width).unwrap_or(0);
        let rows: Vec<RowView> = (0..n).map(|i| RowView { k, v, prefix: past + i + 1, extra: &[] }).collect();
        self.forward_rows(q, &rows)
    }

    /// `q`: `[rows.len(), heads * head_dim]` (rotated), row i seeing what `rows[i]` says (rows
    /// may belong to different sequences and caches). Returns `[rows.len(), heads * head_dim]`.
    /// The views are checked here, before the SIMD kernels index the caches unchecked.
    pub fn forward_rows<'a>(&self, q: &[f32], rows: &[RowView<'a>]) -> Result<Vec<f32>> {
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
            if row.num_cells() == 0 || row.k.len() < needed * kv_dim || row.v.len() < needed * kv_dim {
                return Err(Error::Internal(format!(
                    "attention: the cache holds {} keys and {} values, fewer than {needed} positions of {kv_dim}",
                    row.k.len(),
                    row.v.len(),
                )));
            }
        }
        let group = num_heads / num_kv_heads;
        let simd = simd_available();
        let mut out = vec![0f32; q.len()];
        // One work item per (row, head): `head_dim` outputs.
        for_each_chunk_mut(&mut out, head_dim, |item, out| {
            let (i, head) = (item / num_heads, item % num_heads);
            let view = &rows[i];
            let (k, v) = (view.k, view.v);
            let kv_off = (head / group) * head_dim;
            let query = &q[item * head_dim..(item + 1) * head_dim];
            let pos = view.num_cells() - 1;
            let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            // Cells before `first` are masked: zero after the exponential, so they change no sum
            // and are skipped, but cells keep their index for the summation order.
            let row =
                |cache: &'a [f16], j: usize| -> &'a [f16] { &cache[view.slot(j) * kv_dim + kv_off..][..head_dim] };
            let mut weights = vec![0f32; pos + 1 - first];
            // The cells held in place are one run of rows `kv_dim` apart; the extra ones one each.
            let in_place = view.prefix.saturating_sub(first).min(weights.len());
            if simd && head_dim % 8 == 0 {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: features detected; the cache holds rows first..prefix and every extra
                // slot (checked above).
                unsafe {
                    simd::scaled_dots(
                        query,
                        &k[first * kv_dim + kv_off..],
                        kv_dim,
                        self.scale,
                        &mut weights[..in_place],
                    );
                    for j in in_place..weights.len() {
                        let slot = view.slot(first + j);
                        simd::scaled_dots(
                            query,
                            &k[slot * kv_dim + kv_off..],
                            kv_dim,
                            self.scale,
                            &mut weights[j..j + 1],
                        );
                    }
                };
            } else {
                for (j, w) in weights.iter_mut().enumerate() {
                    *w = dot(row(k, first + j), query) * self.scale;
                }
            }
            let max = weights.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            softmax_exps(&mut weights, max);
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
            weighted_sum(simd, |j| row(v, first + j), &weights, out);
        });
        Ok(out)
    }
}

/// out[d] = Σ_j probs[j] * values[j][d], one fused multiply-add chain per output in cell order
/// (so a tree node, whose cells are its path's, sums exactly as that path run as a chain).
fn weighted_sum<'a>(simd: bool, value: impl Fn(usize) -> &'a [f16], probs: &[f32], out: &mut [f32]) {
    if simd && out.len().is_multiple_of(8) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2, FMA and F16C were detected; every value row holds `out.len()` values
        // (the caller's views were checked).
        unsafe {
            simd::weighted_sum(value, probs, out)
        };
        return;
    }
    out.fill(0.0);
    for (j, &p) in probs.iter().enumerate() {
        for (o, x) in out.iter_mut().zip(value(j)) {
            *o = x.to_f32().mul_add(p, *o);
        }
    }
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Σ a[d] * b[d]: value d into lane d % 8 with fused multiply-adds, the lanes reduced as
/// `reduce_lanes`, then any tail (lengths not a multiple of 8) added in order. The scalar twin of
/// `simd::scaled_dots`, used where that kernel cannot run.
fn dot(a: &[f16], b: &[f32]) -> f32 {
    let full = a.len() / 8 * 8;
    let mut lanes = [0f32; 8];
    for (i, (x, y)) in a[..full].iter().zip(&b[..full]).enumerate() {
        lanes[i % 8] = x.to_f32().mul_add(*y, lanes[i % 8]);
    }
    let mut sum = reduce_lanes(&lanes);
    for (x, y) in a[full..].iter().zip(&b[full..]) {
        sum = x.to_f32().mul_add(*y, sum);
    }
    sum
}

/// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
fn reduce_lanes(l: &[f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use half::f16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// out[j] = dot(keys row j, query) * scale for every j, as `super::dot` sums it, 8 keys at a
    /// time (their 8-lane partial sums reduced together). `keys` starts at the head's offset of
    /// the first row; rows are `stride` apart; `query.len()` is a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scaled_dots(query: &[f32], keys: &[f16], stride: usize, scale: f32, out: &mut [f32]) {
        let head_dim = query.len();
        // The loads below are unchecked: every row read must lie inside `keys`.
        assert!(
            head_dim.is_multiple_of(8) && (out.is_empty() || keys.len() >= (out.len() - 1) * stride + head_dim),
            "scaled_dots: {} keys for {} rows {stride} apart of {head_dim}",
            keys.len(),
            out.len()
        );
        let q = query.as_ptr();
        let scale = _mm256_set1_ps(scale);
        for (chunk, out) in out.chunks_mut(8).enumerate() {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (j, acc) in acc.iter_mut().enumerate().take(out.len()) {
                unsafe {
                    let key = keys.as_ptr().add((8 * chunk + j) * stride);
                    for d in (0..head_dim).step_by(8) {
                        *acc = _mm256_fmadd_ps(load8(key.add(d)), _mm256_loadu_ps(q.add(d)), *acc);
                    }
                }
            }
            let sums = _mm256_mul_ps(reduce_8x8(acc), scale);
            let mut all = [0f32; 8];
            unsafe { _mm256_storeu_ps(all.as_mut_ptr(), sums) };
            out.copy_from_slice(&all[..out.len()]);
        }
    }

    /// Lane j = ((v_j[0] + v_j[1]) + (v_j[2] + v_j[3])) + ((v_j[4] + v_j[5]) + (v_j[6] + v_j[7])),
    /// the same tree for every j (`super::reduce_lanes`).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce_8x8(v: [__m256; 8]) -> __m256 {
        let t0 = _mm256_hadd_ps(v[0], v[1]);
        let t1 = _mm256_hadd_ps(v[2], v[3]);
        let t2 = _mm256_hadd_ps(v[4], v[5]);
        let t3 = _mm256_hadd_ps(v[6], v[7]);
        let u0 = _mm256_hadd_ps(t0, t1); // keys 0..3: low half lanes 0-3 sums, high half lanes 4-7
        let u1 = _mm256_hadd_ps(t2, t3);
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(u0, u1), _mm256_permute2f128_ps::<0x31>(u0, u1))
    }

    /// `super::weighted_sum` with 8-lane vectors: up to 64 outputs stay in registers while the
    /// value rows stream past. `out.len()` is a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum<'a>(value: impl Fn(usize) -> &'a [f16], probs: &[f32], out: &mut [f32]) {
        let head_dim = out.len();
        assert!(head_dim.is_multiple_of(8), "weighted_sum: {head_dim} outputs");
        let mut d0 = 0;
        while d0 < head_dim {
            unsafe {
                if head_dim - d0 >= 64 {
                    chunk::<8>(&value, probs, d0, out);
                    d0 += 64;
                } else {
                    chunk::<1>(&value, probs, d0, out);
                    d0 += 8;
                }
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn chunk<'a, const L: usize>(
        value: &impl Fn(usize) -> &'a [f16],
        probs: &[f32],
        d0: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); L];
        for (j, &p) in probs.iter().enumerate() {
            let row = value(j);
            assert!(row.len() >= d0 + 8 * L, "weighted_sum: a value row of {} values", row.len());
            let pv = _mm256_set1_ps(p);
            for (l, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(unsafe { load8(row.as_ptr().add(d0 + 8 * l)) }, pv, *acc);
            }
        }
        for (l, acc) in acc.iter().enumerate() {
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(d0 + 8 * l), *acc) };
        }
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

    /// The SIMD dot equals the scalar reference bitwise.
    #[test]
    fn simd_dots_equal_the_reference() {
        if !simd_available() {
            return;
        }
        let (head_dim, rows) = (64, 5);
        let query = pseudo_random(head_dim, 7);
        let keys = to_f16(&pseudo_random(rows * head_dim, 8));
        let mut simd_out = vec![0f32; rows];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: features checked; `keys` holds `rows` rows of `head_dim`.
        unsafe {
            simd::scaled_dots(&query, &keys, head_dim, 0.5, &mut simd_out)
        };
        for (j, s) in simd_out.iter().enumerate() {
            assert_eq!(*s, dot(&keys[j * head_dim..(j + 1) * head_dim], &query) * 0.5);
        }
    }
}
