//! Batched kernels: many sequences' acceptance (of a draft chain or a token tree) or n-gram lookup in
//! one call.
//!
//! Each concept has a CPU reference here, written as plainly as possible and tested in CI; the CUDA
//! kernels in `cuda/` compute the same function on the device (`cuda.rs`, with the `cuda` feature),
//! and the device check (`scripts/gpu_check.py`) compares the two on random inputs.

pub mod accept;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ngram;
pub mod tree_accept;
