//! Attention's two inner loops with 8-lane AVX2 vectors (the x86 AVX2 set's `scaled_dots` and
//! `weighted_sum`): f16 keys and values converted with F16C, fused multiply-adds.
//!
//! Invariant: both equal their scalar twins in `reference.rs` bitwise (same lanes, same reduction
//! tree, same fused multiply-add chains), for head sizes that are a multiple of 8.

use std::arch::x86_64::*;

use half::f16;

use crate::model::kernels::attention::ValueRows;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(p: *const f16) -> __m256 {
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
}

/// out[j] = dot(keys row j, query) * scale for every j, as `reference::dot` sums it, 8 keys at a
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
/// the same tree for every j (`reference::reduce_lanes`).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn reduce_8x8(v: [__m256; 8]) -> __m256 {
    let t0 = _mm256_hadd_ps(v[0], v[1]);
    let t1 = _mm256_hadd_ps(v[2], v[3]);
    let t2 = _mm256_hadd_ps(v[4], v[5]);
    let t3 = _mm256_hadd_ps(v[6], v[7]);
    let u0 = _mm256_hadd_ps(t0, t1); // keys 0..3: low half lanes 0-3 sums, high half lanes 4-7
    let u1 = _mm256_hadd_ps(t2, t3);
    _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(u0, u1), _mm256_permute2f128_ps::<0x31>(u0, u1))
}

/// `reference::weighted_sum` with 8-lane vectors: up to 64 outputs stay in registers while the
/// value rows stream past. `out.len()` is a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn weighted_sum(value: &ValueRows, probs: &[f32], out: &mut [f32]) {
    let head_dim = out.len();
    assert!(head_dim.is_multiple_of(8), "weighted_sum: {head_dim} outputs");
    let mut d0 = 0;
    while d0 < head_dim {
        unsafe {
            if head_dim - d0 >= 64 {
                chunk::<8>(value, probs, d0, out);
                d0 += 64;
            } else {
                chunk::<1>(value, probs, d0, out);
                d0 += 8;
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chunk<const L: usize>(value: &ValueRows, probs: &[f32], d0: usize, out: &mut [f32]) {
    let mut acc = [_mm256_setzero_ps(); L];
    let mut j = 0;
    while j < probs.len() {
        // The rows of one run lie `stride` apart: their slot is resolved once.
        let (rows, run) = value.run(j);
        let run = run.min(probs.len() - j);
        assert!(
            rows.len() >= (run - 1) * value.stride + d0 + 8 * L,
            "weighted_sum: a run of {run} value rows in {} values",
            rows.len()
        );
        for (r, &p) in probs[j..j + run].iter().enumerate() {
            let row = unsafe { rows.as_ptr().add(r * value.stride) };
            let pv = _mm256_set1_ps(p);
            for (l, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(unsafe { load8(row.add(d0 + 8 * l)) }, pv, *acc);
            }
        }
        j += run;
    }
    for (l, acc) in acc.iter().enumerate() {
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(d0 + 8 * l), *acc) };
    }
}
