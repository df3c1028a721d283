//! The GGUF weight formats specrs's own kernels read (`Format`), with their ggml block sizes.
//!
//! Invariant: the byte layouts described here are ggml's; every kernel (`qlinear.rs`,
//! `kquants.rs`, `repack.rs`) indexes weight bytes by `block_bytes` and `block_len`.

use super::kquants::{Q4K_BYTES, Q6K_BYTES, QK_K};

/// Values per block of the 32-value formats (Q4_0, Q4_1, Q5_0, Q8_0, and activations' Q8_0).
pub(crate) const BLOCK: usize = 32;

/// Weight formats with a native kernel. Block layouts follow ggml.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `{ d: f16, qs: [u8; 16] }`: x = d * (nibble - 8); nibble j is element j (low) / j+16 (high).
    /// Computed as Q4_1 with m = -8d (through the activation block sums), so unlike Q4_1 and Q8_0
    /// it does not match llama.cpp bitwise; it serves drafts, which need no bitwise agreement.
    Q4_0,
    /// `{ d: f16, m: f16, qs: [u8; 16] }`: x = d * nibble + m; nibble j is element j (low) / j+16 (high).
    Q4_1,
    /// `{ d: f16, qh: u32, qs: [u8; 16] }`: x = d * (q - 16), q = nibble | bit j of qh << 4 for
    /// element j (nibbles as Q4_0).
    Q5_0,
    /// `{ d: f16, qs: [i8; 32] }`: x = d * q.
    Q8_0,
    /// 256-value super-blocks, `kquants.rs`.
    Q4K,
    Q6K,
}

impl Format {
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q8_0 => 34,
            Format::Q4K => Q4K_BYTES,
            Format::Q6K => Q6K_BYTES,
        }
    }

    /// Values per block.
    pub(crate) fn block_len(self) -> usize {
        match self {
            Format::Q4K | Format::Q6K => QK_K,
            _ => BLOCK,
        }
    }
}
