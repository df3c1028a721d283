//! Rotary embeddings and causal grouped-query attention over the KV cache, on the CPU, row by row.
//!
//! Invariant: a query row's output depends only on that row and the cached keys/values at
//! positions up to its own, summed in a fixed order. A token therefore gets bitwise the same
//! result whether it is decoded alone or inside a k+1-token verification pass.
//!
//! Why not candle's matmul + softmax: its matmul blocks differently for 1 and for n rows, and the
//! resulting ~1e-6 differences are not harmless here. Every quantized matmul rounds its input
//! activations to int8, so a tiny difference can flip a rounding step; on SmolLM2 that moved
//! logits by up to ~1.0 and flipped greedy tokens between batched and single-token forwards (the
//! same effect makes llama.cpp's batched verification diverge from its plain decoding).

use super::parallel::for_each_chunk_mut;

#[derive(Debug, Clone, Copy)]
pub struct HeadShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Interleaved (GGUF llama) rotary embedding in place. `x`: `[n, heads * head_dim]` for tokens at
/// positions `first_pos..first_pos + n`; `cos`, `sin`: `[max_len, head_dim / 2]`.
pub fn apply_rope(x: &mut [f32], heads: usize, head_dim: usize, first_pos: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for (i, row) in x.chunks_mut(heads * head_dim).enumerate() {
        let table = (first_pos + i) * half;
        let (cos, sin) = (&cos[table..table + half], &sin[table..table + half]);
        for head in row.chunks_mut(head_dim) {
            for (pair, (&c, &s)) in head.chunks_mut(2).zip(cos.iter().zip(sin)) {
                let (x0, x1) = (pair[0], pair[1]);
                pair[0] = x0 * c - x1 * s;
                pair[1] = x0 * s + x1 * c;
            }
        }
    }
}

/// Dot product with eight fixed accumulator lanes (vectorizes, and the order never changes).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            lanes[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum = lanes.iter().sum::<f32>();
    for j in chunks * 8..a.len() {
        sum += a[j] * b[j];
    }
    sum
}

/// `q`: `[n, heads * head_dim]` (rotated) for positions `past..past + n`; `k`, `v`: the layer's
/// cache buffers `[>= past + n, kv_heads * head_dim]` holding those positions. Returns
/// `[n, heads * head_dim]`.
pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], past: usize, shape: HeadShape) -> Vec<f32> {
    let HeadShape { num_heads, num_kv_heads, head_dim } = shape;
    let group = num_heads / num_kv_heads;
    let kv_dim = num_kv_heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut out = vec![0f32; q.len()];
    // One work item per (token, head): `head_dim` outputs.
    for_each_chunk_mut(&mut out, head_dim, |item, out| {
        let (i, head) = (item / num_heads, item % num_heads);
        let kv_off = (head / group) * head_dim;
        let q = &q[item * head_dim..(item + 1) * head_dim];
        let visible = past + i + 1;
        let scores: Vec<f32> = (0..visible)
            .map(|j| dot(q, &k[j * kv_dim + kv_off..j * kv_dim + kv_off + head_dim]) * scale)
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut total = 0f32;
        for (j, &s) in scores.iter().enumerate() {
            let w = (s - max).exp();
            total += w;
            let v = &v[j * kv_dim + kv_off..j * kv_dim + kv_off + head_dim];
            for (o, &x) in out.iter_mut().zip(v) {
                *o += w * x;
            }
        }
        for o in out.iter_mut() {
            *o /= total;
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0) - 0.5).collect()
    }

    #[test]
    fn batched_rows_equal_single_rows_bitwise() {
        let shape = HeadShape { num_heads: 4, num_kv_heads: 2, head_dim: 8 };
        let (n, past) = (5, 3);
        let q = pseudo_random(n * 32, 1);
        let k = pseudo_random((past + n) * 16, 2);
        let v = pseudo_random((past + n) * 16, 3);
        let batched = causal_attention(&q, &k, &v, past, shape);
        for i in 0..n {
            let single = causal_attention(&q[i * 32..(i + 1) * 32], &k, &v, past + i, shape);
            assert_eq!(&batched[i * 32..(i + 1) * 32], &single[..]);
        }
    }

    #[test]
    fn one_visible_position_returns_its_value() {
        let shape = HeadShape { num_heads: 2, num_kv_heads: 1, head_dim: 4 };
        let out = causal_attention(&[1.0; 8], &[0.5; 4], &[1.0, 2.0, 3.0, 4.0], 0, shape);
        assert_eq!(out, vec![1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_rotates_pairs_by_position() {
        let (cos, sin) = (vec![1.0, 0.0], vec![0.0, 1.0]); // position 0: identity; 1: 90 degrees
        let mut x = vec![1.0, 2.0];
        apply_rope(&mut x, 1, 2, 1, &cos, &sin);
        assert_eq!(x, vec![-2.0, 1.0]);
    }
}
