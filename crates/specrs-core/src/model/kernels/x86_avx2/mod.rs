//! The x86 AVX2 kernel set (AVX2, FMA, F16C): every supported weight repacked at load into
//! `repack.rs`'s 8-row tiles and multiplied by `packed.rs` (`vpmaddubsw` dots; bitwise the AVX-512
//! VNNI set's results); for matrices that cannot be repacked, Q4_0/Q4_1/Q5_0/Q8_0 dots in
//! llama.cpp's AVX2 orders (`qdot.rs`) and Q4_K/Q6_K against Q8_K (`kquants.rs`); attention's
//! 8-lane dots and value sums (`attention.rs`), ggml's exp loops with FMA (`math.rs`), dense
//! matmul dots in blocks of eight (`dense.rs`).
//!
//! Invariant: every kernel equals the reference set's bitwise, except Q4_0 and Q4_1 in place,
//! whose reference sums each block in a different order (within 1e-4 relative).

mod attention;
mod dense;
mod kquants;
mod math;
mod packed;
mod qdot;

use super::{KernelSet, PackedKernels};

pub fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

pub const KERNELS: KernelSet = KernelSet {
    name: "x86_avx2",
    qdot_rows: qdot::dot_rows,
    qdot_features: Some(qdot::dot_features),
    q8k_dot_rows: kquants::dot_rows,
    packed: Some(PackedKernels { groups: packed::groups, quantize_block: packed::quantize_block }),
    scaled_dots: attention::scaled_dots,
    weighted_sum: attention::weighted_sum,
    softmax_exps: math::softmax_exps,
    swiglu: math::swiglu,
    dense_dots: dense::dense_dots,
};
