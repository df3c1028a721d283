//! The CPU backend: GGUF models on hand-written kernels (`decoder.rs` is the block; the kernels
//! are `repack.rs` (AVX-512 VNNI, weights repacked at load) with `qlinear.rs` and `kquants.rs`
//! (AVX2, llama.cpp's summation orders) for quantized matmuls, `attention.rs`, `rope.rs`,
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
