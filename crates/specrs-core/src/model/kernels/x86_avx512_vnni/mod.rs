//! The x86 AVX-512 VNNI kernel set: the AVX2 set with every supported weight repacked at load
//! into 8-row tiles and multiplied by `packed.rs`'s `vpdpbusd` kernel (`repack.rs` describes the
//! layout and the arithmetic). Matrices that cannot be repacked (rows not a multiple of 8) and
//! everything else run the AVX2 set's kernels.
//!
//! Invariant: the packed kernel equals `repack::reference_dot` bitwise; the rest is the AVX2 set.

mod packed;

use super::{KernelSet, PackedKernels};

/// AVX-512 F/BW/VL/VNNI (256-bit vectors) on top of the AVX2 set's AVX2, FMA and F16C.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && super::x86_avx2::available()
}

pub const KERNELS: KernelSet = KernelSet {
    name: "x86_avx512_vnni",
    packed: Some(PackedKernels { groups: packed::groups, quantize_block: packed::quantize_block }),
    ..super::x86_avx2::KERNELS
};
