//! Rotary position embeddings computed as ggml computes them on the CPU: the angle of pair i at
//! position p is p * base^(-2i/dims) with the power advanced by repeated f32 multiplication,
//! divided by an optional per-pair frequency factor and multiplied by the frequency scale (1 /
//! the linear scaling factor); cos and sin are libm's.
//!
//! Invariant: a position's angles depend only on the position, so they are computed for the
//! positions of each forward rather than tabled for the whole context (Gemma 3's 32k context
//! would need 32 MB per base).

/// Which dimensions rotate together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pairing {
    /// (2i, 2i + 1): GGUF llama/mistral, whose q/k weights were permuted for it.
    Interleaved,
    /// (i, i + dims / 2): every other family (ggml's NEOX mode).
    Halves,
}

#[derive(Debug, Clone)]
pub struct Rope {
    /// Rotated dimensions per head (the rest pass through: partial rotary).
    dims: usize,
    theta_scale: f32,
    freq_scale: f32,
    /// `[dims / 2]` divisors (Llama 3.1).
    freq_factors: Option<Vec<f32>>,
    pairing: Pairing,
}

impl Rope {
    pub fn new(dims: usize, base: f32, freq_scale: f32, freq_factors: Option<&[f32]>, pairing: Pairing) -> Self {
        Self {
            dims,
            theta_scale: base.powf(-2.0 / dims as f32),
            freq_scale,
            freq_factors: freq_factors.map(<[f32]>::to_vec),
            pairing,
        }
    }

    /// cos and sin, each `[n, dims / 2]`, for positions `first..first + n`.
    pub fn tables(&self, first: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        self.tables_at(&(first..first + n).collect::<Vec<_>>())
    }

    /// cos and sin, each `[positions.len(), dims / 2]`, for each of `positions`.
    pub fn tables_at(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let half = self.dims / 2;
        let n = positions.len();
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for &pos in positions {
            let mut theta = pos as f32;
            for i in 0..half {
                let angle = self.freq_scale * (theta / self.freq_factors.as_ref().map_or(1.0, |f| f[i]));
                cos.push(angle.cos());
                sin.push(angle.sin());
                theta *= self.theta_scale;
            }
        }
        (cos, sin)
    }

    /// Rotates `x`: `[n, heads * head_dim]` in place with `n` rows of tables.
    pub fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
        let half = self.dims / 2;
        let (step, offset) = match self.pairing {
            Pairing::Interleaved => (2, 1),
            Pairing::Halves => (1, half),
        };
        for (i, row) in x.chunks_mut(heads * head_dim).enumerate() {
            let (cos, sin) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
            for head in row.chunks_mut(head_dim) {
                for (pair, (&c, &s)) in cos.iter().zip(sin).enumerate() {
                    let at = pair * step;
                    let (x0, x1) = (head[at], head[at + offset]);
                    // llama.cpp is compiled with floating-point contraction: GCC fuses these into
                    // fma(x0, c, -(x1 * s)) and fma(x0, s, x1 * c); match it exactly.
                    head[at] = x0.mul_add(c, -(x1 * s));
                    head[at + offset] = x0.mul_add(s, x1 * c);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_pairs_by_position() {
        let rope = Rope::new(4, 10_000.0, 1.0, None, Pairing::Interleaved);
        let (cos, sin) = rope.tables(0, 3);
        assert_eq!((cos[0], sin[0]), (1.0, 0.0));
        assert!((cos[2] - 1f32.cos()).abs() < 1e-7 && (sin[3] - 0.01f32.sin()).abs() < 1e-7);
        // Position 1, pair 0 turns by 1 radian: (1, 0) -> (cos 1, sin 1).
        let (cos, sin) = rope.tables(1, 1);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        rope.apply(&mut x, 1, 4, &cos, &sin);
        assert_eq!(x, vec![1f32.cos(), 1f32.sin(), 0.0, 0.0]);
    }

    #[test]
    fn halves_pair_i_with_i_plus_half_and_spare_the_unrotated_tail() {
        let rope = Rope::new(4, 10_000.0, 0.5, None, Pairing::Halves);
        let (cos, sin) = rope.tables(2, 1); // pair 0 turns by 0.5 * 2 = 1 radian
        let mut x = vec![1.0, 0.0, 0.0, 0.0, 7.0, 8.0]; // head_dim 6, 4 rotated
        rope.apply(&mut x, 1, 6, &cos, &sin);
        assert_eq!((x[0], x[2]), (1f32.cos(), 1f32.sin()));
        assert_eq!(&x[4..], &[7.0, 8.0]);
    }
}
