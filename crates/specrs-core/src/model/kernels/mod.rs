//! specrs's own CPU kernels, shared by every backend that runs GGUF weights on the CPU (the CPU
//! decoder `model/cpu/`, candle's CPU path, the heads): quantized matmuls (`qlinear.rs`, with
//! `kquants.rs` for Q4_K/Q6_K and `repack.rs`'s tiled layout), dense f32/bf16/f16 matmuls for
//! candle's CPU path (`dense.rs`), attention over the f16 cache (`attention.rs`), ggml's
//! exp/SiLU/GELU (`ggml_math.rs`), and `parallel.rs`, which splits their work across cores.
//! `format.rs` names the weight formats they read.
//!
//! The instruction-set-specific inner loops live in one folder per ISA (`reference.rs`, scalar
//! and portable; `x86_avx2/`; `x86_avx512_vnni/`), each exporting a `KernelSet`; `kernels()`
//! picks the best one this CPU runs, once per process, and every kernel call goes through it. A
//! new ISA is one new folder plus one line in `CANDIDATES`. `SPECRS_CPU_KERNELS=<name>` forces a
//! set (A/B measurements, reproducing another machine's numerics); `avx2` is the old name of
//! `x86_avx2`.
//!
//! Invariant: every kernel is row-independent (a row's result never depends on the other rows
//! it is computed with), which is what makes a forward's rows bitwise invariant
//! (`model/forward.rs`); and within one process every kernel call runs the same set.

pub mod attention;
pub mod dense;
pub mod format;
pub mod ggml_math;
pub mod kquants;
#[cfg(target_arch = "x86_64")]
mod packed_tiles;
pub mod parallel;
pub mod qlinear;
pub mod reference;
pub mod repack;
#[cfg(target_arch = "x86_64")]
pub mod x86_avx2;
#[cfg(target_arch = "x86_64")]
pub mod x86_avx512_vnni;

use std::sync::OnceLock;

use half::f16;

use crate::error::{Error, Result};
use attention::ValueRows;
use format::Format;
use kquants::Q8KRows;
use qlinear::QuantizedRows;
use repack::{QuantizeBlock, QuantizedActivations, Repacked};

/// One instruction set's kernels. The fields are `unsafe fn`s: calling one is sound only on a CPU
/// that runs the set (`available_sets` lists those; `kernels()` returns one of them) and with the
/// shapes each kernel's own `# Safety` names.
pub struct KernelSet {
    /// "reference" | "x86_avx2" | "x86_avx512_vnni": what `ModelInfo::kernels` reports.
    pub name: &'static str,
    /// A 32-value format's weight row (Q4_0, Q4_1, Q5_0, Q8_0) against up to `kquants::ROW_GROUP`
    /// Q8_0 activation rows from `first`: `(format, weight_row, rows, first, out)`.
    pub qdot_rows: unsafe fn(Format, &[u8], &QuantizedRows, usize, &mut [f32]),
    /// Decoding: up to `qlinear::FEATURES_PER_CALL` weight rows (`row_bytes` apart) against the one
    /// activation row, each summed as `qdot_rows` sums it: `(format, weights, row_bytes, rows,
    /// out)`. None: `qdot_rows` per feature.
    pub qdot_features: Option<QdotFeatures>,
    /// A Q4_K / Q6_K weight row against up to `kquants::ROW_GROUP` Q8_K activation rows.
    pub q8k_dot_rows: unsafe fn(Format, &[u8], &Q8KRows, usize, &mut [f32]),
    /// Weights repacked at load into `repack.rs`'s tiles and their kernel; None: weights are read
    /// in place with the functions above.
    pub packed: Option<PackedKernels>,
    /// Attention scores: `out[j] = dot(keys row j, query) * scale`, rows `stride` apart:
    /// `(query, keys, stride, scale, out)`. Sets other than the reference need a query length
    /// that is a multiple of 8.
    pub scaled_dots: unsafe fn(&[f32], &[f16], usize, f32, &mut [f32]),
    /// Attention output: `out[d] = Σ_j probs[j] * values.row(j)[d]`, one fused multiply-add
    /// chain per output in cell order. Sets other than the reference need `out.len() % 8 == 0`.
    pub weighted_sum: unsafe fn(&ValueRows, &[f32], &mut [f32]),
    /// `weights[i] = e^(weights[i] - max)` with ggml's exp.
    pub softmax_exps: unsafe fn(&mut [f32], f32),
    /// `gate[i] = silu(gate[i]) * up[i]`.
    pub swiglu: unsafe fn(&mut [f32], &[f32]),
    /// Dense matmul dots (`dense.rs`): `out[f * out_stride + r] = reference::dot_f32(weights row
    /// f as f32, x row r)` for every weight row and activation row of `in_features` values:
    /// `(weights, x, in_features, out, out_stride)`. Bitwise the reference in every set.
    pub dense_dots: unsafe fn(dense::DenseWeight, &[f32], usize, &mut [f32], usize),
}

impl std::fmt::Debug for KernelSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KernelSet({})", self.name)
    }
}

/// `KernelSet::qdot_features`.
pub type QdotFeatures = unsafe fn(Format, &[u8], usize, &QuantizedRows, &mut [f32]);

/// The kernels of a set that repacks weights at load (`repack.rs`).
pub struct PackedKernels {
    /// Feature groups `first_group..first_group + groups` of `w` for all `num_rows` rows into
    /// `out` (`[num_rows, w.out_features]`): `(w, acts, first_group, groups, num_rows, out)`.
    pub groups: unsafe fn(&Repacked, &QuantizedActivations, usize, usize, usize, *mut f32),
    /// The activations' int8 quantization, bitwise `repack::scalar_quantize`.
    pub quantize_block: QuantizeBlock,
}

/// Whether this CPU runs a set.
type RunsHere = fn() -> bool;

/// Every set, best first, with the test of whether this CPU runs it. A new ISA is one line here.
const CANDIDATES: &[(RunsHere, &KernelSet)] = &[
    #[cfg(target_arch = "x86_64")]
    (x86_avx512_vnni::available, &x86_avx512_vnni::KERNELS),
    #[cfg(target_arch = "x86_64")]
    (x86_avx2::available, &x86_avx2::KERNELS),
    (reference::available, &reference::KERNELS),
];

/// The environment variable that forces a set by name.
pub const FORCE_VAR: &str = "SPECRS_CPU_KERNELS";

/// The sets this CPU runs, best first (the last is always the reference).
pub fn available_sets() -> Vec<&'static KernelSet> {
    CANDIDATES.iter().filter(|(available, _)| available()).map(|(_, set)| *set).collect()
}

/// The set `forced` names (None or empty: the best available one).
fn choose(forced: Option<&str>) -> Choice {
    let available = available_sets();
    let Some(name) = forced.filter(|n| !n.is_empty()) else { return Ok(available[0]) };
    // "avx2" predates the set names (benches/README.md's A/B runs).
    let name = if name == "avx2" { "x86_avx2" } else { name };
    if let Some(set) = available.iter().find(|s| s.name == name) {
        return Ok(set);
    }
    let names: Vec<&str> = available.iter().map(|s| s.name).collect();
    let known = CANDIDATES.iter().any(|(_, s)| s.name == name);
    Err(format!(
        "{FORCE_VAR}={name}: {}; this CPU runs {} (or unset it for the best one)",
        if known { "this CPU does not run that kernel set" } else { "no such kernel set" },
        names.join(", ")
    ))
}

/// The chosen set, or why `SPECRS_CPU_KERNELS` names none this CPU runs.
type Choice = std::result::Result<&'static KernelSet, String>;

fn selection() -> &'static Choice {
    static CHOSEN: OnceLock<Choice> = OnceLock::new();
    CHOSEN.get_or_init(|| choose(std::env::var(FORCE_VAR).ok().as_deref()))
}

/// The set every kernel call of this process runs, or a `ConfigError` when `SPECRS_CPU_KERNELS`
/// names a set this CPU does not run. Everything that builds weights for these kernels
/// (`QLinear::new`) calls this, so a bad setting fails the model's load.
pub fn checked_kernels() -> Result<&'static KernelSet> {
    selection().clone().map_err(Error::config)
}

/// The set every kernel call of this process runs. Where `SPECRS_CPU_KERNELS` is invalid no
/// model loads (`checked_kernels`); code that calls a kernel without a model (tests, the cost
/// probes of a loaded model never reach here) gets the best available set.
pub fn kernels() -> &'static KernelSet {
    selection().as_ref().copied().unwrap_or_else(|_| available_sets()[0])
}

#[cfg(test)]
mod tests;
