//! Linear layers over GGUF quantized weights, on the kernel set `kernels()` chose. Where the set
//! repacks weights (AVX-512 VNNI and AVX2) the weights of every type below are repacked at load and run on
//! its packed kernel (`repack.rs`); elsewhere (and for matrices whose row count is not a multiple
//! of 8) the set's dots run them in place: Q4_0, Q4_1, Q5_0, Q8_0 (32-value blocks, activations
//! quantized to Q8_0 here) and Q4_K, Q6_K (256-value super-blocks, activations quantized to
//! Q8_K, `kquants.rs`).
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
use super::kquants::{self, Q8KRows, ROW_GROUP};
use super::parallel::for_each_chunk_mut;
use super::repack::{self, Repacked};
use super::{checked_kernels, KernelSet, PackedKernels};
use crate::error::{Error, Result};

/// Output features per parallel work item.
const FEATURES_PER_TASK: usize = 16;
/// Weight rows one kernel call dots with a single activation row (decoding).
pub(crate) const FEATURES_PER_CALL: usize = 8;
/// How far ahead of the block being read the kernel prefetches weight bytes.
pub(crate) const PREFETCH_BYTES: usize = 512;

/// Activation rows quantized for one weight format.
enum Activations {
    Q8_0(QuantizedRows),
    Q8K(Q8KRows),
}

/// One activation row quantized to int8 blocks: `scales[b]` = d (f16-rounded), `sums[b]` =
/// d * sum(qs) (f16-rounded, the Q8_1 "s" used with Q4_1's offset).
pub struct QuantizedRows {
    pub(crate) qs: Vec<i8>,
    pub(crate) scales: Vec<f32>,
    pub(crate) sums: Vec<f32>,
    pub(crate) num_blocks: usize,
}

impl QuantizedRows {
    /// Whether rows `0..num_rows` are all here (what the unchecked kernels read).
    pub(crate) fn holds(&self, num_rows: usize) -> bool {
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
        /// The set whose kernels run it (the one chosen at load).
        kernels: &'static KernelSet,
    },
    /// Repacked into 8-row tiles for the set's packed kernel (`repack.rs`).
    Repacked {
        weight: Repacked,
        /// The packed kernels of the set chosen at load.
        kernels: &'static PackedKernels,
    },
    Candle {
        matmul: QMatMul,
        out_features: usize,
    },
}

impl QLinear {
    /// `weight` on the process's kernel set (`kernels()`); a `ConfigError` if
    /// `SPECRS_CPU_KERNELS` names a set this CPU does not run.
    pub fn new(weight: Arc<QTensor>) -> Result<Self> {
        if matches!(weight.device(), Device::Cpu) {
            return Self::with_kernels(weight, checked_kernels()?);
        }
        // Off the CPU: candle's kernels (`with_kernels` picks them for any non-CPU tensor).
        Self::with_kernels(weight, &super::reference::KERNELS)
    }

    /// `weight` on `kernels`, a set this CPU runs (`available_sets`): tests compare the sets.
    pub fn with_kernels(weight: Arc<QTensor>, kernels: &'static KernelSet) -> Result<Self> {
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
                if let Some(packed) = &kernels.packed {
                    if repack::supports(format) && out_features % repack::TILE_ROWS == 0 {
                        let data = weight.data()?;
                        let weight = Repacked::new(format, &data, out_features, in_features);
                        return Ok(QLinear::Repacked { weight, kernels: packed });
                    }
                }
                Ok(QLinear::Native { format, weight, out_features, in_features, kernels })
            }
            _ => Ok(QLinear::Candle { matmul: QMatMul::from_arc(weight)?, out_features }),
        }
    }

    /// Bytes of this weight held in memory, all of which one forward reads.
    pub fn resident_bytes(&self) -> usize {
        match self {
            QLinear::Native { weight, .. } => weight.storage_size_in_bytes(),
            QLinear::Repacked { weight, .. } => weight.resident_bytes(),
            QLinear::Candle { matmul, .. } => match matmul {
                QMatMul::QTensor(t) => t.storage_size_in_bytes(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.elem_count() * t.dtype().size_in_bytes(),
            },
        }
    }

    /// Rows `features` of a repacked weight dequantized (`[features.len(), in_features]`, the
    /// values of ggml's dequantization): a tied LM head serves the embedding lookup from its
    /// tiles instead of a second copy of the table. None for the other kinds.
    pub fn dequantize_rows(&self, features: &[u32]) -> Option<Vec<f32>> {
        let QLinear::Repacked { weight, .. } = self else { return None };
        Some(features.iter().flat_map(|&f| weight.dequantize_row(f as usize)).collect())
    }

    /// The quantized tensor it reads in place, where it keeps one (not a repacked weight).
    pub fn qtensor(&self) -> Option<Arc<QTensor>> {
        match self {
            QLinear::Native { weight, .. } => Some(weight.clone()),
            QLinear::Candle { matmul: QMatMul::QTensor(weight), .. } => Some(weight.clone()),
            QLinear::Repacked { .. } | QLinear::Candle { .. } => None,
        }
    }

    /// Whether specrs' own kernel runs it (else candle's `QMatMul`).
    pub fn is_native(&self) -> bool {
        !matches!(self, QLinear::Candle { .. })
    }

    pub fn out_features(&self) -> usize {
        match self {
            QLinear::Native { out_features, .. } | QLinear::Candle { out_features, .. } => *out_features,
            QLinear::Repacked { weight, .. } => weight.out_features(),
        }
    }

    /// Several weights applied to the same `x` (`[num_rows, in_features]`): one
    /// `[num_rows, out_features]` per weight. Repacked weights share one activation quantization
    /// and one parallel region; the results are those of `forward_rows`, bitwise.
    pub fn forward_many(linears: &[&QLinear], x: &[f32], num_rows: usize) -> Result<Vec<Vec<f32>>> {
        let repacked: Vec<(&Repacked, &'static PackedKernels)> = linears
            .iter()
            .filter_map(|l| match l {
                QLinear::Repacked { weight, kernels } => Some((weight, *kernels)),
                _ => None,
            })
            .collect();
        let first = repacked.first().map(|&(r, kernels)| (r.in_features(), kernels));
        if let Some((in_features, kernels)) = first {
            if repacked.len() == linears.len()
                && repacked.iter().all(|&(r, k)| r.in_features() == in_features && std::ptr::eq(k, kernels))
                && num_rows > 0
                && x.len() == num_rows * in_features
            {
                let weights: Vec<&Repacked> = repacked.iter().map(|&(r, _)| r).collect();
                return Ok(Repacked::forward_many(kernels, &weights, x, num_rows));
            }
        }
        linears.iter().map(|l| l.forward_rows(x, num_rows)).collect()
    }

    /// `x`: `[num_rows, in_features]` row-major -> `[num_rows, out_features]`.
    pub fn forward_rows(&self, x: &[f32], num_rows: usize) -> Result<Vec<f32>> {
        match self {
            QLinear::Native { format, weight, out_features, in_features, kernels } => {
                check_input(*out_features, *in_features, x, num_rows)?;
                let data = weight.data()?;
                let rows = match format {
                    Format::Q4K | Format::Q6K => Activations::Q8K(kquants::quantize_q8k(x, *in_features)),
                    _ => Activations::Q8_0(quantize_rows(x, num_rows, *in_features)),
                };
                Ok(matmul(kernels, *format, &data, *out_features, *in_features, &rows, num_rows))
            }
            QLinear::Repacked { weight, kernels } => {
                check_input(weight.out_features(), weight.in_features(), x, num_rows)?;
                Ok(weight.forward_rows(kernels, x, num_rows))
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
    kernels: &KernelSet,
    format: Format,
    data: &[u8],
    out_features: usize,
    in_features: usize,
    rows: &Activations,
    num_rows: usize,
) -> Vec<f32> {
    let row_bytes = in_features / format.block_len() * format.block_bytes();
    by_feature_tasks(out_features, num_rows, FEATURES_PER_TASK, |task, chunk| {
        if let (1, Activations::Q8_0(rows), Some(dot_features)) = (num_rows, rows, kernels.qdot_features) {
            // Decoding: several weight rows against the one activation row, for independent
            // work per block (the kernel is bound by instruction latency, not bandwidth).
            for (i, out) in chunk.chunks_mut(FEATURES_PER_CALL).enumerate() {
                let first = (task * FEATURES_PER_TASK + i * FEATURES_PER_CALL) * row_bytes;
                let weights = &data[first..first + out.len() * row_bytes];
                // SAFETY: the set runs on this CPU (`QLinear::with_kernels`); `weights` holds
                // `out.len()` rows of `row_bytes`.
                unsafe { dot_features(format, weights, row_bytes, rows, out) };
            }
            return;
        }
        for (f, out) in chunk.chunks_mut(num_rows).enumerate() {
            let feature = task * FEATURES_PER_TASK + f;
            let weight = &data[feature * row_bytes..(feature + 1) * row_bytes];
            for group_start in (0..num_rows).step_by(ROW_GROUP) {
                let group = (num_rows - group_start).min(ROW_GROUP);
                dot_rows(kernels, format, weight, rows, group_start, &mut out[group_start..group_start + group]);
            }
        }
    })
}

/// A matmul's `[num_rows, out_features]` output from parallel tasks over its features:
/// `task(index, chunk)` fills features `index * features_per_task..` (the last task may have
/// fewer), feature-major (`chunk`: `[features, num_rows]`), so each task writes one contiguous
/// slice; the result is transposed back.
pub(super) fn by_feature_tasks<F>(out_features: usize, num_rows: usize, features_per_task: usize, task: F) -> Vec<f32>
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let mut by_feature = vec![0f32; out_features * num_rows];
    for_each_chunk_mut(&mut by_feature, features_per_task * num_rows, task);
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

/// One weight row against activation rows `first..first + out.len()` (at most `ROW_GROUP`).
fn dot_rows(kernels: &KernelSet, format: Format, weight: &[u8], rows: &Activations, first: usize, out: &mut [f32]) {
    // SAFETY: the set runs on this CPU (`QLinear::with_kernels`); `weight` is one row of
    // `format` and the rows exist (shapes come from `matmul`, the kernels assert them).
    unsafe {
        match rows {
            Activations::Q8_0(rows) => (kernels.qdot_rows)(format, weight, rows, first, out),
            Activations::Q8K(rows) => (kernels.q8k_dot_rows)(format, weight, rows, first, out),
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
        let (format, data, kernels) = match &linear {
            QLinear::Native { format, weight, kernels, .. } => (*format, weight.data().unwrap().into_owned(), *kernels),
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
            dot_rows(kernels, format, wrow, &Activations::Q8_0(quantize_rows(&input, n, in_f)), 0, &mut simd);
            super::super::reference::scalar_dot_rows(format, wrow, &rows, 0, &mut scalar);
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
