//! K-quant weights (Q4_K, Q6_K: 256-value super-blocks) dotted with activations quantized to
//! Q8_K, on the CPU, in the order llama.cpp's AVX2 build computes a single token:
//! - Q4_K: llama.cpp repacks these weights into 8-row interleaved tiles (`CPU_REPACK`, any row
//!   count divisible by 8) and runs `ggml_gemv_q4_K_8x8_q8_K`: per super-block the exact integer
//!   dot and min correction, accumulated as `isum * (d * d8)` and `imin * (dmin * d8)` with fused
//!   multiply-adds, subtracted at the end;
//! - Q6_K: `ggml_vec_dot_q6_K_q8_K`: per super-block eight integer lanes (lane m holds bytes
//!   4m..4m+3 of every 32-value chunk, minus 32 x the scaled activation sums of values
//!   32m..32m+31), each accumulated with a fused multiply-add, then one horizontal sum;
//! - activations: `quantize_row_q8_K_ref` (scale -127 / the signed extreme, round half to even,
//!   16-value sums).
//!
//! Invariant: an output depends only on its weight row and its activation row, summed in a fixed
//! order, and the AVX2 kernels equal the scalar references bitwise (the integer parts are exact;
//! the float operations are the same ones in the same order).

use half::f16;

use super::ggml_math::hsum8;

/// Activation rows dotted with one unpacked weight block before moving on.
pub(crate) const ROW_GROUP: usize = 8;

pub const QK_K: usize = 256;
/// `{ d: f16, dmin: f16, scales: [u8; 12] (6-bit scales and mins of 8 sub-blocks), qs: [u8; 128] }`:
/// x = d * scale_j * nibble - dmin * min_j; bytes 32c..32c+31 of qs hold values 64c.. (low
/// nibbles) and 64c+32.. (high nibbles).
pub const Q4K_BYTES: usize = 144;
/// `{ ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16 }`: x = d * scale_(i/16) * (q - 32)
/// with q = 4 low bits from ql | 2 high bits from qh.
pub const Q6K_BYTES: usize = 210;

/// Activation rows quantized to Q8_K blocks.
pub struct Q8KRows {
    /// `[num_rows * in_features]`
    pub qs: Vec<i8>,
    /// `[num_rows * num_blocks]`
    pub d: Vec<f32>,
    /// `[num_rows * num_blocks * 16]`: sums of 16 consecutive `qs`.
    pub bsums: Vec<i16>,
    pub num_blocks: usize,
}

/// ggml's `nearest_int`: round half to even through the 1.5 * 2^23 trick.
fn nearest_int(x: f32) -> i32 {
    ((x + 12_582_912.0).to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// `x`: `[num_rows, in_features]` with `in_features` a multiple of 256.
pub fn quantize_q8k(x: &[f32], in_features: usize) -> Q8KRows {
    let num_blocks = in_features / QK_K;
    let total_blocks = x.len() / QK_K;
    let mut qs = vec![0i8; x.len()];
    let mut d = vec![0f32; total_blocks];
    let mut bsums = vec![0i16; total_blocks * 16];
    for (b, block) in x.chunks_exact(QK_K).enumerate() {
        // The first value of largest magnitude, with its sign.
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in block {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            continue;
        }
        let iscale = -127.0 / max;
        let q = &mut qs[b * QK_K..(b + 1) * QK_K];
        for (q, &v) in q.iter_mut().zip(block) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (j, sum) in bsums[b * 16..(b + 1) * 16].iter_mut().enumerate() {
            *sum = q[j * 16..(j + 1) * 16].iter().map(|&v| v as i16).sum();
        }
        d[b] = 1.0 / iscale;
    }
    Q8KRows { qs, d, bsums, num_blocks }
}

pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The 6-bit scales and mins of a Q4_K block's 8 sub-blocks (ggml's `get_scale_min_k4`).
pub(crate) fn q4k_scales_mins(s: &[u8]) -> ([i32; 8], [i32; 8]) {
    let mut scales = [0i32; 8];
    let mut mins = [0i32; 8];
    for j in 0..8 {
        let (sc, m) = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
        };
        scales[j] = sc as i32;
        mins[j] = m as i32;
    }
    (scales, mins)
}

/// One Q4_K weight row against activation row `row` (the scalar reference).
pub fn dot_q4k(weight: &[u8], a: &Q8KRows, row: usize) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for b in 0..a.num_blocks {
        let blk = &weight[b * Q4K_BYTES..(b + 1) * Q4K_BYTES];
        let at = row * a.num_blocks + b;
        let q8 = &a.qs[at * QK_K..(at + 1) * QK_K];
        let bsums = &a.bsums[at * 16..(at + 1) * 16];
        let (scales, mins) = q4k_scales_mins(&blk[4..16]);
        let qs = &blk[16..];
        let mut isum = 0i32;
        for c in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for i in 0..32 {
                lo += (qs[32 * c + i] & 0xF) as i32 * q8[64 * c + i] as i32;
                hi += (qs[32 * c + i] >> 4) as i32 * q8[64 * c + 32 + i] as i32;
            }
            isum += scales[2 * c] * lo + scales[2 * c + 1] * hi;
        }
        let imin: i32 = (0..8).map(|j| mins[j] * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32)).sum();
        let d8 = a.d[at];
        acc = (isum as f32).mul_add(f16_at(blk, 0) * d8, acc);
        acc_min = (imin as f32).mul_add(f16_at(blk, 2) * d8, acc_min);
    }
    acc - acc_min
}

/// One Q6_K weight row against activation row `row` (the scalar reference).
pub fn dot_q6k(weight: &[u8], a: &Q8KRows, row: usize) -> f32 {
    let mut acc = [0f32; 8];
    for b in 0..a.num_blocks {
        let blk = &weight[b * Q6K_BYTES..(b + 1) * Q6K_BYTES];
        let at = row * a.num_blocks + b;
        let q8 = &a.qs[at * QK_K..(at + 1) * QK_K];
        let bsums = &a.bsums[at * 16..(at + 1) * 16];
        let (ql, qh) = (&blk[..128], &blk[128..192]);
        let scale = |i: usize| blk[192 + i] as i8 as i32;
        let mut lanes = [0i32; 8];
        for c in 0..8 {
            let (half, k) = (c / 4, c % 4);
            for i in 0..32 {
                let l = ql[64 * half + 32 * (k % 2) + i];
                let low = if k < 2 { l & 0xF } else { l >> 4 };
                let q = low | (((qh[32 * half + i] >> (2 * k)) & 3) << 4);
                let e = 32 * c + i;
                lanes[i / 4] += scale(e / 16) * q as i32 * q8[e] as i32;
            }
        }
        let d = a.d[at] * f16_at(blk, 208);
        for (m, lane) in lanes.iter().enumerate() {
            let offset = 32 * (bsums[2 * m] as i32 * scale(2 * m) + bsums[2 * m + 1] as i32 * scale(2 * m + 1));
            acc[m] = d.mul_add((lane - offset) as f32, acc[m]);
        }
    }
    hsum8(&acc)
}

#[cfg(test)]
mod tests {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    use super::*;
    use crate::model::kernels::format::Format;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((((i as u32).wrapping_mul(2654435761).wrapping_add(seed)) >> 8) as f32 / 16777216.0) - 0.5)
            .collect()
    }

    #[test]
    fn q8k_quantization_follows_ggml() {
        let mut x = pseudo_random(512, 3);
        x[7] = -0.9; // the extreme maps to -127, so d carries its sign: 0.9 / 127 here
        x[300] = 0.8; // and to -127 in the second block, with d = -0.8 / 127
        let a = quantize_q8k(&x, 512);
        assert_eq!((a.qs[7], a.qs[300]), (-127, -127));
        assert!((a.d[0] - 0.9 / 127.0).abs() < 1e-9 && (a.d[1] + 0.8 / 127.0).abs() < 1e-9);
        for b in 0..2 {
            for j in 0..16 {
                let sum: i16 = a.qs[b * 256 + j * 16..][..16].iter().map(|&q| q as i16).sum();
                assert_eq!(a.bsums[b * 16 + j], sum);
            }
        }
        // Zero blocks stay zero.
        let z = quantize_q8k(&[0.0; 256], 256);
        assert_eq!((z.d[0], z.qs.iter().all(|&q| q == 0)), (0.0, true));
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-3.5), -4);
    }

    fn check(dtype: GgmlDType) {
        let (out_f, in_f, n) = (8, 512, 3);
        let w = Tensor::from_vec(pseudo_random(out_f * in_f, 1), (out_f, in_f), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dtype).unwrap();
        let bytes = q.data().unwrap();
        let dense: Vec<f32> = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let x = pseudo_random(n * in_f, 2);
        let a = quantize_q8k(&x, in_f);
        let row_bytes = bytes.len() / out_f;
        for f in 0..out_f {
            let wrow = &bytes[f * row_bytes..(f + 1) * row_bytes];
            let scalar: Vec<f32> = (0..n)
                .map(|r| if dtype == GgmlDType::Q4K { dot_q4k(wrow, &a, r) } else { dot_q6k(wrow, &a, r) })
                .collect();
            for (r, s) in scalar.iter().enumerate() {
                let exact: f32 = (0..in_f).map(|i| dense[f * in_f + i] * x[r * in_f + i]).sum();
                assert!((s - exact).abs() < 0.02, "{dtype:?} feature {f} row {r}: {s} vs {exact}");
            }
            for set in crate::model::kernels::available_sets() {
                let mut simd = vec![0f32; n];
                let format = if dtype == GgmlDType::Q4K { Format::Q4K } else { Format::Q6K };
                // SAFETY: the set runs on this CPU; the row holds in_f / 256 blocks.
                unsafe { (set.q8k_dot_rows)(format, wrow, &a, 0, &mut simd) };
                assert_eq!(simd, scalar, "{dtype:?}: the {} kernel must equal the reference bitwise", set.name);
            }
        }
    }

    #[test]
    fn q4k_matches_dequantized_weights_and_simd_equals_scalar() {
        check(GgmlDType::Q4K);
    }

    #[test]
    fn q6k_matches_dequantized_weights_and_simd_equals_scalar() {
        check(GgmlDType::Q6K);
    }
}
