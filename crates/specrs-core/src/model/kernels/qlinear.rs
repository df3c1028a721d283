//! Linear layers over GGUF quantized weights. On CPUs with AVX-512 VNNI the weights of every
//! type below are repacked at load and run on `repack.rs`'s kernel; elsewhere (and for matrices
//! whose row count is not a multiple of 8) specrs' AVX2 kernels here run them: Q4_0, Q4_1, Q5_0,
//! Q8_0 (32-value blocks, activations quantized to Q8_0 here) and Q4_K, Q6_K (256-value
//! super-blocks, activations quantized to Q8_K, `kquants.rs`).
//!
//! Why not candle's `QMatMul` for these: candle 0.11 has no x86 SIMD path for Q4_1 or Q5_0
//! (scalar code, ~10x slower than llama.cpp), its K-quant kernels round differently for one row
//! and for several, and verification wants each weight row read once for all n activation rows.
//! Here every weight row (an output feature) is unpacked once per block and dotted with up to
//! `ROW_GROUP` quantized activation rows while it sits in registers; threads split the output
//! features.
//!
//! Invariant: output row i depends only on input row i, computed in the same order whatever n is
//! (activations are quantized per row and block, as llama.cpp's AVX2 path does: int8 with
//! round-half-even, scales stored as f16), so batched and single-token forwards agree bitwise.
//! The AVX2 kernels for Q4_1, Q5_0, Q8_0, Q4_K and Q6_K sum in the order of llama.cpp's
//! single-token kernels. Other quantization types fall back to candle's `QMatMul`.

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use half::f16;

use super::format::{Format, BLOCK};
use super::ggml_math::hsum8;
use super::kquants::{self, Q8KRows, ROW_GROUP};
use super::parallel::for_each_chunk_mut;
use super::repack::{self, Repacked};
use crate::error::{Error, Result};

/// Output features per parallel work item.
const FEATURES_PER_TASK: usize = 16;
/// Weight rows one kernel call dots with a single activation row (decoding).
const FEATURES_PER_CALL: usize = 8;
/// How far ahead of the block being read the kernel prefetches weight bytes.
const PREFETCH_BYTES: usize = 512;

/// Activation rows quantized for one weight format.
enum Activations {
    Q8_0(QuantizedRows),
    Q8K(Q8KRows),
}

/// One activation row quantized to int8 blocks: `scales[b]` = d (f16-rounded), `sums[b]` =
/// d * sum(qs) (f16-rounded, the Q8_1 "s" used with Q4_1's offset).
struct QuantizedRows {
    qs: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<f32>,
    num_blocks: usize,
}

impl QuantizedRows {
    /// Whether rows `0..num_rows` are all here (what the unchecked kernels read).
    fn holds(&self, num_rows: usize) -> bool {
        let blocks = num_rows * self.num_blocks;
        self.qs.len() >= blocks * BLOCK && self.scales.len() >= blocks && self.sums.len() >= blocks
    }
}

fn quantize_rows(x: &[f32], num_rows: usize, in_features: usize) -> QuantizedRows {
    let num_blocks = in_features / BLOCK;
    let mut qs = vec![0i8; num_rows * in_features];
    let mut scales = vec![0f32; num_rows * num_blocks];
    let mut sums = vec![0f32; num_rows * num_blocks];
    for (b, block) in x.chunks_exact(BLOCK).enumerate() {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        // ggml divides 127 by the maximum rather than inverting d; the roundings differ.
        let inv_d = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qs[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(block) {
            *q = round_ties_even(v * inv_d) as i8;
            sum += *q as i32;
        }
        scales[b] = f16::from_f32(d).to_f32();
        sums[b] = f16::from_f32(d * sum as f32).to_f32();
    }
    QuantizedRows { qs, scales, sums, num_blocks }
}

/// Round half to even for |x| < 2^22 (the magic constant pushes the fraction out of the
/// mantissa and IEEE addition rounds ties to even), inlined unlike `f32::round_ties_even`.
#[inline]
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

/// A weight matrix `[out_features, in_features]`.
pub enum QLinear {
    /// The tensor's CPU bytes are read in place (a tied LM head shares the embedding's).
    Native {
        format: Format,
        weight: Arc<QTensor>,
        out_features: usize,
        in_features: usize,
    },
    /// Repacked into 8-row tiles for the AVX-512 VNNI kernel (`repack.rs`).
    Repacked(Repacked),
    Candle {
        matmul: QMatMul,
        out_features: usize,
    },
}

impl QLinear {
    pub fn new(weight: Arc<QTensor>) -> Result<Self> {
        let (out_features, in_features) = weight.shape().dims2()?;
        let format = match weight.dtype() {
            GgmlDType::Q4_0 => Some(Format::Q4_0),
            GgmlDType::Q4_1 => Some(Format::Q4_1),
            GgmlDType::Q5_0 => Some(Format::Q5_0),
            GgmlDType::Q8_0 => Some(Format::Q8_0),
            GgmlDType::Q4K => Some(Format::Q4K),
            GgmlDType::Q6K => Some(Format::Q6K),
            _ => None,
        };
        match format {
            Some(format) if in_features % format.block_len() == 0 && matches!(weight.device(), Device::Cpu) => {
                // The kernels index the weight bytes by these sizes without bounds checks.
                let want = out_features * (in_features / format.block_len()) * format.block_bytes();
                let have = weight.data()?.len();
                if have != want {
                    return Err(Error::Internal(format!(
                        "a {format:?} weight [{out_features}, {in_features}] holds {have} bytes, expected {want}"
                    )));
                }
                if repack::available() && repack::supports(format) && out_features % repack::TILE_ROWS == 0 {
                    return Ok(QLinear::Repacked(Repacked::new(format, &weight.data()?, out_features, in_features)));
                }
                Ok(QLinear::Native { format, weight, out_features, in_features })
            }
            _ => Ok(QLinear::Candle { matmul: QMatMul::from_arc(weight)?, out_features }),
        }
    }

    /// Whether specrs' own kernel runs it (else candle's `QMatMul`).
    pub fn is_native(&self) -> bool {
        !matches!(self, QLinear::Candle { .. })
    }

    pub fn out_features(&self) -> usize {
        match self {
            QLinear::Native { out_features, .. } | QLinear::Candle { out_features, .. } => *out_features,
            QLinear::Repacked(repacked) => repacked.out_features(),
        }
    }

    /// Several weights applied to the same `x` (`[num_rows, in_features]`): one
    /// `[num_rows, out_features]` per weight. Repacked weights share one activation quantization
    /// and one parallel region; the results are those of `forward_rows`, bitwise.
    pub fn forward_many(linears: &[&QLinear], x: &[f32], num_rows: usize) -> Result<Vec<Vec<f32>>> {
        let repacked: Vec<&Repacked> = linears
            .iter()
            .filter_map(|l| match l {
                QLinear::Repacked(r) => Some(r),
                _ => None,
            })
            .collect();
        let in_features = repacked.first().map(|r| r.in_features());
        if repacked.len() == linears.len()
            && repacked.iter().all(|r| Some(r.in_features()) == in_features)
            && in_features.is_some_and(|f| num_rows > 0 && x.len() == num_rows * f)
        {
            return Ok(Repacked::forward_many(&repacked, x, num_rows));
        }
        linears.iter().map(|l| l.forward_rows(x, num_rows)).collect()
    }

    /// `x`: `[num_rows, in_features]` row-major -> `[num_rows, out_features]`.
    pub fn forward_rows(&self, x: &[f32], num_rows: usize) -> Result<Vec<f32>> {
        match self {
            QLinear::Native { format, weight, out_features, in_features } => {
                check_input(*out_features, *in_features, x, num_rows)?;
                let data = weight.data()?;
                let rows = match format {
                    Format::Q4K | Format::Q6K => Activations::Q8K(kquants::quantize_q8k(x, *in_features)),
                    _ => Activations::Q8_0(quantize_rows(x, num_rows, *in_features)),
                };
                Ok(matmul(*format, &data, *out_features, *in_features, &rows, num_rows))
            }
            QLinear::Repacked(repacked) => {
                check_input(repacked.out_features(), repacked.in_features(), x, num_rows)?;
                Ok(repacked.forward_rows(x, num_rows))
            }
            QLinear::Candle { matmul, .. } => {
                let input = Tensor::from_slice(x, (num_rows, x.len() / num_rows.max(1)), &Device::Cpu)?;
                Ok(matmul.forward(&input)?.flatten_all()?.to_vec1()?)
            }
        }
    }
}

/// The kernels index the input unchecked: it must be `num_rows > 0` whole rows.
fn check_input(out_features: usize, in_features: usize, x: &[f32], num_rows: usize) -> Result<()> {
    if x.len() != num_rows * in_features || num_rows == 0 {
        return Err(Error::Internal(format!(
            "a [{out_features}, {in_features}] matmul got {} input values for {num_rows} rows",
            x.len()
        )));
    }
    Ok(())
}

/// `[num_rows, out_features]` = rows x weightᵀ.
fn matmul(
    format: Format,
    data: &[u8],
    out_features: usize,
    in_features: usize,
    rows: &Activations,
    num_rows: usize,
) -> Vec<f32> {
    let row_bytes = in_features / format.block_len() * format.block_bytes();
    // Feature-major scratch so each task writes one contiguous slice.
    let mut by_feature = vec![0f32; out_features * num_rows];
    for_each_chunk_mut(&mut by_feature, FEATURES_PER_TASK * num_rows, |task, chunk| {
        #[cfg(target_arch = "x86_64")]
        if let (1, Activations::Q8_0(rows)) = (num_rows, rows) {
            if avx2::available() {
                // Decoding: several weight rows against the one activation row, for independent
                // work per block (the kernel is bound by instruction latency, not bandwidth).
                for (i, out) in chunk.chunks_mut(FEATURES_PER_CALL).enumerate() {
                    let first = (task * FEATURES_PER_TASK + i * FEATURES_PER_CALL) * row_bytes;
                    let weights = &data[first..first + out.len() * row_bytes];
                    // SAFETY: features checked; `weights` holds `out.len()` rows of `row_bytes`.
                    unsafe { avx2::dot_features(format, weights, row_bytes, rows, out) };
                }
                return;
            }
        }
        for (f, out) in chunk.chunks_mut(num_rows).enumerate() {
            let feature = task * FEATURES_PER_TASK + f;
            let weight = &data[feature * row_bytes..(feature + 1) * row_bytes];
            for group_start in (0..num_rows).step_by(ROW_GROUP) {
                let group = (num_rows - group_start).min(ROW_GROUP);
                dot_rows(format, weight, rows, group_start, &mut out[group_start..group_start + group]);
            }
        }
    });
    if num_rows == 1 {
        return by_feature;
    }
    transpose(&by_feature, out_features, num_rows)
}

/// `[rows, cols]` -> `[cols, rows]`, 8 x 8 at a time: a store per value at a stride of `rows`
/// floats (a power of two, so every line lands in the same cache set) cost ~6% of prefill.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const TILE: usize = 8;
    let mut out = vec![0f32; rows * cols];
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            let (r1, c1) = ((r0 + TILE).min(rows), (c0 + TILE).min(cols));
            let mut tile = [[0f32; TILE]; TILE];
            for r in r0..r1 {
                tile[r - r0][..c1 - c0].copy_from_slice(&x[r * cols + c0..r * cols + c1]);
            }
            for c in c0..c1 {
                for r in r0..r1 {
                    out[c * rows + r] = tile[r - r0][c - c0];
                }
            }
        }
    }
    out
}

fn dot_rows(format: Format, weight: &[u8], rows: &Activations, first: usize, out: &mut [f32]) {
    match rows {
        Activations::Q8_0(rows) => {
            #[cfg(target_arch = "x86_64")]
            if avx2::available() {
                // SAFETY: the CPU supports AVX2, FMA and F16C (checked above); shapes come from
                // `matmul`.
                unsafe { avx2::dot_rows(format, weight, rows, first, out) };
                return;
            }
            scalar_dot_rows(format, weight, rows, first, out);
        }
        Activations::Q8K(rows) => {
            #[cfg(target_arch = "x86_64")]
            if kquants::avx2::available() {
                // SAFETY: features checked; shapes come from `matmul`.
                unsafe {
                    match format {
                        Format::Q4K => kquants::avx2::dot_q4k_rows(weight, rows, first, out),
                        _ => kquants::avx2::dot_q6k_rows(weight, rows, first, out),
                    }
                }
                return;
            }
            for (r, o) in out.iter_mut().enumerate() {
                *o = match format {
                    Format::Q4K => kquants::dot_q4k(weight, rows, first + r),
                    _ => kquants::dot_q6k(weight, rows, first + r),
                };
            }
        }
    }
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The signed value of element `j` of a Q5_0 or Q8_0 block.
fn signed_value(format: Format, blk: &[u8], j: usize) -> i32 {
    match format {
        Format::Q5_0 => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let nibble = if j < 16 { blk[6 + j] & 0x0F } else { blk[6 + j - 16] >> 4 };
            (nibble as i32 | (((qh >> j) & 1) << 4) as i32) - 16
        }
        _ => blk[2 + j] as i8 as i32,
    }
}

/// Reference kernel (and the path for CPUs without AVX2).
fn scalar_dot_rows(format: Format, weight: &[u8], rows: &QuantizedRows, first: usize, out: &mut [f32]) {
    let bb = format.block_bytes();
    if matches!(format, Format::Q5_0 | Format::Q8_0) {
        // llama.cpp's order: per block, 8 lanes of 4-product integer sums, each added to its own
        // f32 accumulator with a fused multiply-add; one horizontal sum at the end.
        for (r, o) in out.iter_mut().enumerate() {
            let row = first + r;
            let mut acc = [0f32; 8];
            for b in 0..rows.num_blocks {
                let blk = &weight[b * bb..(b + 1) * bb];
                let qa = &rows.qs[(row * rows.num_blocks + b) * BLOCK..][..BLOCK];
                let d = f16_at(blk, 0) * rows.scales[row * rows.num_blocks + b];
                for (lane, acc) in acc.iter_mut().enumerate() {
                    let sum: i32 = (4 * lane..4 * lane + 4).map(|j| signed_value(format, blk, j) * qa[j] as i32).sum();
                    *acc = d.mul_add(sum as f32, *acc);
                }
            }
            *o = hsum8(&acc);
        }
        return;
    }
    for (r, o) in out.iter_mut().enumerate() {
        let row = first + r;
        let mut total = 0f32;
        for b in 0..rows.num_blocks {
            let blk = &weight[b * bb..(b + 1) * bb];
            let qa = &rows.qs[(row * rows.num_blocks + b) * BLOCK..][..BLOCK];
            let (da, sa) = (rows.scales[row * rows.num_blocks + b], rows.sums[row * rows.num_blocks + b]);
            match format {
                Format::Q4_1 => {
                    let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                    let mut acc = 0i32;
                    for j in 0..16 {
                        acc += (blk[4 + j] & 0x0F) as i32 * qa[j] as i32;
                        acc += (blk[4 + j] >> 4) as i32 * qa[j + 16] as i32;
                    }
                    total += d * da * acc as f32 + m * sa;
                }
                Format::Q4_0 => {
                    let d = f16_at(blk, 0);
                    let mut acc = 0i32;
                    for j in 0..16 {
                        acc += (blk[2 + j] & 0x0F) as i32 * qa[j] as i32;
                        acc += (blk[2 + j] >> 4) as i32 * qa[j + 16] as i32;
                    }
                    total += d * da * acc as f32 - 8.0 * d * sa;
                }
                _ => unreachable!("Q5_0 and Q8_0 are summed in lanes above"),
            }
        }
        *o = total;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Format, QuantizedRows, BLOCK, FEATURES_PER_CALL, PREFETCH_BYTES, ROW_GROUP};

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

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
    pub unsafe fn dot_features(
        format: Format,
        weights: &[u8],
        row_bytes: usize,
        rows: &QuantizedRows,
        out: &mut [f32],
    ) {
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
                        let both =
                            _mm256_insertf128_si256::<1>(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4));
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(dtype: GgmlDType) {
        let in_f = if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) { 512 } else { 64 };
        let (out_f, n) = (70, 6);
        let w = Tensor::randn(0f32, 1.0, (out_f, in_f), &Device::Cpu).unwrap();
        let x = Tensor::randn(0f32, 1.0, (n, in_f), &Device::Cpu).unwrap();
        let qw = Arc::new(QTensor::quantize(&w, dtype).unwrap());
        let linear = QLinear::new(qw.clone()).unwrap();
        assert!(matches!(linear, QLinear::Native { .. }));
        let forward = |t: &Tensor| {
            let rows = t.dim(0).unwrap();
            let out = linear.forward_rows(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), rows).unwrap();
            Tensor::from_vec(out, (rows, out_f), &Device::Cpu).unwrap()
        };
        let ours = forward(&x);
        // Against the dequantized weights in f32: only the activation rounding differs.
        let exact = x.matmul(&qw.dequantize(&Device::Cpu).unwrap().t().unwrap()).unwrap();
        let err = (&ours - &exact).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(err < 0.05 * (in_f as f32).sqrt(), "{dtype:?}: max error {err}");
        // Each row equals that row computed alone, bitwise.
        for i in 0..n {
            let single = forward(&x.narrow(0, i, 1).unwrap());
            let batched = ours.narrow(0, i, 1).unwrap();
            assert_eq!(single.to_vec2::<f32>().unwrap(), batched.to_vec2::<f32>().unwrap());
        }
        // The SIMD kernel equals the scalar reference: bitwise where both follow ggml's order
        // (K-quants are checked in kquants.rs).
        let (format, data) = match &linear {
            QLinear::Native { format, weight, .. } => (*format, weight.data().unwrap().into_owned()),
            _ => unreachable!(),
        };
        if matches!(format, Format::Q4K | Format::Q6K) {
            return;
        }
        let input: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let rows = quantize_rows(&input, n, in_f);
        let row_bytes = in_f / BLOCK * format.block_bytes();
        for feature in 0..out_f {
            let wrow = &data[feature * row_bytes..(feature + 1) * row_bytes];
            let mut simd = vec![0f32; n.min(ROW_GROUP)];
            let mut scalar = simd.clone();
            dot_rows(format, wrow, &Activations::Q8_0(quantize_rows(&input, n, in_f)), 0, &mut simd);
            scalar_dot_rows(format, wrow, &rows, 0, &mut scalar);
            for (a, b) in simd.iter().zip(&scalar) {
                if matches!(format, Format::Q5_0 | Format::Q8_0) {
                    assert_eq!(a, b, "{format:?}");
                } else {
                    assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
                }
            }
        }
    }

    /// A wrong input length is an error before any kernel indexes the activations unchecked.
    #[test]
    fn wrong_input_length_is_an_error() {
        let w = Tensor::randn(0f32, 1.0, (8, 64), &Device::Cpu).unwrap();
        let linear = QLinear::new(Arc::new(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap())).unwrap();
        assert!(linear.forward_rows(&vec![0.5; 128], 2).is_ok());
        for (len, rows) in [(127, 2), (129, 2), (64, 2), (0, 0)] {
            let err = linear.forward_rows(&vec![0.5; len], rows).unwrap_err().to_string();
            assert!(err.contains("input values"), "{len} values, {rows} rows: {err}");
        }
    }

    #[test]
    fn q4k_matches_dequantized_reference() {
        check(GgmlDType::Q4K);
    }

    #[test]
    fn q6k_matches_dequantized_reference() {
        check(GgmlDType::Q6K);
    }

    #[test]
    fn q4_1_matches_dequantized_reference() {
        check(GgmlDType::Q4_1);
    }

    #[test]
    fn q4_0_matches_dequantized_reference() {
        check(GgmlDType::Q4_0);
    }

    #[test]
    fn q8_0_matches_dequantized_reference() {
        check(GgmlDType::Q8_0);
    }

    #[test]
    fn q5_0_matches_dequantized_reference() {
        check(GgmlDType::Q5_0);
    }
}
