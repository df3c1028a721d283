//! The AVX-512 VNNI set's `PackedKernels`: `packed_tiles.rs`'s tile kernel with one `vpdpbusd`
//! per 4-byte dot, and the activations' int8 quantization with 16-lane vectors.
//!
//! Invariant: equal bitwise to `repack::reference_dot` (and `repack::scalar_quantize`).

use crate::model::kernels::format::BLOCK;
use crate::model::kernels::packed_tiles::packed_tile_kernel;

packed_tile_kernel!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", vnni);

/// The 4-byte dots of this set (`packed_tiles.rs` names the contract).
mod vnni {
    use std::arch::x86_64::*;

    pub const UNSIGNED_BYTES_EXACT: bool = true;

    #[inline]
    #[target_feature(enable = "avx512vl,avx512vnni")]
    pub unsafe fn dpbusd(acc: __m256i, u: __m256i, q: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, u, q)
    }

    /// Unused here (`UNSIGNED_BYTES_EXACT`); `dpbusd` with the offset taken out.
    #[inline]
    #[target_feature(enable = "avx512vl,avx512vnni")]
    pub unsafe fn dot_offset_bytes(acc: __m256i, u: __m256i, q: __m256i) -> __m256i {
        let sum_q = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), q);
        _mm256_sub_epi32(_mm256_dpbusd_epi32(acc, u, q), _mm256_slli_epi32::<7>(sum_q))
    }

    #[inline]
    #[target_feature(enable = "avx512bw,avx512vl")]
    pub unsafe fn add_where_bits(v: __m256i, bits: u32, x: __m256i) -> __m256i {
        _mm256_mask_add_epi8(v, bits, v, x)
    }
}

/// `repack::scalar_quantize` with 16-lane vectors, the same values: the products are the same,
/// and the conversion rounds half to even (the default rounding mode) as the magic constant does.
/// The set's `PackedKernels::quantize_block`.
///
/// # Safety
/// AVX-512 F must be available.
#[target_feature(enable = "avx512f")]
pub unsafe fn quantize_block(block: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> f32 {
    use std::arch::x86_64::*;
    unsafe {
        let lo = _mm512_loadu_ps(block.as_ptr());
        let hi = _mm512_loadu_ps(block.as_ptr().add(16));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        let inv = _mm512_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let to_i8 = |v: __m512| _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)));
        _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, to_i8(lo));
        _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, to_i8(hi));
        amax
    }
}
