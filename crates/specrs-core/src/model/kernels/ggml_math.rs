//! ggml's scalar arithmetic where its rounding differs from the textbook one, reproduced so
//! specrs's CPU model rounds exactly like llama.cpp's AVX2 path (the reference our golden tests
//! compare against): its vectorized exponential (softmax, SiLU), its f16 GELU table, and the
//! horizontal sums that end its SIMD dot products.
//!
//! The exponential is the classic one from Arm's optimized-routines: n = round(x / ln2) by the
//! 1.5 * 2^23 trick, a two-constant reduction b = x - n*ln2, a degree-5 polynomial, then scaling by
//! 2^n through the exponent bits. Maximum error about 1.5 ulp. Every multiply-add is fused, as in
//! the vector code, so call these from code compiled with FMA (the kernel sets' `softmax_exps`
//! and `swiglu` loops: `x86_avx2/math.rs`).

use std::sync::OnceLock;

use half::f16;

use super::kernels;

const SHIFT: f32 = 12_582_912.0; // 1.5 * 2^23
const LOG2_E: u32 = 0x3FB8_AA3B;
const LN2_HI: u32 = 0x3F31_7200;
const LN2_LO: u32 = 0x35BF_BE8E;
const C1: u32 = 0x3C07_2010;
const C2: u32 = 0x3D2B_9F17;
const C3: u32 = 0x3E2A_AF33;
const C4: u32 = 0x3EFF_FEDB;
const C5: u32 = 0x3F7F_FFF6;

#[inline(always)]
fn c(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// e^x; inputs whose result under/overflows the normal range return 0 or +inf.
#[inline(always)]
pub fn expf(x: f32) -> f32 {
    let z = x.mul_add(c(LOG2_E), SHIFT);
    let n = z - SHIFT;
    let b = (-n).mul_add(c(LN2_LO), (-n).mul_add(c(LN2_HI), x));
    if n.abs() > 126.0 || x.is_nan() {
        return if x.is_nan() {
            x
        } else if n > 0.0 {
            f32::INFINITY
        } else {
            0.0
        };
    }
    let k = f32::from_bits((z.to_bits() << 23).wrapping_add(1f32.to_bits()));
    let u = b * b;
    let j = c(C1).mul_add(b, c(C2)).mul_add(u, c(C3).mul_add(b, c(C4))).mul_add(u, c(C5) * b);
    j.mul_add(k, k)
}

/// x / (1 + e^-x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + expf(-x))
}

/// `gate[i] = silu(gate[i]) * up[i]`, on the process's kernel set.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    // SAFETY: `kernels()` is a set this CPU runs.
    unsafe { (kernels().swiglu)(gate, up) }
}

/// `ggml_hsum_float_8` (the end of every 8-lane dot product) of lanes `lane(0..8)`.
#[inline]
pub fn hsum8_of(lane: impl Fn(usize) -> f32) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|k| lane(k + 4) + lane(k));
    (h[0] + h[2]) + (h[1] + h[3])
}

/// `hsum8_of` a slice; missing lanes are zero.
pub fn hsum8(v: &[f32]) -> f32 {
    hsum8_of(|i| v.get(i).copied().unwrap_or(0.0))
}

/// ggml's GELU (tanh approximation), evaluated once per f16 input and rounded to f16: llama.cpp's
/// CPU backend looks GELU up in this table (`GGML_GELU_FP16`). GCC fuses `1 + a*x*x` into one
/// multiply-add.
fn gelu_table() -> &'static [f16] {
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        const GELU_COEF_A: f32 = 0.044_715;
        (0..=u16::MAX)
            .map(|bits| {
                let x = f16::from_bits(bits).to_f32();
                let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
                f16::from_f32(0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh()))
            })
            .collect()
    })
}

/// `gate[i] = gelu(gate[i]) * up[i]` as `ggml_vec_geglu_f32`: 0 at or below -10, the identity at
/// or above 10, the f16 table in between.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    for (g, u) in gate.iter_mut().zip(up) {
        *g = if *g <= -10.0 {
            0.0
        } else if *g >= 10.0 {
            *g * u
        } else {
            table[f16::from_f32(*g).to_bits() as usize].to_f32() * u
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_to_libm_exp() {
        for i in -1000..=800 {
            let x = i as f32 * 0.1;
            let (ours, exact) = (expf(x), x.exp());
            let rel = ((ours - exact) / exact).abs();
            assert!(rel < 4e-7 || exact < 1e-37, "x={x}: {ours} vs {exact}");
        }
        assert_eq!(expf(0.0), 1.0);
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
    }
}
