//! The dense matmul dots with 8-lane AVX2 vectors (the x86 AVX2 set's `dense_dots`): eight dot
//! products at a time, each in its own accumulator, so the fused multiply-adds of one never wait
//! on another's; 2 weight rows x 4 activation rows per block when there are several rows (6 loads
//! per 8 multiply-adds), 8 weight rows against the one row when decoding. bf16 and f16 weights
//! are widened in registers as they are loaded (a shift; F16C), so a step reads them in their size.
//!
//! Invariant: every output equals `reference::dot_f32` of the widened row bitwise (the same 8
//! lanes, the same `reduce_lanes` tree, then the tail's chain), whichever block computes it.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::attention::reduce_8x8;
use crate::model::kernels::dense::DenseWeight;

/// A weight element type: 8 of them widened into a vector, one into an f32 (both exact).
trait Widen: Copy {
    /// # Safety
    /// `p` points at 8 readable values, on a CPU with AVX2 and F16C.
    unsafe fn load8(p: *const Self) -> __m256;
    fn widen(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        unsafe { _mm256_loadu_ps(p) }
    }
    fn widen(self) -> f32 {
        self
    }
}

impl Widen for bf16 {
    /// bf16 is an f32's upper half.
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> __m256 {
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
        }
    }
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Widen for f16 {
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// `reference::dense_dots`, in blocks of `F` weight rows x `R` activation rows (`F * R <= 8`).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dense_dots(weights: DenseWeight, x: &[f32], in_features: usize, out: &mut [f32], out_stride: usize) {
    unsafe {
        match weights {
            DenseWeight::F32(w) => dots(w, x, in_features, out, out_stride),
            DenseWeight::Bf16(w) => dots(w, x, in_features, out, out_stride),
            DenseWeight::F16(w) => dots(w, x, in_features, out, out_stride),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots<T: Widen>(weights: &[T], x: &[f32], in_features: usize, out: &mut [f32], out_stride: usize) {
    let (features, rows) = (weights.len() / in_features, x.len() / in_features);
    // The loads below are unchecked: every block lies inside the slices.
    assert!(
        weights.len() == features * in_features
            && x.len() == rows * in_features
            && (features == 0 || rows == 0 || out.len() >= (features - 1) * out_stride + rows),
        "dense_dots: {} weights, {} inputs of {in_features}, {} outputs {out_stride} apart",
        weights.len(),
        x.len(),
        out.len()
    );
    let blocks = Blocks { weights, x, in_features, out_stride };
    unsafe {
        if rows == 1 {
            let whole = features / 8 * 8;
            (0..whole).step_by(8).for_each(|f| blocks.run::<8, 1>(f, 0, out));
            (whole..features).for_each(|f| blocks.run::<1, 1>(f, 0, out));
            return;
        }
        let (whole_f, whole_r) = (features / 2 * 2, rows / 4 * 4);
        for f in (0..whole_f).step_by(2) {
            (0..whole_r).step_by(4).for_each(|r| blocks.run::<2, 4>(f, r, out));
            (whole_r..rows).for_each(|r| blocks.run::<2, 1>(f, r, out));
        }
        for f in whole_f..features {
            (0..whole_r).step_by(4).for_each(|r| blocks.run::<1, 4>(f, r, out));
            (whole_r..rows).for_each(|r| blocks.run::<1, 1>(f, r, out));
        }
    }
}

struct Blocks<'a, T> {
    weights: &'a [T],
    x: &'a [f32],
    in_features: usize,
    out_stride: usize,
}

impl<T: Widen> Blocks<'_, T> {
    /// Weight rows `f0..f0 + F` against activation rows `r0..r0 + R`, which must exist.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run<const F: usize, const R: usize>(&self, f0: usize, r0: usize, out: &mut [f32]) {
        let n = self.in_features;
        let full = n / 8 * 8;
        let (w, xs) = (self.weights.as_ptr(), self.x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 8];
        for d in (0..full).step_by(8) {
            for f in 0..F {
                let a = unsafe { T::load8(w.add((f0 + f) * n + d)) };
                for r in 0..R {
                    let b = unsafe { _mm256_loadu_ps(xs.add((r0 + r) * n + d)) };
                    acc[f * R + r] = _mm256_fmadd_ps(a, b, acc[f * R + r]);
                }
            }
        }
        let mut sums = [0f32; 8];
        unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), reduce_8x8(acc)) };
        for f in 0..F {
            for r in 0..R {
                let (weight, row) = (&self.weights[(f0 + f) * n..][..n], &self.x[(r0 + r) * n..][..n]);
                let tail = weight[full..].iter().zip(&row[full..]);
                out[(f0 + f) * self.out_stride + r0 + r] =
                    tail.fold(sums[f * R + r], |s, (a, b)| a.widen().mul_add(*b, s));
            }
        }
    }
}
