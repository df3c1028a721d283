//! The candle backend: the same decoder block written in candle tensor ops, so it runs on any
//! candle device (CUDA, and on the CPU what the CPU backend does not run: HF safetensors
//! directories, seeded random models, GGUF with attention soft-capping). `decoder.rs` is the
//! decoder; `attention.rs` the attention it and the heads' layers (`proposer/heads/layer.rs`) run;
//! `fused.rs` the fused ops (residual add + norm, activation * up) with their CUDA kernels;
//! `paged_attention.rs` the KV write and attention of a whole step over a paged device pool.
//!
//! Invariant: it reads the same weights by the same names and loader (`model/layout.rs`,
//! `model/block.rs`) and keeps the forward contract (`model/forward.rs`): bitwise on the CPU, where
//! specrs' row-independent kernels run its matmuls (`model/kernels/`), within a stated tolerance on
//! CUDA, where cuBLAS picks kernels by shape.

pub(crate) mod attention;
pub mod decoder;
pub mod fused;
pub mod paged_attention;
