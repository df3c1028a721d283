//! Fused decoder-block ops: one launch where candle's ops take two to four. Each is a candle custom
//! op whose `cpu_fwd` is the reference and whose `cuda_fwd` runs `cuda/fused.cu` (NVRTC), so the
//! decoder runs the same code on the CPU and on a GPU.
//!
//! - `add_rms_norm(x, delta, weight)`: the residual add and the next norm: `(x + delta,
//!   rms_norm(x + delta) * weight)`, the sum rounded to the dtype before it is normed (it is the
//!   residual stream the next layer adds to).
//! - `act_mul(gate, up, gelu)`: SiLU(gate) * up, or GELU(gate) * up (tanh form), over row-strided
//!   views (the halves of a fused gate/up matmul's output, with no copy).
//! - `qkv_heads(qkv, positions, spec)`: the q/k/v projection's output split into f32 heads, q and
//!   k normed per head where the family has q/k norms and rotated at positions read on the device.
//!
//! Invariant: the arithmetic is f32, rounded once to the activation dtype at each stored value. In
//! f32 the CPU reference is bitwise candle's `x + delta`, `candle_nn::ops::rms_norm`, `silu`/`gelu`
//! and `*`, and for `qkv_heads` the cast, split, `rms_norm` and `rope`/`rope_i` (the same
//! expressions in the same order); in bf16/f16 it rounds once where candle's half-precision ops
//! round at every step. The device kernels sum a row's squares in another order
//! and use the device's `expf`/`tanhf`, so they match the reference within `tolerance`.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{Error, Result};

/// `x [n, h]` and `delta [n, h]` (contiguous) plus `weight [h]`, one dtype -> `(x + delta, its
/// rms norm times weight)`, each `[n, h]` (two views of one `[2, n, h]` output).
pub fn add_rms_norm(x: &Tensor, delta: &Tensor, weight: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    if x.elem_count() == 0 {
        return Ok((x.clone(), x.clone())); // no rows: no launch (a grid of zero blocks is an error)
    }
    let out = x.apply_op3_no_bwd(delta, weight, &AddRmsNorm { eps })?; // [2, n, h]
    Ok((out.get(0)?, out.get(1)?))
}

/// `gate [n, f]` and `up [n, f]`, each with unit column stride (rows may be strided) -> `act(gate)
/// * up` `[n, f]` contiguous, act SiLU or (with `gelu`) GELU's tanh form.
pub fn act_mul(gate: &Tensor, up: &Tensor, gelu: bool) -> Result<Tensor> {
    if gate.elem_count() == 0 {
        return Ok(gate.contiguous()?);
    }
    Ok(gate.apply_op2_no_bwd(up, &ActMul { gelu })?)
}

/// How `qkv_heads` splits and rotates the q/k/v projection's output.
pub struct HeadsSpec<'a> {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The leading dims of a q/k head that rotate (all of them unless the family's rotary is partial).
    pub rope_dims: usize,
    /// Pairs (2i, 2i + 1) rotate together (GGUF's llama layout), else (i, i + rope_dims / 2).
    pub interleaved: bool,
    /// `[context, rope_dims / 2]` f32 each, indexed by position on the device.
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    /// `[head_dim]` f32, each q (k) head's RMSNorm weight where the family has one.
    pub q_norm: Option<&'a Tensor>,
    pub k_norm: Option<&'a Tensor>,
    pub eps: f32,
}

/// The q/k/v projection's output `qkv [n, (H + 2 KV) * head_dim]` (unit column stride) and the
/// rows' `positions [n]` u32 -> `[H + 2 KV, n, head_dim]` f32: q heads, then k heads, then v heads;
/// q and k normed per head (where the family norms them) and rotated at their positions, v as is.
pub fn qkv_heads(qkv: &Tensor, positions: &Tensor, spec: &HeadsSpec) -> Result<Tensor> {
    let rows = qkv.dim(0)?;
    if rows == 0 {
        let heads = spec.num_heads + 2 * spec.num_kv_heads;
        return Ok(Tensor::zeros((heads, 0, spec.head_dim), DType::F32, qkv.device())?);
    }
    Ok(qkv.apply_op2_no_bwd(positions, &QkvHeads::new(spec)?)?)
}

/// Element access in f32 for the dtypes activations take.
pub(crate) trait Elem: Copy + Send + Sync + candle_core::WithDType {
    fn get(self) -> f32;
    fn of(v: f32) -> Self;
}
impl Elem for f32 {
    fn get(self) -> f32 {
        self
    }
    fn of(v: f32) -> Self {
        v
    }
}
impl Elem for bf16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Elem for f16 {
    fn get(self) -> f32 {
        self.to_f32()
    }
    fn of(v: f32) -> Self {
        f16::from_f32(v)
    }
}

pub(crate) fn op_error(op: &str, what: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {what}"))
}

/// A 2-D layout's (rows, columns, row stride, start offset); columns must be unit-strided.
pub(crate) fn rows_of(op: &str, layout: &Layout) -> candle_core::Result<(usize, usize, usize, usize)> {
    match (layout.dims(), layout.stride()) {
        ([rows, cols], [row_stride, 1]) => Ok((*rows, *cols, *row_stride, layout.start_offset())),
        ([rows, 1], [row_stride, _]) => Ok((*rows, 1, *row_stride, layout.start_offset())),
        (dims, stride) => {
            Err(op_error(op, format!("needs [rows, cols] with unit column stride, got {dims:?} strided {stride:?}")))
        }
    }
}

struct AddRmsNorm {
    eps: f32,
}

impl AddRmsNorm {
    /// (rows, hidden, x's, delta's and weight's start offsets), after checking the shapes.
    fn check(&self, l1: &Layout, l2: &Layout, l3: &Layout) -> candle_core::Result<(usize, usize, [usize; 3])> {
        let contiguous = |l: &Layout, name: &str| {
            l.contiguous_offsets()
                .map(|(start, _)| start)
                .ok_or_else(|| op_error("add_rms_norm", format!("{name} must be contiguous")))
        };
        let (x, delta, weight) = (contiguous(l1, "x")?, contiguous(l2, "delta")?, contiguous(l3, "weight")?);
        let (rows, hidden) = match l1.dims() {
            [rows, hidden] if l2.dims() == l1.dims() && l3.dims() == [*hidden] => (*rows, *hidden),
            _ => {
                let dims = (l1.dims(), l2.dims(), l3.dims());
                return Err(op_error(
                    "add_rms_norm",
                    format!("x, delta, weight are {dims:?}, need [n, h], [n, h], [h]"),
                ));
            }
        };
        Ok((rows, hidden, [x, delta, weight]))
    }

    fn reference<T: Elem>(&self, x: &[T], delta: &[T], weight: &[T], rows: usize, hidden: usize) -> Vec<T> {
        let mut out = vec![T::of(0.0); 2 * rows * hidden];
        let (sums, normed) = out.split_at_mut(rows * hidden);
        // Rows in parallel (as candle's rms_norm); each row's arithmetic is sequential.
        sums.par_chunks_mut(hidden).zip(normed.par_chunks_mut(hidden)).enumerate().for_each(|(r, (sum, norm))| {
            let (x, delta) = (&x[r * hidden..(r + 1) * hidden], &delta[r * hidden..(r + 1) * hidden]);
            for ((s, a), b) in sum.iter_mut().zip(x).zip(delta) {
                *s = T::of(a.get() + b.get());
            }
            // candle_nn's rms_norm, term for term: a sequential f32 sum, then s / m * alpha.
            let sum2 = sum.iter().map(|&v| v.get() * v.get()).sum::<f32>();
            let m = (sum2 / hidden as f32 + self.eps).sqrt();
            for ((n, s), w) in norm.iter_mut().zip(sum.iter()).zip(weight) {
                *n = T::of(s.get() / m * w.get());
            }
        });
        out
    }
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, hidden, [o1, o2, o3]) = self.check(l1, l2, l3)?;
        let shape = Shape::from((2, rows, hidden));
        let storage = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(d), CpuStorage::F32(w)) => {
                CpuStorage::F32(self.reference(&x[o1..], &d[o2..], &w[o3..], rows, hidden))
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(d), CpuStorage::BF16(w)) => {
                CpuStorage::BF16(self.reference(&x[o1..], &d[o2..], &w[o3..], rows, hidden))
            }
            (CpuStorage::F16(x), CpuStorage::F16(d), CpuStorage::F16(w)) => {
                CpuStorage::F16(self.reference(&x[o1..], &d[o2..], &w[o3..], rows, hidden))
            }
            _ => return Err(op_error("add_rms_norm", "x, delta and weight must share one of f32, bf16, f16".into())),
        };
        Ok((storage, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, hidden, offsets) = self.check(l1, l2, l3)?;
        let launch = device::Launch {
            grid: rows as u32,
            scalars: vec![
                device::Scalar::U32(rows as u32),
                device::Scalar::U32(hidden as u32),
                device::Scalar::F32(self.eps),
            ],
        };
        let inputs = [(s1, offsets[0]), (s2, offsets[1]), (s3, offsets[2])];
        let storage = device::run("add_rms_norm", inputs, None, 2 * rows * hidden, launch)?;
        Ok((storage, Shape::from((2, rows, hidden))))
    }
}

struct ActMul {
    gelu: bool,
}

impl ActMul {
    fn check(&self, l1: &Layout, l2: &Layout) -> candle_core::Result<[(usize, usize, usize, usize); 2]> {
        let (gate, up) = (rows_of("act_mul", l1)?, rows_of("act_mul", l2)?);
        if (gate.0, gate.1) != (up.0, up.1) {
            return Err(op_error("act_mul", format!("gate is {:?} and up {:?}", l1.dims(), l2.dims())));
        }
        Ok([gate, up])
    }

    fn act(&self, g: f32) -> f32 {
        // candle's f32 `gelu` and `silu`, expression for expression.
        const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
        if self.gelu {
            0.5 * g * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * g * (1.0 + 0.044715 * g * g)))
        } else {
            g / (1.0 + (-g).exp())
        }
    }

    fn reference<T: Elem>(&self, gate: &[T], up: &[T], shapes: [(usize, usize, usize, usize); 2]) -> Vec<T> {
        let [(rows, cols, gate_stride, gate_start), (_, _, up_stride, up_start)] = shapes;
        let mut out = vec![T::of(0.0); rows * cols];
        out.par_chunks_mut(cols.max(1)).enumerate().for_each(|(r, row)| {
            let (gate, up) = (&gate[gate_start + r * gate_stride..], &up[up_start + r * up_stride..]);
            for ((o, g), u) in row.iter_mut().zip(gate).zip(up) {
                // Rounded after the activation as candle's two ops store it, then multiplied.
                let activated = T::of(self.act(g.get()));
                *o = T::of(activated.get() * u.get());
            }
        });
        out
    }
}

impl CustomOp2 for ActMul {
    fn name(&self) -> &'static str {
        "act-mul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let shapes = self.check(l1, l2)?;
        let storage = match (s1, s2) {
            (CpuStorage::F32(g), CpuStorage::F32(u)) => CpuStorage::F32(self.reference(g, u, shapes)),
            (CpuStorage::BF16(g), CpuStorage::BF16(u)) => CpuStorage::BF16(self.reference(g, u, shapes)),
            (CpuStorage::F16(g), CpuStorage::F16(u)) => CpuStorage::F16(self.reference(g, u, shapes)),
            _ => return Err(op_error("act_mul", "gate and up must share one of f32, bf16, f16".into())),
        };
        Ok((storage, Shape::from((shapes[0].0, shapes[0].1))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use device::Scalar;
        let [(rows, cols, gate_stride, gate_start), (_, _, up_stride, up_start)] = self.check(l1, l2)?;
        let total = rows * cols;
        // A grid-stride loop: enough blocks to fill the device, never more than the work.
        let grid = total.div_ceil(crate::nvrtc::BLOCK as usize).clamp(1, 4096) as u32;
        let launch = device::Launch {
            grid,
            scalars: vec![Scalar::U32(rows as u32), Scalar::U32(cols as u32), Scalar::U32(u32::from(self.gelu))],
        };
        // The row strides follow their pointers: act_mul(gate, gate_stride, up, up_stride, out, ...).
        let inputs = [(s1, gate_start), (s2, up_start)];
        let storage = device::run("act_mul", inputs, Some([gate_stride as u64, up_stride as u64]), total, launch)?;
        Ok((storage, Shape::from((rows, cols))))
    }
}

/// How the q/k/v projection's heads are normed and rotated: `qkv_heads`' op, and the paged step's
/// (`paged_attention.rs`), which apply it to k and v as they write them and to q as attention
/// reads it.
pub(crate) struct QkvHeads {
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rope_dims: usize,
    pub(crate) interleaved: bool,
    cos: Tensor,
    sin: Tensor,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    pub(crate) eps: f32,
}

/// The f32 values of a contiguous CPU tensor's storage, read in place (the rotary tables span the
/// whole context: copying them per layer would cost more than the layer).
fn cpu_f32<'a>(storage: &'a candle_core::Storage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (candle_core::Storage::Cpu(CpuStorage::F32(values)), Some((start, end))) => Ok(&values[start..end]),
        _ => Err(op_error("qkv_heads", "its tables and norms must be contiguous f32 on the CPU".into())),
    }
}

/// Which third of the q/k/v projection a head is: q and k are normed (where the family norms them)
/// and rotated, v is taken as it is.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadKind {
    Q,
    K,
    V,
}

/// A [`QkvHeads`]' tables and norms as f32 slices on the CPU: the reference of `cuda/heads.cuh`.
pub(crate) struct HeadTables<'a> {
    cos: &'a [f32],
    sin: &'a [f32],
    q_norm: Option<&'a [f32]>,
    k_norm: Option<&'a [f32]>,
    half: usize,
    interleaved: bool,
    eps: f32,
}

impl HeadTables<'_> {
    /// Refuses a position past the rotary tables (the context they were built for).
    pub(crate) fn check_positions(&self, positions: &[u32]) -> candle_core::Result<()> {
        let context = self.cos.len() / self.half.max(1);
        match positions.iter().find(|&&p| p as usize >= context) {
            Some(p) => Err(op_error("qkv_heads", format!("position {p} is past the rotary tables' {context}"))),
            None => Ok(()),
        }
    }

    /// One head, `src [head_dim]` -> `dst [head_dim]` in f32: a q or k head normed per head (where
    /// the family norms it) and rotated at `position` (checked by `check_positions`), a v head as it
    /// is.
    pub(crate) fn head<T: Elem>(&self, src: &[T], kind: HeadKind, position: u32, dst: &mut [f32]) {
        let (hd, half) = (dst.len(), self.half);
        let norm = match kind {
            HeadKind::Q => self.q_norm,
            HeadKind::K => self.k_norm,
            HeadKind::V => None,
        };
        let mut row: Vec<f32> = src[..hd].iter().map(|v| v.get()).collect();
        if let Some(weight) = norm {
            // candle_nn's rms_norm over the head, term for term.
            let sum2 = row.iter().map(|&v| v * v).sum::<f32>();
            let m = (sum2 / hd as f32 + self.eps).sqrt();
            row.iter_mut().zip(weight).for_each(|(v, w)| *v = *v / m * w);
        }
        dst.copy_from_slice(&row);
        if kind == HeadKind::V {
            return;
        }
        // candle's rope (halves) and rope_i (interleaved pairs), term for term.
        let table = position as usize * half;
        for i in 0..half {
            let (c, s) = (self.cos[table + i], self.sin[table + i]);
            let (a, b) = if self.interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
            dst[a] = row[a] * c - row[b] * s;
            dst[b] = row[a] * s + row[b] * c;
        }
    }
}

impl QkvHeads {
    pub(crate) fn new(spec: &HeadsSpec) -> Result<Self> {
        Ok(Self {
            num_heads: spec.num_heads,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
            rope_dims: spec.rope_dims,
            interleaved: spec.interleaved,
            cos: spec.cos.contiguous()?,
            sin: spec.sin.contiguous()?,
            q_norm: spec.q_norm.map(|t| t.to_dtype(DType::F32)).transpose()?,
            k_norm: spec.k_norm.map(|t| t.to_dtype(DType::F32)).transpose()?,
            eps: spec.eps,
        })
    }

    pub(crate) fn total_heads(&self) -> usize {
        self.num_heads + 2 * self.num_kv_heads
    }

    /// The head of `kind` at `index` among its kind's heads: its offset in a row of the projection.
    pub(crate) fn offset(&self, kind: HeadKind, index: usize) -> usize {
        let first = match kind {
            HeadKind::Q => 0,
            HeadKind::K => self.num_heads,
            HeadKind::V => self.num_heads + self.num_kv_heads,
        };
        (first + index) * self.head_dim
    }

    /// The projection `qkv` layout's (rows, row stride, start offset), after checking it is `[n,
    /// (H + 2 KV) * head_dim]` with unit column stride and the head sizes are ones the kernels take.
    pub(crate) fn check_qkv(&self, op: &str, qkv: &Layout) -> candle_core::Result<(usize, usize, usize)> {
        let (rows, cols, row_stride, start) = rows_of(op, qkv)?;
        let width = self.total_heads() * self.head_dim;
        if cols != width {
            return Err(op_error(op, format!("qkv is {:?}, need [n, {width}]", qkv.dims())));
        }
        if self.head_dim > 1024 || self.rope_dims > self.head_dim || self.rope_dims % 2 == 1 {
            return Err(op_error(
                op,
                format!(
                    "head_dim {} (at most 1024) and rope_dims {} (even, at most head_dim)",
                    self.head_dim, self.rope_dims
                ),
            ));
        }
        Ok((rows, row_stride, start))
    }

    /// Runs `f` over the tables and norms as f32 slices (read guards held meanwhile; CPU tensors).
    pub(crate) fn with_tables<R>(
        &self,
        f: impl FnOnce(&HeadTables) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let guards = [Some(&self.cos), Some(&self.sin), self.q_norm.as_ref(), self.k_norm.as_ref()]
            .map(|t| t.map(Tensor::storage_and_layout));
        let slice = |i: usize| guards[i].as_ref().map(|(storage, layout)| cpu_f32(storage, layout)).transpose();
        let tables = HeadTables {
            cos: slice(0)?.expect("cos is given"),
            sin: slice(1)?.expect("sin is given"),
            q_norm: slice(2)?,
            k_norm: slice(3)?,
            half: self.rope_dims / 2,
            interleaved: self.interleaved,
            eps: self.eps,
        };
        f(&tables)
    }

    /// (rows, qkv's row stride and start offset), after checking the shapes.
    fn check(&self, l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize)> {
        let (rows, row_stride, start) = self.check_qkv("qkv_heads", l1)?;
        if l2.dims() != [rows] || l2.contiguous_offsets().is_none() {
            return Err(op_error("qkv_heads", format!("positions are {:?}, need [{rows}]", l2.dims())));
        }
        Ok((rows, row_stride, start))
    }

    fn reference<T: Elem>(
        &self,
        qkv: &[T],
        positions: &[u32],
        rows: usize,
        row_stride: usize,
    ) -> candle_core::Result<Vec<f32>> {
        let hd = self.head_dim;
        self.with_tables(|tables| {
            tables.check_positions(positions)?;
            let mut out = vec![0f32; self.total_heads() * rows * hd];
            out.par_chunks_mut(rows * hd).enumerate().for_each(|(head, block)| {
                let kind = if head < self.num_heads {
                    HeadKind::Q
                } else if head < self.num_heads + self.num_kv_heads {
                    HeadKind::K
                } else {
                    HeadKind::V
                };
                for (r, dst) in block.chunks_mut(hd).enumerate() {
                    tables.head(&qkv[r * row_stride + head * hd..], kind, positions[r], dst);
                }
            });
            Ok(out)
        })
    }
}

impl CustomOp2 for QkvHeads {
    fn name(&self) -> &'static str {
        "qkv-heads"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, row_stride, start) = self.check(l1, l2)?;
        let CpuStorage::U32(positions) = s2 else {
            return Err(op_error("qkv_heads", "positions must be u32".into()));
        };
        let positions = &positions[l2.start_offset()..][..rows];
        let out = match s1 {
            CpuStorage::F32(x) => self.reference(&x[start..], positions, rows, row_stride)?,
            CpuStorage::BF16(x) => self.reference(&x[start..], positions, rows, row_stride)?,
            CpuStorage::F16(x) => self.reference(&x[start..], positions, rows, row_stride)?,
            _ => return Err(op_error("qkv_heads", "qkv must be f32, bf16 or f16".into())),
        };
        Ok((CpuStorage::F32(out), Shape::from((self.total_heads(), rows, self.head_dim))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, row_stride, start) = self.check(l1, l2)?;
        let storage = device::run_qkv_heads(self, s1, start, row_stride, s2, l2.start_offset(), rows)?;
        Ok((storage, Shape::from((self.total_heads(), rows, self.head_dim))))
    }
}

/// Launching `cuda/fused.cu`'s kernels on the inputs' device, in the inputs' dtype.
#[cfg(feature = "cuda")]
pub(crate) mod device {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::CudaStorage;

    use crate::nvrtc::{by_dtype, dtype_suffix as suffix, function, BLOCK, FUSED};

    pub enum Scalar {
        U32(u32),
        F32(f32),
    }

    pub struct Launch {
        pub grid: u32,
        /// The kernel's trailing scalar arguments, in order.
        pub scalars: Vec<Scalar>,
    }

    fn err(e: crate::error::Error) -> candle_core::Error {
        candle_core::Error::Msg(e.to_string())
    }

    /// `kernel_<dtype>(input0[, stride0], input1[, stride1], ..., out, scalars...)`: each input at
    /// its start offset, followed by its row stride when `strides` are given.
    pub fn run<const N: usize>(
        kernel: &str,
        inputs: [(&CudaStorage, usize); N],
        strides: Option<[u64; N]>,
        out_len: usize,
        launch: Launch,
    ) -> candle_core::Result<CudaStorage> {
        by_dtype!(inputs[0].0.dtype(), T => typed::<T, N>(kernel, inputs, strides, out_len, launch))
    }

    /// `qkv_heads_<dtype>`: one block per (head, row).
    pub fn run_qkv_heads(
        op: &super::QkvHeads,
        qkv: &CudaStorage,
        start: usize,
        row_stride: usize,
        positions: &CudaStorage,
        positions_start: usize,
        rows: usize,
    ) -> candle_core::Result<CudaStorage> {
        by_dtype!(qkv.dtype(), T => qkv_heads_typed::<T>(op, qkv, start, row_stride, positions, positions_start, rows))
    }

    /// A [`super::QkvHeads`]' f32 tables and norms on the device, read in place.
    pub struct DeviceTables<'a> {
        pub cos: CudaView<'a, f32>,
        pub sin: CudaView<'a, f32>,
        pub q_norm: Option<CudaView<'a, f32>>,
        pub k_norm: Option<CudaView<'a, f32>>,
    }

    impl DeviceTables<'_> {
        /// A norm's pointer for a kernel, and whether there is one: an absent norm passes the cos
        /// table, a valid pointer the kernel never reads.
        pub fn norm_arg<'b>(&'b self, norm: &'b Option<CudaView<'b, f32>>) -> (&'b CudaView<'b, f32>, u32) {
            (norm.as_ref().unwrap_or(&self.cos), u32::from(norm.is_some()))
        }
    }

    /// Runs `f` over `op`'s tables and norms on the device (their read guards held meanwhile).
    pub fn with_device_tables<R>(
        op: &super::QkvHeads,
        f: impl FnOnce(&DeviceTables) -> candle_core::Result<R>,
    ) -> candle_core::Result<R> {
        let guards: Vec<_> = [Some(&op.cos), Some(&op.sin), op.q_norm.as_ref(), op.k_norm.as_ref()]
            .map(|t| t.map(|t| t.storage_and_layout()))
            .into_iter()
            .collect();
        let slice = |i: usize| -> candle_core::Result<Option<_>> {
            match &guards[i] {
                Some((storage, layout)) => match &**storage {
                    candle_core::Storage::Cuda(s) => Ok(Some(s.as_cuda_slice::<f32>()?.slice(layout.start_offset()..))),
                    _ => candle_core::bail!("qkv_heads: its tables must be on the device"),
                },
                None => Ok(None),
            }
        };
        let tables = DeviceTables {
            cos: slice(0)?.expect("cos"),
            sin: slice(1)?.expect("sin"),
            q_norm: slice(2)?,
            k_norm: slice(3)?,
        };
        f(&tables)
    }

    fn qkv_heads_typed<T: CudaDType + DeviceRepr + candle_core::WithDType>(
        op: &super::QkvHeads,
        qkv: &CudaStorage,
        start: usize,
        row_stride: usize,
        positions: &CudaStorage,
        positions_start: usize,
        rows: usize,
    ) -> candle_core::Result<CudaStorage> {
        let device = qkv.device().clone();
        let func = function(&device, &FUSED, &format!("qkv_heads_{}", suffix(T::DTYPE)?)).map_err(err)?;
        with_device_tables(op, |tables| {
            let qkv_view = qkv.as_cuda_slice::<T>()?.slice(start..);
            let positions_view = positions.as_cuda_slice::<u32>()?.slice(positions_start..);
            let total = op.total_heads();
            // SAFETY: every element is written by the kernel (one block per head and row).
            let mut out: CudaSlice<f32> = unsafe { device.alloc::<f32>(total * rows * op.head_dim) }?;
            let u32s = [rows, op.num_heads, op.num_kv_heads, op.head_dim, op.rope_dims, usize::from(op.interleaved)]
                .map(|x| x as u32);
            let ((q_norm, has_q), (k_norm, has_k)) = (tables.norm_arg(&tables.q_norm), tables.norm_arg(&tables.k_norm));
            let stride = row_stride as u64;
            let stream = device.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&qkv_view).arg(&stride).arg(&positions_view);
            builder.arg(q_norm).arg(k_norm).arg(&has_q).arg(&has_k);
            builder.arg(&tables.cos).arg(&tables.sin).arg(&mut out);
            for x in &u32s {
                builder.arg(x);
            }
            builder.arg(&op.eps);
            let config =
                LaunchConfig { grid_dim: ((total * rows) as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match qkv_heads' signature in cuda/fused.cu; `check` verified the
            // shapes (head_dim <= 1024 for its shared row), positions index the tables the engine
            // sized to the context, and the kernel writes only `out`.
            unsafe { builder.launch(config) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, device.clone()))
        })
    }

    fn typed<T: CudaDType + DeviceRepr + candle_core::WithDType, const N: usize>(
        kernel: &str,
        inputs: [(&CudaStorage, usize); N],
        strides: Option<[u64; N]>,
        out_len: usize,
        launch: Launch,
    ) -> candle_core::Result<CudaStorage> {
        let device = inputs[0].0.device().clone();
        if inputs.iter().any(|(storage, _)| storage.dtype() != T::DTYPE) {
            candle_core::bail!("{kernel}: its inputs must share one dtype");
        }
        let func = function(&device, &FUSED, &format!("{kernel}_{}", suffix(T::DTYPE)?)).map_err(err)?;
        let views = inputs
            .iter()
            .map(|(s, offset)| Ok(s.as_cuda_slice::<T>()?.slice(*offset..)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // SAFETY: every element is written by the kernel before it is read (the grid covers them).
        let mut out: CudaSlice<T> = unsafe { device.alloc::<T>(out_len) }?;
        let stream = device.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        for (i, view) in views.iter().enumerate() {
            builder.arg(view);
            if let Some(strides) = &strides {
                builder.arg(&strides[i]);
            }
        }
        builder.arg(&mut out);
        for scalar in &launch.scalars {
            match scalar {
                Scalar::U32(v) => builder.arg(v),
                Scalar::F32(v) => builder.arg(v),
            };
        }
        let config = LaunchConfig { grid_dim: (launch.grid, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's signature in cuda/fused.cu (checked shapes and
        // offsets keep every read inside its input), and it writes only `out`.
        unsafe { builder.launch(config) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, device))
    }
}

/// Each fused op on random inputs on `device` against its CPU reference on the same inputs
/// (f32, bf16): `(op and dtype, largest absolute difference, tolerance)`. On the CPU it compares
/// the reference with itself; the device check (`scripts/gpu_bench.py`) runs it on a GPU.
pub fn check_against_reference(device: &candle_core::Device) -> Result<Vec<(String, f32, f32)>> {
    let (rows, hidden, width) = (9, 4096, 1536);
    let mut report = Vec::new();
    for (dtype, tolerance) in [(DType::F32, 1e-4f32), (DType::BF16, 3e-2)] {
        let draw = |shape: (usize, usize), seed: u64| -> Result<Tensor> {
            let values = seeded_values(shape.0 * shape.1, seed);
            Ok(Tensor::from_vec(values, shape, &candle_core::Device::Cpu)?.to_dtype(dtype)?)
        };
        let (x, delta) = (draw((rows, hidden), 1)?, draw((rows, hidden), 2)?);
        let weight = draw((1, hidden), 3)?.squeeze(0)?;
        let gate_up = draw((rows, 2 * width), 4)?;
        let on = |t: &Tensor| t.to_device(device);
        let cpu = add_rms_norm(&x, &delta, &weight, 1e-6)?;
        let dev = add_rms_norm(&on(&x)?, &on(&delta)?, &on(&weight)?, 1e-6)?;
        report.push((format!("add_rms_norm sum {dtype:?}"), max_abs_diff(&cpu.0, &dev.0)?, tolerance));
        report.push((format!("add_rms_norm norm {dtype:?}"), max_abs_diff(&cpu.1, &dev.1)?, tolerance));
        let (heads, kv_heads, hd, context) = (8, 2, 128, 64);
        let qkv = draw((rows, (heads + 2 * kv_heads) * hd), 5)?;
        let tables =
            (draw((context, hd / 2), 6)?.to_dtype(DType::F32)?, draw((context, hd / 2), 7)?.to_dtype(DType::F32)?);
        let norms =
            (draw((1, hd), 8)?.squeeze(0)?.to_dtype(DType::F32)?, draw((1, hd), 9)?.squeeze(0)?.to_dtype(DType::F32)?);
        let positions: Vec<u32> = (0..rows as u32).map(|r| (r * 7) % context as u32).collect();
        for (interleaved, normed) in [(false, false), (true, true)] {
            let spec = |cos, sin, q_norm, k_norm| HeadsSpec {
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: hd,
                rope_dims: hd,
                interleaved,
                cos,
                sin,
                q_norm: normed.then_some(q_norm),
                k_norm: normed.then_some(k_norm),
                eps: 1e-6,
            };
            let on_cpu = Tensor::new(positions.as_slice(), &candle_core::Device::Cpu)?;
            let cpu = qkv_heads(&qkv, &on_cpu, &spec(&tables.0, &tables.1, &norms.0, &norms.1))?;
            let dev_tables = (on(&tables.0)?, on(&tables.1)?);
            let dev_norms = (on(&norms.0)?, on(&norms.1)?);
            let dev_spec = spec(&dev_tables.0, &dev_tables.1, &dev_norms.0, &dev_norms.1);
            let dev = qkv_heads(&on(&qkv)?, &on(&on_cpu)?, &dev_spec)?;
            let name = if interleaved { "qkv_heads interleaved normed" } else { "qkv_heads halves" };
            report.push((format!("{name} {dtype:?}"), max_abs_diff(&cpu, &dev)?, 1e-4));
        }
        for gelu in [false, true] {
            let split =
                |t: &Tensor| -> Result<(Tensor, Tensor)> { Ok((t.narrow(1, 0, width)?, t.narrow(1, width, width)?)) };
            let (gate, up) = split(&gate_up)?;
            let (dev_gate, dev_up) = split(&on(&gate_up)?)?;
            let cpu = act_mul(&gate, &up, gelu)?;
            let dev = act_mul(&dev_gate, &dev_up, gelu)?;
            let name = if gelu { "gelu_mul" } else { "silu_mul" };
            report.push((format!("{name} {dtype:?}"), max_abs_diff(&cpu, &dev)?, tolerance));
        }
    }
    Ok(report)
}

/// Values in [-4, 4) from a fixed linear congruential sequence (no random crate state shared).
pub(crate) fn seeded_values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
        })
        .collect()
}

pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let (a, b) = (
        a.to_dtype(DType::F32)?.to_device(&candle_core::Device::Cpu)?,
        b.to_dtype(DType::F32)?.to_device(&candle_core::Device::Cpu)?,
    );
    if a.dims() != b.dims() {
        return Err(Error::Internal(format!("compared shapes differ: {:?} and {:?}", a.dims(), b.dims())));
    }
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use candle_nn::ops::rms_norm;

    use super::*;

    fn tensor(shape: (usize, usize), seed: u64, dtype: DType) -> Tensor {
        Tensor::from_vec(seeded_values(shape.0 * shape.1, seed), shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    /// In f32 the fused ops are candle's unfused ones, bit for bit (the decoder's pins depend on it).
    #[test]
    fn in_f32_the_references_are_candles_ops_bitwise() {
        let (x, delta) = (tensor((5, 96), 1, DType::F32), tensor((5, 96), 2, DType::F32));
        let weight = tensor((1, 96), 3, DType::F32).squeeze(0).unwrap();
        let (sum, normed) = add_rms_norm(&x, &delta, &weight, 1e-5).unwrap();
        let expected_sum = (&x + &delta).unwrap();
        assert_eq!(max_abs_diff(&sum, &expected_sum).unwrap(), 0.0);
        assert_eq!(max_abs_diff(&normed, &rms_norm(&expected_sum, &weight, 1e-5).unwrap()).unwrap(), 0.0);
        // The halves of one [n, 2f] output: row-strided views, as a fused gate/up matmul leaves them.
        let gate_up = tensor((5, 64), 4, DType::F32);
        let (gate, up) = (gate_up.narrow(1, 0, 32).unwrap(), gate_up.narrow(1, 32, 32).unwrap());
        let silu = act_mul(&gate, &up, false).unwrap();
        assert_eq!(max_abs_diff(&silu, &(gate.silu().unwrap() * &up).unwrap()).unwrap(), 0.0);
        let gelu = act_mul(&gate, &up, true).unwrap();
        assert_eq!(max_abs_diff(&gelu, &(gate.gelu().unwrap() * &up).unwrap()).unwrap(), 0.0);
    }

    /// candle's path the decoder ran before: per projection, cast, split into heads, norm, rotate
    /// the first rope_dims (index_select of the tables by position), concatenate the rest.
    fn unfused_heads(x: &Tensor, heads: usize, spec: &HeadsSpec, norm: Option<&Tensor>, positions: &Tensor) -> Tensor {
        let (n, hd, dims) = (x.dim(0).unwrap(), spec.head_dim, spec.rope_dims);
        let h = x
            .to_dtype(DType::F32)
            .unwrap()
            .reshape((n, heads, hd))
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap();
        let h = match norm {
            Some(w) => rms_norm(&h, w, spec.eps).unwrap(),
            None => h,
        };
        let (cos, sin) = (spec.cos.index_select(positions, 0).unwrap(), spec.sin.index_select(positions, 0).unwrap());
        let rotate = |x: &Tensor| {
            let x = x.contiguous().unwrap().unsqueeze(0).unwrap();
            let r = if spec.interleaved {
                candle_nn::rotary_emb::rope_i(&x, &cos, &sin)
            } else {
                candle_nn::rotary_emb::rope(&x, &cos, &sin)
            };
            r.unwrap().squeeze(0).unwrap()
        };
        if dims == hd {
            return rotate(&h);
        }
        Tensor::cat(&[rotate(&h.narrow(2, 0, dims).unwrap()), h.narrow(2, dims, hd - dims).unwrap()], 2).unwrap()
    }

    /// In f32, qkv_heads is the unfused path bit for bit: both pairings, with and without q/k
    /// norms, full and partial rotary, rows at scattered positions; v heads pass through.
    #[test]
    fn qkv_heads_is_the_unfused_path_bitwise_in_f32() {
        let (n, heads, kv_heads, hd, context) = (5, 4, 2, 16, 40);
        let positions = Tensor::new(&[0u32, 7, 8, 9, 39], &Device::Cpu).unwrap();
        let qkv = tensor((n, (heads + 2 * kv_heads) * hd), 11, DType::F32);
        let norm = |seed| tensor((1, hd), seed, DType::F32).squeeze(0).unwrap();
        let (q_norm, k_norm) = (norm(12), norm(13));
        for (rope_dims, interleaved, normed) in
            [(16, false, false), (16, true, true), (8, false, true), (8, true, false)]
        {
            let cos = tensor((context, rope_dims / 2), 14, DType::F32);
            let sin = tensor((context, rope_dims / 2), 15, DType::F32);
            let spec = HeadsSpec {
                num_heads: heads,
                num_kv_heads: kv_heads,
                head_dim: hd,
                rope_dims,
                interleaved,
                cos: &cos,
                sin: &sin,
                q_norm: normed.then_some(&q_norm),
                k_norm: normed.then_some(&k_norm),
                eps: 1e-6,
            };
            let fused = qkv_heads(&qkv, &positions, &spec).unwrap();
            let q = unfused_heads(&qkv.narrow(1, 0, heads * hd).unwrap(), heads, &spec, spec.q_norm, &positions);
            let k = unfused_heads(
                &qkv.narrow(1, heads * hd, kv_heads * hd).unwrap(),
                kv_heads,
                &spec,
                spec.k_norm,
                &positions,
            );
            let v = qkv.narrow(1, (heads + kv_heads) * hd, kv_heads * hd).unwrap();
            let v = v.reshape((n, kv_heads, hd)).unwrap().transpose(0, 1).unwrap();
            let expected = Tensor::cat(&[q, k, v.contiguous().unwrap()], 0).unwrap();
            let case = format!("rope_dims {rope_dims} interleaved {interleaved} normed {normed}");
            assert_eq!(max_abs_diff(&fused, &expected).unwrap(), 0.0, "{case}");
        }
        let cos = tensor((context, 8), 14, DType::F32);
        let spec = HeadsSpec {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: hd,
            rope_dims: 16,
            interleaved: false,
            cos: &cos,
            sin: &cos,
            q_norm: None,
            k_norm: None,
            eps: 1e-6,
        };
        let past = Tensor::new(&[0u32, 1, 2, 3, 40], &Device::Cpu).unwrap();
        let e = qkv_heads(&qkv, &past, &spec).unwrap_err().to_string();
        assert!(e.contains("position 40"), "{e}");
    }

    /// In bf16 the reference rounds once; candle's half-precision ops round at each step, so the two
    /// agree within a few bf16 steps of the values' size.
    #[test]
    fn in_bf16_the_references_track_candles_ops() {
        let (x, delta) = (tensor((3, 128), 5, DType::BF16), tensor((3, 128), 6, DType::BF16));
        let weight = tensor((1, 128), 7, DType::BF16).squeeze(0).unwrap();
        let (sum, normed) = add_rms_norm(&x, &delta, &weight, 1e-6).unwrap();
        let expected_sum = (&x + &delta).unwrap();
        assert_eq!(max_abs_diff(&sum, &expected_sum).unwrap(), 0.0, "one rounding of a sum either way");
        assert!(max_abs_diff(&normed, &rms_norm(&expected_sum, &weight, 1e-6).unwrap()).unwrap() < 0.1);
        let (gate, up) = (tensor((3, 64), 8, DType::BF16), tensor((3, 64), 9, DType::BF16));
        for gelu in [false, true] {
            let fused = act_mul(&gate, &up, gelu).unwrap();
            let unfused = ((if gelu { gate.gelu() } else { gate.silu() }).unwrap() * &up).unwrap();
            assert!(max_abs_diff(&fused, &unfused).unwrap() < 0.2, "gelu={gelu}");
        }
    }

    #[test]
    fn bad_shapes_are_refused_by_name() {
        let x = tensor((2, 8), 1, DType::F32);
        let wrong_weight = tensor((1, 7), 2, DType::F32).squeeze(0).unwrap();
        let e = add_rms_norm(&x, &x, &wrong_weight, 1e-6).unwrap_err().to_string();
        assert!(e.contains("add_rms_norm") && e.contains("[h]"), "{e}");
        let transposed = x.t().unwrap();
        let e = act_mul(&transposed, &transposed, false).unwrap_err().to_string();
        assert!(e.contains("unit column stride"), "{e}");
        let e = add_rms_norm(
            &x,
            &x.to_dtype(DType::BF16).unwrap(),
            &tensor((1, 8), 3, DType::F32).squeeze(0).unwrap(),
            1e-6,
        );
        assert!(e.is_err());
    }
}
