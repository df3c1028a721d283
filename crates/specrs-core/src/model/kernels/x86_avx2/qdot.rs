//! Q4_0, Q4_1, Q5_0 and Q8_0 weight rows against activation rows quantized to Q8_0 blocks
//! (`qlinear::QuantizedRows`), in the order of llama.cpp's AVX2 single-token kernels: the x86
//! AVX2 set's `qdot_rows` and `qdot_features`.
//!
//! Invariant: every (weight row, activation row) pair is summed in the same order whatever the
//! number of rows in the call; Q5_0 and Q8_0 equal `reference::scalar_dot_rows` bitwise.

use std::arch::x86_64::*;

use crate::model::kernels::format::{Format, BLOCK};
use crate::model::kernels::kquants::ROW_GROUP;
use crate::model::kernels::qlinear::{QuantizedRows, FEATURES_PER_CALL, PREFETCH_BYTES};

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Sum of u8 x i8 products in 8 float lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn mul_sum_us8(ax: __m256i, sy: __m256i) -> __m256 {
    let pairs = _mm256_maddubs_epi16(ax, sy);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), pairs))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32(p: *const u8) -> f32 {
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// # Safety
/// Needs AVX2, FMA and F16C; `out.len() <= ROW_GROUP` rows starting at `first` must exist in
/// `rows`, and `weight` must hold `rows.num_blocks` blocks of `format` (a 32-value format).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_rows(format: Format, weight: &[u8], rows: &QuantizedRows, first: usize, out: &mut [f32]) {
    // The kernel reads weight blocks and activation rows unchecked.
    assert!(
        out.len() <= ROW_GROUP
            && weight.len() == rows.num_blocks * format.block_bytes()
            && rows.holds(first + out.len()),
        "dot_rows: {} weight bytes, rows {first}..{} of {} blocks",
        weight.len(),
        first + out.len(),
        rows.num_blocks
    );
    // Monomorphized per group size and format so the accumulators live in registers.
    unsafe {
        match format {
            Format::Q4_0 => dot_group_sized::<Q4_0>(weight, rows, first, out),
            Format::Q4_1 => dot_group_sized::<Q4_1>(weight, rows, first, out),
            Format::Q5_0 => dot_group_sized::<Q5_0>(weight, rows, first, out),
            Format::Q8_0 => dot_group_sized::<Q8_0>(weight, rows, first, out),
            Format::Q4K | Format::Q6K => unreachable!("K-quants run in kquants.rs"),
        }
    }
}

/// `out[h]` = weight row h of `weights` (rows `row_bytes` apart) dotted with activation row
/// 0, each summed exactly as `dot_rows` sums it.
///
/// # Safety
/// As `dot_rows`, with `out.len() <= FEATURES_PER_CALL` weight rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_features(format: Format, weights: &[u8], row_bytes: usize, rows: &QuantizedRows, out: &mut [f32]) {
    assert!(
        out.len() <= FEATURES_PER_CALL
            && weights.len() == out.len() * row_bytes
            && row_bytes == rows.num_blocks * format.block_bytes()
            && rows.holds(1),
        "dot_features: {} weight bytes for {} rows of {row_bytes}, {} blocks",
        weights.len(),
        out.len(),
        rows.num_blocks
    );
    macro_rules! by_count {
        ($f:ident) => {
            match out.len() {
                1 => dot_group::<1, 1, $f>(weights, row_bytes, rows, 0, out),
                2 => dot_group::<1, 2, $f>(weights, row_bytes, rows, 0, out),
                3 => dot_group::<1, 3, $f>(weights, row_bytes, rows, 0, out),
                4 => dot_group::<1, 4, $f>(weights, row_bytes, rows, 0, out),
                5 => dot_group::<1, 5, $f>(weights, row_bytes, rows, 0, out),
                6 => dot_group::<1, 6, $f>(weights, row_bytes, rows, 0, out),
                7 => dot_group::<1, 7, $f>(weights, row_bytes, rows, 0, out),
                _ => dot_group::<1, 8, $f>(weights, row_bytes, rows, 0, out),
            }
        };
    }
    unsafe {
        match format {
            Format::Q4_0 => by_count!(Q4_0),
            Format::Q4_1 => by_count!(Q4_1),
            Format::Q5_0 => by_count!(Q5_0),
            Format::Q8_0 => by_count!(Q8_0),
            Format::Q4K | Format::Q6K => unreachable!("K-quants run in kquants.rs"),
        }
    }
}

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;

/// Byte i = 0xFF where bit i of the little-endian u32 at `p` is set (llama.cpp's
/// bytes_from_bits_32).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let bits = unsafe { (p as *const u32).read_unaligned() } as i32;
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
    );
    let all_but_one = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(spread, all_but_one), _mm256_set1_epi64x(-1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_group_sized<const F: u8>(weight: &[u8], rows: &QuantizedRows, first: usize, out: &mut [f32]) {
    unsafe {
        match out.len() {
            1 => dot_group::<1, 1, F>(weight, 0, rows, first, out),
            2 => dot_group::<2, 1, F>(weight, 0, rows, first, out),
            3 => dot_group::<3, 1, F>(weight, 0, rows, first, out),
            4 => dot_group::<4, 1, F>(weight, 0, rows, first, out),
            5 => dot_group::<5, 1, F>(weight, 0, rows, first, out),
            6 => dot_group::<6, 1, F>(weight, 0, rows, first, out),
            7 => dot_group::<7, 1, F>(weight, 0, rows, first, out),
            _ => dot_group::<8, 1, F>(weight, 0, rows, first, out),
        }
    }
}

/// `G` activation rows against `H` weight rows of format `F` (`row_bytes` apart): `out[h * G +
/// r]`. Every (weight row, activation row) pair is summed in the same order whatever G and H.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_group<const G: usize, const H: usize, const F: u8>(
    weight: &[u8],
    row_bytes: usize,
    rows: &QuantizedRows,
    first: usize,
    out: &mut [f32],
) {
    let bb = match F {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        _ => 34,
    };
    let nb = rows.num_blocks;
    let w = weight.as_ptr();
    let qs = rows.qs.as_ptr();
    let scales = rows.scales.as_ptr();
    let sums = rows.sums.as_ptr();
    let mut acc = [[_mm256_setzero_ps(); G]; H];
    let mut offsets = [[0f32; G]; H];
    let low_nibbles = _mm256_set1_epi8(0x0F);
    for b in 0..nb {
        for (h, (acc, offsets)) in acc.iter_mut().zip(offsets.iter_mut()).enumerate() {
            unsafe {
                let blk = w.add(h * row_bytes + b * bb);
                // Weights stream from memory once per token: ask for the bytes a few blocks ahead
                // (the next weight row follows this one contiguously).
                // wrapping_add: near the end of the weights the address lies past the
                // allocation, where `add` would be undefined behaviour; a prefetch never faults.
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH_BYTES) as *const i8);
                let d = f16_to_f32(blk);
                if F == Q4_1 || F == Q4_0 {
                    // Q4_0 is Q4_1 with m = -8d: unsigned values, the offset through the
                    // activation block sums (cheaper than sign-extending).
                    let (m, nibbles_at) = if F == Q4_1 { (f16_to_f32(blk.add(2)), 4) } else { (-8.0 * d, 2) };
                    let packed = _mm_loadu_si128(blk.add(nibbles_at) as *const __m128i);
                    let both = _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4));
                    let wx = _mm256_and_si256(both, low_nibbles);
                    for r in 0..G {
                        let at = (first + r) * nb + b;
                        let qa = _mm256_loadu_si256(qs.add(at * BLOCK) as *const __m256i);
                        let scale = _mm256_set1_ps(d * *scales.add(at));
                        acc[r] = _mm256_fmadd_ps(scale, mul_sum_us8(wx, qa), acc[r]);
                        offsets[r] = m.mul_add(*sums.add(at), offsets[r]); // fused, as GCC contracts ggml's loop
                    }
                } else {
                    // Signed values, as ggml_vec_dot_{q5_0,q8_0}_q8_0: |w| times the activations
                    // carrying w's sign.
                    let q = if F == Q5_0 {
                        let packed = _mm_loadu_si128(blk.add(6) as *const __m128i);
                        let both =
                            _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4));
                        // q - 16: the nibble, with the top nibble all ones where the fifth bit is 0.
                        let minus_16 =
                            _mm256_andnot_si256(bytes_from_bits_32(blk.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
                        _mm256_or_si256(_mm256_and_si256(both, low_nibbles), minus_16)
                    } else {
                        _mm256_loadu_si256(blk.add(2) as *const __m256i)
                    };
                    let wx = _mm256_sign_epi8(q, q);
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let at = (first + r) * nb + b;
                        let qa = _mm256_sign_epi8(_mm256_loadu_si256(qs.add(at * BLOCK) as *const __m256i), q);
                        let scale = _mm256_set1_ps(d * *scales.add(at));
                        *acc = _mm256_fmadd_ps(scale, mul_sum_us8(wx, qa), *acc);
                    }
                }
            }
        }
    }
    for h in 0..H {
        for r in 0..G {
            out[h * G + r] = hsum(acc[h][r]) + offsets[h][r];
        }
    }
}
