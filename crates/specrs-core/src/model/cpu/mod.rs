//! The CPU backend: GGUF models on specrs's own kernels (`decoder.rs` is the decoder, its block's
//! weights loaded by `model/block.rs`; the kernels it runs are in `model/kernels/`, the rotary
//! embedding in `model/rope.rs`).
//!
//! Invariant: every kernel is row-independent (a row's result never depends on the other rows
//! it is computed with), which is what makes a forward's rows bitwise invariant
//! (`model/forward.rs`).

pub mod decoder;
