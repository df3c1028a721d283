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
//! Precision and summation order follow llama.cpp's CPU path (no flash attention), so the two
//! agree bit for bit where they can: keys/values are f16, the query is rounded to f16 for the q·k
//! dot, the softmax is normalized in f32 (sum in f64, 8 cells at a time from cell 0, masked cells
//! zero), the probabilities are rounded to f16 before weighting the values, and both products sum
//! in the lane order of the llama.cpp kernel named by `DotOrder`.

use half::f16;

use super::ggml_math::{hsum8, hsum8_of, reduce_4x8_of, softmax_exps};
use super::parallel::for_each_chunk_mut;

#[derive(Debug, Clone, Copy)]
pub struct HeadShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// The llama.cpp kernel whose summation order both attention products reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DotOrder {
    /// llamafile's tinyBLAS, which llama.cpp runs for a batch of tokens: one 8-lane
    /// fused-multiply-add accumulator per output, then `ggml_math::hsum8_of`.
    Batched,
    /// `ggml_vec_dot_f16`, which llama.cpp runs for a single token: four 8-lane accumulators over
    /// 32-value steps, then `ggml_math::reduce_4x8_of`, then any tail in f64.
    SingleToken,
}

impl DotOrder {
    /// Accumulator slots of one output: value j of a dot goes to slot j % slots.
    fn slots(self) -> usize {
        match self {
            DotOrder::Batched => 8,
            DotOrder::SingleToken => 32,
        }
    }

    /// The reduction of the `slots()` accumulator slots `slot(0..slots)`.
    #[inline]
    fn reduce(self, slot: impl Fn(usize) -> f32) -> f32 {
        match self {
            DotOrder::Batched => hsum8_of(slot),
            DotOrder::SingleToken => reduce_4x8_of(slot),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Attention {
    pub shape: HeadShape,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Keys a query sees, itself included (sliding-window layers).
    pub window: Option<usize>,
    pub order: DotOrder,
}

fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

impl Attention {
    /// `q`: `[n, heads * head_dim]` (rotated) for positions `past..past + n`; `k`, `v`: the
    /// layer's cache `[>= past + n, kv_heads * head_dim]` holding those positions. Returns
    /// `[n, heads * head_dim]`.
    pub fn forward<'a>(&self, q: &[f32], k: &'a [f16], v: &'a [f16], past: usize) -> Vec<f32> {
        let HeadShape { num_heads, num_kv_heads, head_dim } = self.shape;
        let group = num_heads / num_kv_heads;
        let kv_dim = num_kv_heads * head_dim;
        let simd = simd_available();
        let mut out = vec![0f32; q.len()];
        // One work item per (token, head): `head_dim` outputs.
        for_each_chunk_mut(&mut out, head_dim, |item, out| {
            let (i, head) = (item / num_heads, item % num_heads);
            let kv_off = (head / group) * head_dim;
            let query: Vec<f32> = q[item * head_dim..(item + 1) * head_dim].iter().map(|&x| round_f16(x)).collect();
            let pos = past + i;
            let first = self.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            // Cells before `first` are masked: zero after the exponential, so they change no sum
            // and are skipped, but cells keep their absolute index for the lane order.
            let row = |cache: &'a [f16], j: usize| -> &'a [f16] { &cache[j * kv_dim + kv_off..][..head_dim] };
            let mut weights = vec![0f32; pos + 1 - first];
            if simd && head_dim % 32 == 0 {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: features detected; the cache holds rows first..=pos of `kv_dim` values.
                unsafe {
                    simd::scaled_dots(
                        self.order,
                        &query,
                        &k[first * kv_dim + kv_off..],
                        kv_dim,
                        self.scale,
                        &mut weights,
                    )
                };
            } else {
                for (j, w) in weights.iter_mut().enumerate() {
                    *w = dot(self.order, row(k, first + j), &query) * self.scale;
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
            let probs: Vec<f32> = weights.iter().map(|w| round_f16(w * inv)).collect();
            self.weighted_sum(simd, |j| row(v, first + j), first, &probs, out);
        });
        out
    }

    /// out[d] = Σ_j probs[j] * values[j][d], each output summed over j in the lanes of
    /// `self.order` (llama.cpp stores V transposed, so its kernel dots each value dimension with
    /// the weights). Cell `first + j` keeps its absolute lane; llama.cpp pads the cache view with
    /// zero-weight cells to a multiple of 32, so every cell goes through the lanes and there is no
    /// f64 tail.
    fn weighted_sum<'a>(
        &self,
        simd: bool,
        value: impl Fn(usize) -> &'a [f16],
        first: usize,
        probs: &[f32],
        out: &mut [f32],
    ) {
        let head_dim = out.len();
        let slots = self.order.slots();
        // lanes[slot * head_dim + d] accumulates probs[j] * values[j][d] for (first + j) % slots == slot.
        let mut lanes = vec![0f32; slots * head_dim];
        for (j, &p) in probs.iter().enumerate() {
            let row = value(j);
            let slot = &mut lanes[((first + j) % slots) * head_dim..][..head_dim];
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
            *o = self.order.reduce(|slot| lanes[slot * head_dim + d]);
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

/// Σ a[d] * b[d] summed as `order`'s kernel does: fused multiply-adds into its lanes, its
/// reduction, then any tail (lengths not a multiple of its step) in f64. The scalar twin of
/// `simd::scaled_dots`, used where that kernel cannot run.
fn dot(order: DotOrder, a: &[f16], b: &[f32]) -> f32 {
    let slots = order.slots();
    let full = a.len() / slots * slots;
    let mut acc = vec![0f32; slots];
    for (i, (x, y)) in a[..full].iter().zip(&b[..full]).enumerate() {
        acc[i % slots] = x.to_f32().mul_add(*y, acc[i % slots]);
    }
    let mut sum = order.reduce(|slot| acc[slot]) as f64;
    for (x, y) in a[full..].iter().zip(&b[full..]) {
        sum += (x.to_f32() * y) as f64;
    }
    sum as f32
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use half::f16;

    use super::DotOrder;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    /// `ggml_hsum_float_8`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum8(x: __m256) -> f32 {
        let h = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)))
    }

    /// `GGML_F32x8_REDUCE` of four accumulators.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn reduce_4x8(acc: [__m256; 4]) -> f32 {
        let x = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
        let t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let t1 = _mm_hadd_ps(t0, t0);
        _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
    }

    /// out[j] = dot(keys row j, query) * scale for every j, as `super::dot` sums it. `keys`
    /// starts at the head's offset of the first row; rows are `stride` apart; `query.len()` is a
    /// multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scaled_dots(
        order: DotOrder,
        query: &[f32],
        keys: &[f16],
        stride: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        let head_dim = query.len();
        let q = query.as_ptr();
        for (j, o) in out.iter_mut().enumerate() {
            unsafe {
                let key = keys.as_ptr().add(j * stride);
                *o = match order {
                    DotOrder::Batched => {
                        let mut lane = _mm256_setzero_ps();
                        for d in (0..head_dim).step_by(8) {
                            lane = _mm256_fmadd_ps(load8(key.add(d)), _mm256_loadu_ps(q.add(d)), lane);
                        }
                        hsum8(lane)
                    }
                    DotOrder::SingleToken => {
                        let mut acc = [_mm256_setzero_ps(); 4];
                        for d in (0..head_dim).step_by(32) {
                            for (a, acc) in acc.iter_mut().enumerate() {
                                let at = d + 8 * a;
                                *acc = _mm256_fmadd_ps(load8(key.add(at)), _mm256_loadu_ps(q.add(at)), *acc);
                            }
                        }
                        reduce_4x8(acc)
                    }
                } * scale;
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

    fn attention(shape: HeadShape, window: Option<usize>, order: DotOrder) -> Attention {
        Attention { shape, scale: 1.0 / (shape.head_dim as f32).sqrt(), window, order }
    }

    #[test]
    fn batched_rows_equal_single_rows_bitwise() {
        for order in [DotOrder::Batched, DotOrder::SingleToken] {
            for (head_dim, window) in [(8, None), (32, Some(3)), (64, None)] {
                let shape = HeadShape { num_heads: 4, num_kv_heads: 2, head_dim };
                let (n, past, q_width, kv_width) = (5, 3, 4 * head_dim, 2 * head_dim);
                let attn = attention(shape, window, order);
                let q = pseudo_random(n * q_width, 1);
                let k = to_f16(&pseudo_random((past + n) * kv_width, 2));
                let v = to_f16(&pseudo_random((past + n) * kv_width, 3));
                let batched = attn.forward(&q, &k, &v, past);
                for i in 0..n {
                    let single = attn.forward(&q[i * q_width..(i + 1) * q_width], &k, &v, past + i);
                    assert_eq!(&batched[i * q_width..(i + 1) * q_width], &single[..], "{order:?} {head_dim}");
                }
            }
        }
    }

    /// Against a plain softmax attention over exactly the keys in the window.
    #[test]
    fn matches_a_plain_softmax_attention() {
        for (order, head_dim, window) in
            [(DotOrder::Batched, 8, None), (DotOrder::SingleToken, 32, None), (DotOrder::SingleToken, 64, Some(2))]
        {
            let shape = HeadShape { num_heads: 2, num_kv_heads: 1, head_dim };
            let past = 2;
            let q = pseudo_random(2 * head_dim, 4);
            let (k, v) = (to_f16(&pseudo_random(3 * head_dim, 5)), to_f16(&pseudo_random(3 * head_dim, 6)));
            let out = attention(shape, window, order).forward(&q, &k, &v, past);
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
                    assert!((got - want).abs() < 2e-3, "{order:?}: {got} vs {want}");
                }
            }
        }
    }

    /// The SIMD dot equals the scalar reference bitwise in both orders.
    #[test]
    fn simd_dots_equal_the_reference() {
        if !simd_available() {
            return;
        }
        let (head_dim, rows) = (64, 5);
        let query: Vec<f32> = pseudo_random(head_dim, 7).iter().map(|&x| round_f16(x)).collect();
        let keys = to_f16(&pseudo_random(rows * head_dim, 8));
        for order in [DotOrder::Batched, DotOrder::SingleToken] {
            let mut simd_out = vec![0f32; rows];
            #[cfg(target_arch = "x86_64")]
            // SAFETY: features checked; `keys` holds `rows` rows of `head_dim`.
            unsafe {
                simd::scaled_dots(order, &query, &keys, head_dim, 0.5, &mut simd_out)
            };
            for (j, s) in simd_out.iter().enumerate() {
                assert_eq!(*s, dot(order, &keys[j * head_dim..(j + 1) * head_dim], &query) * 0.5, "{order:?}");
            }
        }
    }
}
