//! specrs's own CPU kernels, shared by every backend that runs GGUF weights on the CPU (the CPU
//! decoder `model/cpu/`, candle's CPU path, the heads): quantized matmuls (`qlinear.rs`, with
//! `repack.rs` (AVX-512 VNNI, weights repacked at load) and `kquants.rs` (AVX2, llama.cpp's
//! summation orders)), attention over the f16 cache (`attention.rs`), ggml's exp/SiLU/GELU
//! (`ggml_math.rs`), and `parallel.rs`, which splits their work across cores. `format.rs` names
//! the weight formats they read.
//!
//! Invariant: every kernel is row-independent (a row's result never depends on the other rows
//! it is computed with), which is what makes a forward's rows bitwise invariant
//! (`model/forward.rs`).

pub mod attention;
pub mod format;
pub mod ggml_math;
pub mod kquants;
pub mod parallel;
pub mod qlinear;
pub mod repack;
