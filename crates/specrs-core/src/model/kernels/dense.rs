//! Dense (f32, bf16, f16) matmuls on the CPU, for candle's decoder: the weights of HF safetensors
//! directories and seeded random models. candle's own CPU gemm picks its blocking by the number
//! of rows, so a row's output changed with its batch-mates (up to a bf16 step at 2 rows vs 1, a
//! quarter of one at 16): a k+1-token verify did not round as k+1 single steps, and greedy
//! speculation differed from plain greedy decoding at near-ties. Here every output is one dot
//! product summed in one fixed order (`KernelSet::dense_dots`), whatever else is computed with it.
//!
//! A task's weight rows are dotted with the activation rows `ROWS_PER_BLOCK` at a time, widened
//! to f32 as they are loaded (exact: every bf16 and f16 is an f32), so a decode step reads each
//! weight once, in its stored size, and a prefill chunk re-reads only activations.
//!
//! Invariant: `out[r][f] = dot(x row r, weight row f)` in `reference::dot_f32`'s order, bitwise
//! the same for every kernel set and every `num_rows`.

use candle_core::{CpuStorage, DType, Storage, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::qlinear::by_feature_tasks;
use super::KernelSet;
use crate::error::{Error, Result};

/// Weight rows per parallel task, reused by every activation block.
const FEATURES_PER_TASK: usize = 16;
/// Activation rows dotted with a task's weights at once: 64 rows of 4096 f32 stay in L2.
const ROWS_PER_BLOCK: usize = 64;

/// A `[out_features, in_features]` row-major weight in its stored type.
#[derive(Clone, Copy)]
pub enum DenseWeight<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> DenseWeight<'a> {
    pub(crate) fn len(&self) -> usize {
        match self {
            DenseWeight::F32(w) => w.len(),
            DenseWeight::Bf16(w) => w.len(),
            DenseWeight::F16(w) => w.len(),
        }
    }

    /// Values `start..start + len`.
    fn slice(&self, start: usize, len: usize) -> DenseWeight<'a> {
        match *self {
            DenseWeight::F32(w) => DenseWeight::F32(&w[start..start + len]),
            DenseWeight::Bf16(w) => DenseWeight::Bf16(&w[start..start + len]),
            DenseWeight::F16(w) => DenseWeight::F16(&w[start..start + len]),
        }
    }

    /// Values `start..start + out.len()` as f32 into `out`: exact, every bf16 and f16 is an f32.
    pub(crate) fn widen_into(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            DenseWeight::F32(w) => out.copy_from_slice(&w[start..end]),
            DenseWeight::Bf16(w) => w[start..end].convert_to_f32_slice(out),
            DenseWeight::F16(w) => w[start..end].convert_to_f32_slice(out),
        }
    }
}

/// `x`: `[num_rows, in_features]` row-major -> `[num_rows, out_features]`.
pub fn matmul(
    kernels: &KernelSet,
    weight: DenseWeight,
    out_features: usize,
    in_features: usize,
    x: &[f32],
    num_rows: usize,
) -> Result<Vec<f32>> {
    if weight.len() != out_features * in_features || x.len() != num_rows * in_features || num_rows == 0 {
        return Err(Error::Internal(format!(
            "a [{out_features}, {in_features}] dense matmul of {} values got {} input values for {num_rows} rows",
            weight.len(),
            x.len()
        )));
    }
    Ok(by_feature_tasks(out_features, num_rows, FEATURES_PER_TASK, |task, chunk| {
        let features = chunk.len() / num_rows;
        let rows = weight.slice(task * FEATURES_PER_TASK * in_features, features * in_features);
        for first in (0..num_rows).step_by(ROWS_PER_BLOCK) {
            let block = ROWS_PER_BLOCK.min(num_rows - first);
            let x = &x[first * in_features..(first + block) * in_features];
            // SAFETY: `kernels` runs on this CPU (the caller's); `rows` holds `features` rows and
            // `x` `block` rows of `in_features`; `chunk` holds `features` rows of `num_rows`,
            // which the kernel writes from column `first`.
            unsafe { (kernels.dense_dots)(rows, x, in_features, &mut chunk[first..], num_rows) };
        }
    }))
}

/// `x @ weightᵀ` for a contiguous `[out_features, in_features]` CPU tensor in f32, bf16 or f16
/// and `x`: `[n, in_features]` -> `[n, out_features]` in `x`'s dtype. None for any other weight
/// (not on the CPU, not contiguous, another dtype): the caller's own matmul runs it.
pub fn forward(kernels: &KernelSet, weight: &Tensor, x: &Tensor) -> Result<Option<Tensor>> {
    let (out_features, in_features) = weight.dims2()?;
    let (storage, layout) = weight.storage_and_layout();
    let (Storage::Cpu(storage), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return Ok(None);
    };
    let weight_rows = match storage {
        CpuStorage::F32(w) => DenseWeight::F32(&w[start..end]),
        CpuStorage::BF16(w) => DenseWeight::Bf16(&w[start..end]),
        CpuStorage::F16(w) => DenseWeight::F16(&w[start..end]),
        _ => return Ok(None),
    };
    let num_rows = x.dim(0)?;
    let input = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let out = matmul(kernels, weight_rows, out_features, in_features, &input, num_rows)?;
    Ok(Some(Tensor::from_vec(out, (num_rows, out_features), x.device())?.to_dtype(x.dtype())?))
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::model::kernels::tests::random;
    use crate::model::kernels::{available_sets, reference};

    fn widen(weight: DenseWeight, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        weight.widen_into(0, &mut out);
        out
    }

    #[test]
    fn every_row_is_its_dot_product_alone_in_every_set_and_dtype() {
        // 70 features: tasks of 16 and a short last one; 100 rows: an activation block of 64
        // and a short one; 520 inputs: not a multiple of 8 (the kernels' scalar tail).
        let (out_f, in_f, rows) = (70, 520, 100);
        let w32 = random(out_f * in_f, 5);
        let wbf: Vec<bf16> = w32.iter().map(|&v| bf16::from_f32(v)).collect();
        let wf16: Vec<f16> = w32.iter().map(|&v| f16::from_f32(v)).collect();
        let x = random(rows * in_f, 9);
        for weight in [DenseWeight::F32(&w32), DenseWeight::Bf16(&wbf), DenseWeight::F16(&wf16)] {
            let wide = widen(weight, out_f * in_f);
            // What every set must give, row by row: reference::dot_f32 of that row and feature.
            let expected: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let (x, wide) = (&x, &wide);
                    (0..out_f)
                        .map(move |f| reference::dot_f32(&wide[f * in_f..(f + 1) * in_f], &x[r * in_f..(r + 1) * in_f]))
                })
                .collect();
            for set in available_sets() {
                for num_rows in [1, 2, 5, 64, 65, rows] {
                    let got = matmul(set, weight, out_f, in_f, &x[..num_rows * in_f], num_rows).unwrap();
                    assert_eq!(got, expected[..num_rows * out_f], "{} at {num_rows} rows", set.name);
                }
                // ... and the sum itself is a dot product (against f64, to f32 rounding).
                let got = matmul(set, weight, out_f, in_f, &x, rows).unwrap();
                for (i, g) in got.iter().enumerate() {
                    let (r, f) = (i / out_f, i % out_f);
                    let exact: f64 = (0..in_f).map(|d| wide[f * in_f + d] as f64 * x[r * in_f + d] as f64).sum();
                    let scale: f64 =
                        (0..in_f).map(|d| (wide[f * in_f + d] as f64 * x[r * in_f + d] as f64).abs()).sum();
                    assert!((*g as f64 - exact).abs() <= 1e-5 * scale, "{} row {r} feature {f}", set.name);
                }
            }
        }
    }

    #[test]
    fn tensors_run_here_in_their_dtype_and_others_are_left_to_candle() {
        let (out_f, in_f) = (24, 64);
        let w = Tensor::from_vec(random(out_f * in_f, 2), (out_f, in_f), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(random(3 * in_f, 3), (3, in_f), &Device::Cpu).unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (w, x) = (w.to_dtype(dtype).unwrap(), x.to_dtype(dtype).unwrap());
            let got = forward(&reference::KERNELS, &w, &x).unwrap().expect("a dense CPU weight");
            assert_eq!((got.dims2().unwrap(), got.dtype()), ((3, out_f), dtype));
            let candle = x.to_dtype(DType::F32).unwrap().matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
            let largest = candle.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let diff = (got.to_dtype(DType::F32).unwrap() - candle).unwrap().abs().unwrap().max_all().unwrap();
            // The output's own rounding: half a step of 8 (bf16) or 11 (f16) significant bits.
            let relative = match dtype {
                DType::BF16 => 2f32.powi(-8),
                DType::F16 => 2f32.powi(-11),
                _ => 1e-6,
            };
            assert!(diff.to_scalar::<f32>().unwrap() <= relative * largest, "{dtype:?}");
        }
        // A transposed view is not contiguous: candle's matmul keeps it.
        assert!(forward(&reference::KERNELS, &w.t().unwrap(), &x.narrow(1, 0, out_f).unwrap()).unwrap().is_none());
        let ints = Tensor::zeros((out_f, in_f), DType::U32, &Device::Cpu).unwrap();
        assert!(forward(&reference::KERNELS, &ints, &x).unwrap().is_none());
    }
}
