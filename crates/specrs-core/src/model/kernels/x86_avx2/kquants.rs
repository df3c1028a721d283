//! Q4_K and Q6_K weight rows against Q8_K activation rows, vectorized with AVX2: the same sums
//! as the scalar references `kquants::dot_q4k` / `dot_q6k`; each weight block is unpacked once for
//! all the activation rows of a call. The x86 AVX2 set's `q8k_dot_rows`.
//!
//! Invariant: every output equals its scalar reference bitwise (the integer parts are exact; the
//! float operations are the same ones in the same order).

use std::arch::x86_64::*;

use crate::model::kernels::format::Format;
use crate::model::kernels::kquants::{f16_at, q4k_scales_mins, Q8KRows, Q4K_BYTES, Q6K_BYTES, QK_K, ROW_GROUP};

/// What the kernels read without bounds checks: `num_blocks` weight blocks of `block_bytes`,
/// at most `ROW_GROUP` activation rows from `first`, each with its blocks' 16 sums.
fn check_shapes(weight: &[u8], block_bytes: usize, a: &Q8KRows, first: usize, num_rows: usize) {
    let blocks = (first + num_rows) * a.num_blocks;
    assert!(
        num_rows <= ROW_GROUP
            && weight.len() >= a.num_blocks * block_bytes
            && a.qs.len() >= blocks * QK_K
            && a.d.len() >= blocks
            && a.bsums.len() >= blocks * 16,
        "K-quant dot: {} weight bytes, rows {first}..{} of {} blocks",
        weight.len(),
        first + num_rows,
        a.num_blocks
    );
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(x: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256::<1>(x));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum_f32(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// A Q4_K or Q6_K weight row (`format`) against rows `first..first + out.len()` of `a`: the
/// set's `q8k_dot_rows`.
///
/// # Safety
/// AVX2 and FMA must be available; `weight` holds `a.num_blocks` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_rows(format: Format, weight: &[u8], a: &Q8KRows, first: usize, out: &mut [f32]) {
    unsafe {
        match format {
            Format::Q4K => dot_q4k_rows(weight, a, first, out),
            _ => dot_q6k_rows(weight, a, first, out),
        }
    }
}

/// Q4_K row against rows `first..first + out.len()` of `a`.
///
/// # Safety
/// AVX2 and FMA must be available; `weight` holds `a.num_blocks` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_q4k_rows(weight: &[u8], a: &Q8KRows, first: usize, out: &mut [f32]) {
    check_shapes(weight, Q4K_BYTES, a, first, out.len());
    let mut acc = [0f32; ROW_GROUP];
    let mut acc_min = acc;
    let low = _mm256_set1_epi8(0x0F);
    for b in 0..a.num_blocks {
        let blk = &weight[b * Q4K_BYTES..(b + 1) * Q4K_BYTES];
        let (scales, mins) = q4k_scales_mins(&blk[4..16]);
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        // Nibbles of the 4 chunks: values 64c..64c+31 (low) and 64c+32..64c+63 (high).
        let mut nibbles = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            // SAFETY: 32 bytes at 16 + 32c lie within the 144-byte block.
            let packed = unsafe { _mm256_loadu_si256(blk.as_ptr().add(16 + 32 * c) as *const __m256i) };
            nibbles[2 * c] = _mm256_and_si256(packed, low);
            nibbles[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low);
        }
        let scale16: [__m256i; 8] = std::array::from_fn(|j| _mm256_set1_epi16(scales[j] as i16));
        for r in 0..out.len() {
            let at = (first + r) * a.num_blocks + b;
            let q8 = &a.qs[at * QK_K..(at + 1) * QK_K];
            let mut sum = _mm256_setzero_si256();
            for (j, (n, s)) in nibbles.iter().zip(&scale16).enumerate() {
                // SAFETY: 32 values at 32j lie within the 256-value block.
                let y = unsafe { _mm256_loadu_si256(q8.as_ptr().add(32 * j) as *const __m256i) };
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(*n, y), *s));
            }
            let bsums = &a.bsums[at * 16..(at + 1) * 16];
            let imin: i32 = (0..8).map(|j| mins[j] * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32)).sum();
            let d8 = a.d[at];
            acc[r] = (hsum_i32(sum) as f32).mul_add(d * d8, acc[r]);
            acc_min[r] = (imin as f32).mul_add(dmin * d8, acc_min[r]);
        }
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = acc[r] - acc_min[r];
    }
}

/// Q6_K row against rows `first..first + out.len()` of `a`.
///
/// # Safety
/// AVX2 and FMA must be available; `weight` holds `a.num_blocks` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_q6k_rows(weight: &[u8], a: &Q8KRows, first: usize, out: &mut [f32]) {
    check_shapes(weight, Q6K_BYTES, a, first, out.len());
    let mut acc = [_mm256_setzero_ps(); ROW_GROUP];
    let low = _mm256_set1_epi8(0x0F);
    let two_bits = _mm256_set1_epi8(3);
    for b in 0..a.num_blocks {
        let blk = &weight[b * Q6K_BYTES..(b + 1) * Q6K_BYTES];
        let p = blk.as_ptr();
        // The 8 chunks of 32 unsigned 6-bit values, and each chunk's two scales as 16-bit
        // lanes (bytes 0..15 and 16..31 of a chunk have scales 2c and 2c+1).
        let mut q = [_mm256_setzero_si256(); 8];
        let mut scale16 = [_mm256_setzero_si256(); 8];
        for half in 0..2 {
            // SAFETY: offsets lie within the 210-byte block.
            let (l0, l1, h) = unsafe {
                (
                    _mm256_loadu_si256(p.add(64 * half) as *const __m256i),
                    _mm256_loadu_si256(p.add(64 * half + 32) as *const __m256i),
                    _mm256_loadu_si256(p.add(128 + 32 * half) as *const __m256i),
                )
            };
            let high = |shift: i32| {
                let bits = match shift {
                    0 => h,
                    2 => _mm256_srli_epi16::<2>(h),
                    4 => _mm256_srli_epi16::<4>(h),
                    _ => _mm256_srli_epi16::<6>(h),
                };
                _mm256_slli_epi16::<4>(_mm256_and_si256(bits, two_bits))
            };
            q[4 * half] = _mm256_or_si256(_mm256_and_si256(l0, low), high(0));
            q[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), high(2));
            q[4 * half + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l0), low), high(4));
            q[4 * half + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(l1), low), high(6));
        }
        let scale = |i: usize| blk[192 + i] as i8 as i16;
        for (c, s) in scale16.iter_mut().enumerate() {
            let (lo, hi) = (_mm_set1_epi16(scale(2 * c)), _mm_set1_epi16(scale(2 * c + 1)));
            *s = _mm256_set_m128i(hi, lo);
        }
        let scales_all = _mm256_set_epi16(
            scale(15),
            scale(14),
            scale(13),
            scale(12),
            scale(11),
            scale(10),
            scale(9),
            scale(8),
            scale(7),
            scale(6),
            scale(5),
            scale(4),
            scale(3),
            scale(2),
            scale(1),
            scale(0),
        );
        let d = f16_at(blk, 208);
        for (r, acc) in acc.iter_mut().enumerate().take(out.len()) {
            let at = (first + r) * a.num_blocks + b;
            let q8 = &a.qs[at * QK_K..(at + 1) * QK_K];
            let mut sum = _mm256_setzero_si256();
            for c in 0..8 {
                // SAFETY: 32 values at 32c lie within the 256-value block.
                let y = unsafe { _mm256_loadu_si256(q8.as_ptr().add(32 * c) as *const __m256i) };
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], y), scale16[c]));
            }
            // SAFETY: 16 sums per block.
            let bsums = unsafe { _mm256_loadu_si256(a.bsums.as_ptr().add(at * 16) as *const __m256i) };
            let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, scales_all));
            let lanes = _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, offset));
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(a.d[at] * d), lanes, *acc);
        }
    }
    for (r, o) in out.iter_mut().enumerate() {
        *o = hsum_f32(acc[r]);
    }
}
