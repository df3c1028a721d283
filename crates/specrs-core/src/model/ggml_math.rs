//! ggml's vectorized exponential, reproduced in scalar form so specrs's softmax and SiLU round
//! exactly like llama.cpp's AVX2 path (the reference our golden tests compare against).
//!
//! The algorithm is the classic one from Arm's optimized-routines: n = round(x / ln2) by the
//! 1.5 * 2^23 trick, a two-constant reduction b = x - n*ln2, a degree-5 polynomial, then scaling by
//! 2^n through the exponent bits. Maximum error about 1.5 ulp. Every multiply-add is fused, as in
//! the vector code, so call these from code compiled with FMA (see `softmax_exps`).

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

/// `weights[i] = e^(weights[i] - max)`.
pub fn softmax_exps(weights: &mut [f32], max: f32) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: FMA is available.
        return unsafe { with_fma::softmax_exps(weights, max) };
    }
    for w in weights.iter_mut() {
        *w = expf(*w - max);
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: FMA is available.
        return unsafe { with_fma::swiglu(gate, up) };
    }
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod with_fma {
    #[target_feature(enable = "fma")]
    pub unsafe fn softmax_exps(weights: &mut [f32], max: f32) {
        for w in weights.iter_mut() {
            *w = super::expf(*w - max);
        }
    }

    #[target_feature(enable = "fma")]
    pub unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
        for (g, u) in gate.iter_mut().zip(up) {
            *g = super::silu(*g) * u;
        }
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
