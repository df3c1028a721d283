//! The reference kernel set: plain Rust, on every CPU. It is what CPUs without a faster set run
//! and the twin every other set is tested against (`tests.rs`): bitwise for the sets that keep
//! its summation order, within the documented rounding for those that do not (Q4_0/Q4_1 in AVX2,
//! everything repacked).
//!
//! Invariant: every function here is a function of its inputs alone, summed in a fixed order
//! (the same on every machine: `f32::mul_add` is one correctly rounded fused multiply-add).

use half::f16;

use super::attention::ValueRows;
use super::dense::DenseWeight;
use super::format::{Format, BLOCK};
use super::ggml_math::{expf, hsum8, silu};
use super::kquants::{self, Q8KRows};
use super::qlinear::QuantizedRows;
use super::KernelSet;

pub fn available() -> bool {
    true
}

pub const KERNELS: KernelSet = KernelSet {
    name: "reference",
    qdot_rows: scalar_dot_rows,
    qdot_features: None,
    q8k_dot_rows,
    packed: None,
    scaled_dots,
    weighted_sum,
    softmax_exps,
    swiglu,
    dense_dots,
};

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// The signed value of element `j` of a Q5_0 or Q8_0 block.
fn signed_value(format: Format, blk: &[u8], j: usize) -> i32 {
    match format {
        Format::Q5_0 => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let nibble = if j < 16 { blk[6 + j] & 0x0F } else { blk[6 + j - 16] >> 4 };
            (nibble as i32 | (((qh >> j) & 1) << 4) as i32) - 16
        }
        _ => blk[2 + j] as i8 as i32,
    }
}

/// `qdot_rows`: llama.cpp's scalar order for Q5_0 and Q8_0 (which the AVX2 kernel also
/// follows), a plain per-block sum for Q4_0 and Q4_1.
pub fn scalar_dot_rows(format: Format, weight: &[u8], rows: &QuantizedRows, first: usize, out: &mut [f32]) {
    let bb = format.block_bytes();
    if matches!(format, Format::Q5_0 | Format::Q8_0) {
        // llama.cpp's order: per block, 8 lanes of 4-product integer sums, each added to its own
        // f32 accumulator with a fused multiply-add; one horizontal sum at the end.
        for (r, o) in out.iter_mut().enumerate() {
            let row = first + r;
            let mut acc = [0f32; 8];
            for b in 0..rows.num_blocks {
                let blk = &weight[b * bb..(b + 1) * bb];
                let qa = &rows.qs[(row * rows.num_blocks + b) * BLOCK..][..BLOCK];
                let d = f16_at(blk, 0) * rows.scales[row * rows.num_blocks + b];
                for (lane, acc) in acc.iter_mut().enumerate() {
                    let sum: i32 = (4 * lane..4 * lane + 4).map(|j| signed_value(format, blk, j) * qa[j] as i32).sum();
                    *acc = d.mul_add(sum as f32, *acc);
                }
            }
            *o = hsum8(&acc);
        }
        return;
    }
    for (r, o) in out.iter_mut().enumerate() {
        let row = first + r;
        let mut total = 0f32;
        for b in 0..rows.num_blocks {
            let blk = &weight[b * bb..(b + 1) * bb];
            let qa = &rows.qs[(row * rows.num_blocks + b) * BLOCK..][..BLOCK];
            let (da, sa) = (rows.scales[row * rows.num_blocks + b], rows.sums[row * rows.num_blocks + b]);
            match format {
                Format::Q4_1 => {
                    let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
                    let mut acc = 0i32;
                    for j in 0..16 {
                        acc += (blk[4 + j] & 0x0F) as i32 * qa[j] as i32;
                        acc += (blk[4 + j] >> 4) as i32 * qa[j + 16] as i32;
                    }
                    total += d * da * acc as f32 + m * sa;
                }
                Format::Q4_0 => {
                    let d = f16_at(blk, 0);
                    let mut acc = 0i32;
                    for j in 0..16 {
                        acc += (blk[2 + j] & 0x0F) as i32 * qa[j] as i32;
                        acc += (blk[2 + j] >> 4) as i32 * qa[j + 16] as i32;
                    }
                    total += d * da * acc as f32 - 8.0 * d * sa;
                }
                _ => unreachable!("Q5_0 and Q8_0 are summed in lanes above"),
            }
        }
        *o = total;
    }
}

/// `q8k_dot_rows`: `kquants::dot_q4k` / `dot_q6k` per activation row.
fn q8k_dot_rows(format: Format, weight: &[u8], rows: &Q8KRows, first: usize, out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        *o = match format {
            Format::Q4K => kquants::dot_q4k(weight, rows, first + r),
            _ => kquants::dot_q6k(weight, rows, first + r),
        };
    }
}

/// `scaled_dots`: `dot(keys row j, query) * scale`, any query length.
fn scaled_dots(query: &[f32], keys: &[f16], stride: usize, scale: f32, out: &mut [f32]) {
    let head_dim = query.len();
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot(&keys[j * stride..][..head_dim], query) * scale;
    }
}

/// `weighted_sum`: out[d] = Σ_j probs[j] * values[j][d], one fused multiply-add chain per output
/// in cell order (so a tree node, whose cells are its path's, sums exactly as that path run as a
/// chain), any output length.
fn weighted_sum(values: &ValueRows, probs: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (j, &p) in probs.iter().enumerate() {
        for (o, x) in out.iter_mut().zip(values.row(j)) {
            *o = x.to_f32().mul_add(p, *o);
        }
    }
}

fn softmax_exps(weights: &mut [f32], max: f32) {
    for w in weights.iter_mut() {
        *w = expf(*w - max);
    }
}

fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// Σ a[d] * b[d]: value d into lane d % 8 with fused multiply-adds, the lanes reduced as
/// `reduce_lanes`, then any tail (lengths not a multiple of 8) added in order. The scalar twin of
/// every set's `scaled_dots`.
pub fn dot(a: &[f16], b: &[f32]) -> f32 {
    dot_widened(a, b, f16::to_f32)
}

/// `dot` with f32 weights: the scalar twin of every set's `dense_dots`.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_widened(a, b, |x| x)
}

fn dot_widened<T: Copy>(a: &[T], b: &[f32], widen: impl Fn(T) -> f32) -> f32 {
    let full = a.len() / 8 * 8;
    let mut lanes = [0f32; 8];
    for (i, (x, y)) in a[..full].iter().zip(&b[..full]).enumerate() {
        lanes[i % 8] = widen(*x).mul_add(*y, lanes[i % 8]);
    }
    let mut sum = reduce_lanes(&lanes);
    for (x, y) in a[full..].iter().zip(&b[full..]) {
        sum = widen(*x).mul_add(*y, sum);
    }
    sum
}

/// `KernelSet::dense_dots`: `out[f * out_stride + r] = dot_f32(weights row f as f32, x row r)`.
fn dense_dots(weights: DenseWeight, x: &[f32], in_features: usize, out: &mut [f32], out_stride: usize) {
    let mut weight = vec![0f32; in_features];
    for f in 0..weights.len() / in_features {
        weights.widen_into(f * in_features, &mut weight);
        for (r, row) in x.chunks_exact(in_features).enumerate() {
            out[f * out_stride + r] = dot_f32(&weight, row);
        }
    }
}

/// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
pub fn reduce_lanes(l: &[f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}
