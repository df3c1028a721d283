//! The x86 AVX2 kernel set (AVX2, FMA, F16C): Q4_0/Q4_1/Q5_0/Q8_0 dots in llama.cpp's AVX2
//! orders (`qdot.rs`), Q4_K/Q6_K against Q8_K (`kquants.rs`), attention's 8-lane dots and value
//! sums (`attention.rs`), ggml's exp loops with FMA (`math.rs`). Weights are read in place.
//!
//! Invariant: every kernel equals the reference set's bitwise, except Q4_0 and Q4_1, whose
//! reference sums each block in a different order (within 1e-4 relative).

mod attention;
mod kquants;
mod math;
mod qdot;

use super::KernelSet;

pub fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

pub const KERNELS: KernelSet = KernelSet {
    name: "x86_avx2",
    qdot_rows: qdot::dot_rows,
    qdot_features: Some(qdot::dot_features),
    q8k_dot_rows: kquants::dot_rows,
    packed: None,
    scaled_dots: attention::scaled_dots,
    weighted_sum: attention::weighted_sum,
    softmax_exps: math::softmax_exps,
    swiglu: math::swiglu,
};
