//! Rotary embeddings and causal grouped-query attention over the f16 KV cache, on the CPU, row by
//! row.
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
//! Precision and summation order follow llama.cpp's CPU path (no flash attention), so the two
//! agree bit for bit where they can: keys/values are f16, the query is rounded to f16 for the q·k
//! dot, the softmax is normalized in f32 (sum in f64), the probabilities are rounded to f16
//! before weighting the values, and both products sum in tinyBLAS's lane order (`STEP`).

use half::f16;

use super::ggml_math::softmax_exps;
use super::parallel::for_each_chunk_mut;

#[derive(Debug, Clone, Copy)]
pub struct HeadShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Rotary tables `[max_len, head_dim / 2]` computed as ggml does (angle advanced by repeated
/// multiplication in f32), optionally divided by per-dimension frequency factors.
pub fn rope_tables(head_dim: usize, base: f32, max_len: usize, freq_factors: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let theta_scale = base.powf(-2.0 / head_dim as f32);
    let mut cos = Vec::with_capacity(max_len * half);
    let mut sin = Vec::with_capacity(max_len * half);
    for pos in 0..max_len {
        let mut theta = pos as f32;
        for i in 0..half {
            let angle = theta / freq_factors.map_or(1.0, |ff| ff[i]);
            cos.push(angle.cos());
            sin.push(angle.sin());
            theta *= theta_scale;
        }
    }
    (cos, sin)
}

/// Interleaved (GGUF llama) rotary embedding in place. `x`: `[n, heads * head_dim]` for tokens at
/// positions `first_pos..first_pos + n`; `cos`, `sin`: `[max_len, head_dim / 2]`.
pub fn apply_rope(x: &mut [f32], heads: usize, head_dim: usize, first_pos: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for (i, row) in x.chunks_mut(heads * head_dim).enumerate() {
        let table = (first_pos + i) * half;
        let (cos, sin) = (&cos[table..table + half], &sin[table..table + half]);
        for head in row.chunks_mut(head_dim) {
            for (pair, (&c, &s)) in head.chunks_mut(2).zip(cos.iter().zip(sin)) {
                let (x0, x1) = (pair[0], pair[1]);
                // llama.cpp is compiled with floating-point contraction: GCC fuses these into
                // fma(x0, c, -(x1 * s)) and fma(x0, s, x1 * c); match it exactly.
                pair[0] = x0.mul_add(c, -(x1 * s));
                pair[1] = x0.mul_add(s, x1 * c);
            }
        }
    }
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// `q`: `[n, heads * head_dim]` (rotated) for positions `past..past + n`; `k`, `v`: the layer's
/// cache `[>= past + n, kv_heads * head_dim]` holding those positions. Returns
/// `[n, heads * head_dim]`.
pub fn causal_attention<'a>(q: &[f32], k: &'a [f16], v: &'a [f16], past: usize, shape: HeadShape) -> Vec<f32> {
    let HeadShape { num_heads, num_kv_heads, head_dim } = shape;
    let group = num_heads / num_kv_heads;
    let kv_dim = num_kv_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let simd = simd_available();
    let mut out = vec![0f32; q.len()];
    // One work item per (token, head): `head_dim` outputs.
    for_each_chunk_mut(&mut out, head_dim, |item, out| {
        let (i, head) = (item / num_heads, item % num_heads);
        let kv_off = (head / group) * head_dim;
        let query: Vec<f32> = q[item * head_dim..(item + 1) * head_dim].iter().map(|&x| round_f16(x)).collect();
        let visible = past + i + 1;
        let row = |cache: &'a [f16], j: usize| -> &'a [f16] { &cache[j * kv_dim + kv_off..][..head_dim] };
        let mut weights = vec![0f32; visible];
        if simd && head_dim % STEP == 0 {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: features detected; the cache holds `visible` rows of `kv_dim` values.
            unsafe {
                simd::scaled_dots(&query, &k[kv_off..], kv_dim, scale, &mut weights)
            };
        } else {
            for (j, w) in weights.iter_mut().enumerate() {
                *w = lane_dot(row(k, j), &query) * scale;
            }
        }
        let max = weights.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        softmax_exps(&mut weights, max);
        // llama.cpp pads the row to a multiple of 32 masked cells and sums it 8 at a time.
        let total: f64 = weights.chunks(8).map(|c| hsum8(c) as f64).sum();
        let inv = (1.0 / total) as f32;
        let probs: Vec<f32> = weights.iter().map(|w| round_f16(w * inv)).collect();
        weighted_sum(simd, |j| row(v, j), &probs, out);
    });
    out
}

/// Lanes of llamafile's tinyBLAS kernel, which llama.cpp uses for both attention matmuls on
/// AVX2: one 8-lane fused-multiply-add accumulator per output, then `hsum8`.
const STEP: usize = 8;

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

/// ggml's horizontal sum of 8 floats (missing ones are masked cells, zero).
fn hsum8(v: &[f32]) -> f32 {
    let x = |i: usize| v.get(i).copied().unwrap_or(0.0);
    let h: [f32; 4] = std::array::from_fn(|k| x(k + 4) + x(k));
    (h[0] + h[2]) + (h[1] + h[3])
}

/// Σ a[d] * b[d] summed the way llama.cpp's attention does: fused multiply-adds into 8 lanes,
/// `hsum8`, then any tail (lengths not a multiple of 8) in f64. The scalar twin of
/// `simd::scaled_dots`, used where that kernel cannot run.
fn lane_dot(a: &[f16], b: &[f32]) -> f32 {
    let full = a.len() / STEP * STEP;
    let mut acc = [0f32; STEP];
    for (i, (x, y)) in a[..full].iter().zip(&b[..full]).enumerate() {
        acc[i % STEP] = x.to_f32().mul_add(*y, acc[i % STEP]);
    }
    let mut sum = hsum8(&acc) as f64;
    for (x, y) in a[full..].iter().zip(&b[full..]) {
        sum += (x.to_f32() * y) as f64;
    }
    sum as f32
}

/// out[d] = Σ_j probs[j] * values[j][d], each output summed over j in 8 lanes like `lane_dot`
/// (llama.cpp stores V transposed, so its kernel dots each value dimension with the weights).
/// llama.cpp pads the cache view with zero-weight cells to a multiple of 8, so every j goes
/// through the lanes and there is no f64 tail.
fn weighted_sum<'a>(simd: bool, value: impl Fn(usize) -> &'a [f16], probs: &[f32], out: &mut [f32]) {
    let head_dim = out.len();
    // lanes[(j % STEP) * head_dim + d] accumulates probs[j] * values[j][d].
    let mut lanes = vec![0f32; STEP * head_dim];
    for (j, &p) in probs.iter().enumerate() {
        let row = value(j);
        let slot = &mut lanes[(j % STEP) * head_dim..][..head_dim];
        if simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2, FMA and F16C were detected.
            unsafe {
                simd::axpy(slot, p, row)
            };
        } else {
            for (s, x) in slot.iter_mut().zip(row) {
                *s = x.to_f32().mul_add(p, *s);
            }
        }
    }
    for (d, o) in out.iter_mut().enumerate() {
        let acc: [f32; STEP] = std::array::from_fn(|slot| lanes[slot * head_dim + d]);
        *o = hsum8(&acc);
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::STEP;

    use half::f16;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// out[j] = lane_dot(keys row j, query) * scale for every j, with the dot inlined: 8-lane
    /// fused multiply-adds, then the same reduction as `hsum8`. `keys` starts at the head's
    /// offset of row 0; rows are `stride` apart; `query.len()` is a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scaled_dots(query: &[f32], keys: &[f16], stride: usize, scale: f32, out: &mut [f32]) {
        let head_dim = query.len();
        for (j, o) in out.iter_mut().enumerate() {
            unsafe {
                let key = keys.as_ptr().add(j * stride);
                let mut lane = _mm256_setzero_ps();
                for d in (0..head_dim).step_by(STEP) {
                    lane = _mm256_fmadd_ps(load8(key.add(d)), _mm256_loadu_ps(query.as_ptr().add(d)), lane);
                }
                let h = _mm_add_ps(_mm256_extractf128_ps(lane, 1), _mm256_castps256_ps128(lane));
                let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                *o = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))) * scale;
            }
        }
    }

    /// out[d] = x[d] * p + out[d] (fused).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy(out: &mut [f32], p: f32, x: &[f16]) {
        let pv = _mm256_set1_ps(p);
        let full = out.len() / 8 * 8;
        unsafe {
            for d in (0..full).step_by(8) {
                let o = out.as_mut_ptr().add(d);
                _mm256_storeu_ps(o, _mm256_fmadd_ps(load8(x.as_ptr().add(d)), pv, _mm256_loadu_ps(o)));
            }
        }
        for d in full..out.len() {
            out[d] = x[d].to_f32().mul_add(p, out[d]);
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

    #[test]
    fn batched_rows_equal_single_rows_bitwise() {
        let shape = HeadShape { num_heads: 4, num_kv_heads: 2, head_dim: 8 };
        let (n, past) = (5, 3);
        let q = pseudo_random(n * 32, 1);
        let k = to_f16(&pseudo_random((past + n) * 16, 2));
        let v = to_f16(&pseudo_random((past + n) * 16, 3));
        let batched = causal_attention(&q, &k, &v, past, shape);
        for i in 0..n {
            let single = causal_attention(&q[i * 32..(i + 1) * 32], &k, &v, past + i, shape);
            assert_eq!(&batched[i * 32..(i + 1) * 32], &single[..]);
        }
    }

    #[test]
    fn matches_a_plain_softmax_attention() {
        let shape = HeadShape { num_heads: 2, num_kv_heads: 1, head_dim: 8 };
        let q = pseudo_random(16, 4);
        let (k, v) = (to_f16(&pseudo_random(3 * 8, 5)), to_f16(&pseudo_random(3 * 8, 6)));
        let out = causal_attention(&q, &k, &v, 2, shape);
        for h in 0..2 {
            let qh = &q[h * 8..(h + 1) * 8];
            let s: Vec<f32> =
                (0..3).map(|j| (0..8).map(|d| qh[d] * k[j * 8 + d].to_f32()).sum::<f32>() / 8f32.sqrt()).collect();
            let z: f32 = s.iter().map(|x| x.exp()).sum();
            for d in 0..8 {
                let want: f32 = (0..3).map(|j| s[j].exp() / z * v[j * 8 + d].to_f32()).sum();
                assert!((out[h * 8 + d] - want).abs() < 2e-3, "{} vs {want}", out[h * 8 + d]);
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_by_position() {
        let (cos, sin) = (vec![1.0, 0.0], vec![0.0, 1.0]); // position 0: identity; 1: 90 degrees
        let mut x = vec![1.0, 2.0];
        apply_rope(&mut x, 1, 2, 1, &cos, &sin);
        assert_eq!(x, vec![-2.0, 1.0]);
        let (cos, sin) = rope_tables(4, 10_000.0, 3, None);
        assert_eq!((cos[0], sin[0]), (1.0, 0.0));
        assert!((cos[2] - 1f32.cos()).abs() < 1e-7 && (sin[3] - 0.01f32.sin()).abs() < 1e-7);
    }
}
