//! The AVX2 set's `PackedKernels`: `packed_tiles.rs`'s tile kernel with `vpmaddubsw` + `vpmaddwd`
//! per 4-byte dot (as llama.cpp's own AVX2 repack does), and the activations' int8 quantization
//! (`repack::scalar_quantize`, one block at a time).
//!
//! Why exact: `vpmaddubsw` adds two u8 x i8 products into a saturating i16. The tiles' unsigned
//! values stay below 64 (4-, 5- and 6-bit formats; |q| <= 127: at most 2 * 63 * 127 = 16,002) and
//! Q8_0's signed values go through `dot_offset_bytes` (|w| * sign(q, w): at most 2 * 128 * 127 =
//! 32,512), so nothing saturates and every dot is the exact integer the VNNI set computes: the two
//! sets' outputs are bitwise equal.
//!
//! Invariant: equal bitwise to `repack::reference_dot` (and `repack::scalar_quantize`).

use crate::model::kernels::format::BLOCK;
use crate::model::kernels::packed_tiles::packed_tile_kernel;

packed_tile_kernel!("avx2,fma,f16c", avx2);

/// The 4-byte dots of this set (`packed_tiles.rs` names the contract).
mod avx2 {
    use std::arch::x86_64::*;

    pub const UNSIGNED_BYTES_EXACT: bool = false;

    /// Pairs of u8 x i8 products to i16 (exact for u < 128), then pairs of those to i32.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn dpbusd(acc: __m256i, u: __m256i, q: __m256i) -> __m256i {
        let pairs = _mm256_maddubs_epi16(u, q);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// The dots of w = u - 128 and q: |w| as unsigned times q with w's sign.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_offset_bytes(acc: __m256i, u: __m256i, q: __m256i) -> __m256i {
        let w = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
        let pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w));
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }

    /// Bit i of `bits` spread to byte i (0xFF or 0), as llama.cpp's `bytes_from_bits_32`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn add_where_bits(v: __m256i, bits: u32, x: __m256i) -> __m256i {
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0),
        );
        let all_but_one = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
        let mask = _mm256_cmpeq_epi8(_mm256_or_si256(spread, all_but_one), _mm256_set1_epi64x(-1));
        _mm256_add_epi8(v, _mm256_and_si256(mask, x))
    }
}

/// `repack::scalar_quantize`: the set's `PackedKernels::quantize_block` (a block of 32 values
/// per call; the matmuls dominate).
///
/// # Safety
/// None beyond the type's: it is plain Rust.
pub unsafe fn quantize_block(block: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> f32 {
    crate::model::kernels::repack::scalar_quantize(block, q)
}
