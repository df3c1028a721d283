//! The candle backend: the same decoder block written in candle tensor ops, so it runs on any
//! candle device (CUDA, and on the CPU what the CPU backend does not run: HF safetensors
//! directories, seeded random models, GGUF with attention soft-capping). `decoder.rs` is the
//! decoder; `attention.rs` the attention it and the heads' layers (`proposer/heads/layer.rs`) run;
//! `fused.rs` the fused ops (residual add + norm, activation * up) with their CUDA kernels;
//! `paged_attention.rs` the KV write and attention of a whole step over a paged device pool;
//! `step_shape.rs` the fixed shapes a paged step is padded to for CUDA graphs; `step_graphs.rs`
//! those steps captured and replayed; `step_buffer.rs` the static buffers they write; `launches.rs`
//! (tests) holds the paged step to its budget of launches and its one upload.
//!
//! Invariant: it reads the same weights by the same names and loader (`model/layout.rs`,
//! `model/block.rs`) and keeps the forward contract (`model/forward.rs`): bitwise on the CPU, where
//! specrs' row-independent kernels run its matmuls (`model/kernels/`), within a stated tolerance on
//! CUDA, where cuBLAS picks kernels by shape.

pub(crate) mod attention;
pub mod decoder;
pub mod fused;
#[cfg(test)]
mod launches;
pub mod paged_attention;
pub(crate) mod step_buffer;
pub mod step_graphs;
pub mod step_shape;

use candle_core::{Device, Tensor};

use crate::error::Result;

#[cfg(test)]
thread_local! {
    /// u32 arrays this thread's forwards uploaded (the launch count's, `launches.rs`).
    pub(crate) static UPLOADS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// `values` on `device`: every host-to-device copy of a decoder forward goes through here, so
/// its uploads can be counted (a paged step makes one).
pub(crate) fn upload(values: &[u32], device: &Device) -> Result<Tensor> {
    count_upload();
    Ok(Tensor::new(values, device)?)
}

/// Counts one host-to-device copy for the tests (`UPLOADS`); every upload a step makes calls it,
/// through `upload` or beside its own copy (the acceptance kernel's descriptor, `batch/cuda.rs`).
pub(crate) fn count_upload() {
    #[cfg(test)]
    UPLOADS.with(|n| n.set(n.get() + 1));
}

/// The decoder's own kernels on random inputs on `device` against their CPU references: the
/// fused ops and the paged KV write and attention. `(op and case, largest absolute difference,
/// tolerance)`; on the CPU each reference meets itself (every difference 0), and the device
/// check (`scripts/gpu_bench.py`) runs it on a GPU.
pub fn check_kernels_against_references(device: &Device) -> Result<Vec<(String, f32, f32)>> {
    let mut report = fused::check_against_reference(device)?;
    report.extend(paged_attention::check_against_reference(device)?);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU the check compares each reference with itself: every difference is zero.
    #[test]
    fn the_kernel_check_runs_on_the_cpu() {
        for (name, diff, _) in check_kernels_against_references(&Device::Cpu).unwrap() {
            assert_eq!(diff, 0.0, "{name}");
        }
    }

    /// On a machine with a GPU: the kernels against their references (gpu_bench's check).
    #[cfg(feature = "cuda")]
    #[test]
    fn the_kernels_match_their_references_on_a_gpu() {
        if !crate::nvrtc::gpu_present() {
            return;
        }
        let device = crate::nvrtc::open(0).unwrap();
        for (name, diff, tolerance) in check_kernels_against_references(&device).unwrap() {
            assert!(diff <= tolerance, "{name}: {diff} > {tolerance}");
        }
    }
}
