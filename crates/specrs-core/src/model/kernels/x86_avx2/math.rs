//! ggml's exponential-based loops (softmax exps, SwiGLU) compiled with FMA: the same fused
//! multiply-adds as `ggml_math`'s portable code (which `f32::mul_add` rounds identically), at
//! hardware speed. The x86 AVX2 set's `softmax_exps` and `swiglu`.
//!
//! Invariant: bitwise the reference set's results.

use crate::model::kernels::ggml_math::{expf, silu};

#[target_feature(enable = "fma")]
pub unsafe fn softmax_exps(weights: &mut [f32], max: f32) {
    for w in weights.iter_mut() {
        *w = expf(*w - max);
    }
}

#[target_feature(enable = "fma")]
pub unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}
