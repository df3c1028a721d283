//! The CPU backend: GGUF models computed as llama.cpp's CPU backend computes one token, with
//! hand-written AVX2 kernels in llama.cpp's summation orders (`decoder.rs` is the block; the
//! kernels are `qlinear.rs` and `kquants.rs` for quantized matmuls, `attention.rs`, `rope.rs`,
//! `ggml_math.rs`, and `parallel.rs` splits their work across cores).
//!
//! Invariant: every kernel is row-independent (a row's result never depends on the other rows
//! it is computed with), which is what makes a forward's rows bitwise invariant
//! (`model/forward.rs`).

pub mod attention;
pub mod decoder;
pub mod ggml_math;
pub mod kquants;
pub mod parallel;
pub mod qlinear;
pub mod repack;
pub mod rope;
