//! One step's keys and values written into a block-paged device pool and attention over it for
//! every row of every sequence at once (chains and trees alike), in ONE op per layer: a candle
//! in-place op on the pool whose `cpu_fwd` is the reference (the write, then attention over the
//! written pool) and whose `cuda_fwd` runs `cuda/paged_attention.cu` (NVRTC: one launch that
//! writes the keys and attends, reading the step's own keys from the projection as it writes
//! them). This replaces, on a paged cache, the per-sequence appends, whole-cache f32 casts and
//! per-tree-row gathers of `attention.rs`.
//!
//! A [`PagedStep`] describes the step once per forward (one u32 upload every layer reads, and the
//! forward's only one: the rows' tokens and logit rows ride along, and so do the words the batch
//! carries for after the forward, the step's acceptance): each row's sequence, position
//! and slot, each sequence's past and block table, and each row's ancestor mask over its
//! sequence's step rows (a chain's row i sees rows 0..=i; a tree row its
//! path). Row r sees its sequence's past positions and the step rows its mask names, each within
//! the layer's window by position, so a tree row computes what its path run as a chain computes.
//!
//! Invariant: a row's output depends only on its own query and the keys and values it sees, read
//! in a fixed order (past positions ascending, then step rows ascending) — never on its
//! batch-mates, its tree siblings or how many rows the step has. The reference computes in f32
//! and rounds each output once to the pool's dtype (the model's, which the output projection
//! reads); the device kernel sums in another order (an online softmax over eight warps), within
//! `check_against_reference`'s tolerance.

use std::cell::RefCell;
use std::sync::Arc;

use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, DType, Device, InplaceOp3, Layout, Shape, Storage, Tensor};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::kv_cache::slot_of;
use crate::model::candle::attention::Scores;
use crate::model::candle::fused::{op_error, Elem, HeadKind, HeadsSpec, QkvHeads};
use crate::model::candle::step_buffer::{StepBuffers, StepDescriptor};
use crate::model::candle::step_shape::Padding;
use crate::model::forward::{Carried, ForwardBatch};

/// The most dims a head may have here (a warp's 32 lanes hold up to 8 each on the device).
pub const MAX_HEAD_DIM: usize = 256;

/// A forward's rows as the paged ops read them (see the module header): the step's words written
/// into a static buffer on the model's device, laid out as `cuda/paged_attention.cu` names them.
pub(crate) struct PagedStep {
    /// `row_seq[n] | row_pos[n] | row_slot[n] | seqs[4 S] | masks[n W] | tables[T] | tokens[n] |
    /// logit_rows[L]` u32: the sections the forward reads (the kernels up to the tables; the
    /// decoder's token gather, rotations and logit rows their own), a view of `held`.
    descriptor: Tensor,
    /// The static buffer the step's words were written into (the batch's carried words after the
    /// forward's, for after the forward), with the split-K scratch the attention of every layer
    /// reuses; given back when the step ends.
    held: StepDescriptor,
    layout: StepLayout,
    /// Where the batch's carried words start in the buffer, and their words with the room after
    /// them.
    carried: Option<(usize, usize)>,
}

/// Where a descriptor's sections lie and the sizes the step's launches take: for a padded step a
/// function of its shape, table width and block size alone, so a captured step's launches fit
/// every later step of its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StepLayout {
    /// Where the tokens section starts (`3 n + 4 S + n W + T`).
    tokens_start: usize,
    num_logit_rows: usize,
    /// The step's rows, padding included (the batch's are the first).
    num_rows: usize,
    /// Sequence entries of the descriptor (the padded shape's and the padding rows' one).
    num_seqs: usize,
    /// u32 words per row's ancestor mask: enough bits for the longest sequence's step rows.
    mask_words: usize,
    block_shift: u32,
    /// The most keys a row sees: the longest sequence's past and step rows (before any window);
    /// padded, what the table width holds (the grid's size follows the shape, not the step).
    max_keys: usize,
}

impl StepLayout {
    /// Words of the sections the forward reads.
    fn forward_words(&self) -> usize {
        self.tokens_start + self.num_rows + self.num_logit_rows
    }
}

/// A step's words on the host, before their one upload.
pub(crate) struct StepWords {
    words: Vec<u32>,
    layout: StepLayout,
    /// Where the batch's carried words start, and their words with the room after them.
    carried: Option<(usize, usize)>,
    /// Words kept after the written ones (the carried words' room).
    room: usize,
}

impl StepWords {
    /// The words of a step of `batch`, whose sequence s has `pasts[s]` positions held and block
    /// table `tables[s]` (blocks of `block_size` positions, a power of two), already reserved for
    /// the step's rows; the step's rows are written at positions `pasts[s]..` in row order. With
    /// `padding` the step has the padded shape's rows (`step_shape.rs`): the batch's first, then
    /// padding rows, each seeing the dummy slot alone and writing its keys there, in a
    /// descriptor laid out by the shape and table width alone.
    pub(crate) fn of(
        batch: &ForwardBatch,
        pasts: &[usize],
        tables: &[&[u32]],
        block_size: usize,
        padding: Option<&Padding>,
    ) -> Result<Self> {
        let (n, num_seqs) = (batch.num_rows(), batch.num_seqs());
        if pasts.len() != num_seqs || tables.len() != num_seqs || !block_size.is_power_of_two() {
            return Err(Error::Internal(format!(
                "paged step: {num_seqs} sequences but {} pasts and {} tables, block size {block_size}",
                pasts.len(),
                tables.len()
            )));
        }
        let block_shift = block_size.trailing_zeros();
        let longest = (0..num_seqs).map(|s| batch.seq_range(s).len()).max().unwrap_or(0);
        let u32_of = |x: usize, what: &str| {
            u32::try_from(x).map_err(|_| Error::Internal(format!("paged step: {what} {x} is past u32")))
        };
        // The layout's sizes: the batch's own, or the padded shape's (one more sequence: the
        // padding rows').
        let (rows, seq_entries, mask_words, table_width) = match padding {
            None => (n, num_seqs, longest.div_ceil(32).max(1), None),
            Some(p) => {
                let fits = p.shape.num_seqs >= num_seqs
                    && p.shape.rows_per_seq >= longest
                    && tables.iter().all(|t| t.len() <= p.table_width);
                if !fits {
                    return Err(Error::Internal(format!(
                        "paged step: {num_seqs} sequences of up to {longest} rows do not fit the padded {p:?}"
                    )));
                }
                (
                    p.shape.num_rows(),
                    p.shape.num_seqs + 1,
                    p.shape.rows_per_seq.div_ceil(32).max(1),
                    Some(p.table_width),
                )
            }
        };
        let (mut row_seq, mut row_pos, mut row_slot) = (vec![0u32; rows], vec![0u32; rows], vec![0u32; rows]);
        let mut seqs = Vec::with_capacity(4 * seq_entries);
        let mut masks = vec![0u32; rows * mask_words];
        let mut flat_tables = Vec::new();
        for (s, (&past, table)) in pasts.iter().zip(tables).enumerate() {
            let seq_rows = batch.seq_range(s);
            seqs.extend([u32_of(past, "past")?, u32_of(seq_rows.start, "row")?, u32_of(seq_rows.len(), "rows")?]);
            seqs.push(u32_of(flat_tables.len(), "table start")?);
            flat_tables.extend_from_slice(table);
            if let Some(width) = table_width {
                flat_tables.resize(flat_tables.len() + width - table.len(), 0);
            }
            for row in seq_rows.clone() {
                let position = past + row - seq_rows.start;
                let Some(slot) = slot_of(table, position, block_shift) else {
                    return Err(Error::Internal(format!(
                        "paged step: position {position} of sequence {s} has no block (reserve before the forward)"
                    )));
                };
                row_seq[row] = s as u32;
                row_pos[row] = u32_of(batch.positions[row], "position")?;
                row_slot[row] = u32_of(slot, "slot")?;
                for ancestor in batch.path(s, row) {
                    masks[row * mask_words + ancestor / 32] |= 1 << (ancestor % 32);
                }
            }
        }
        let mut logit_rows = batch.logit_rows.iter().map(|&r| u32_of(r, "logit row")).collect::<Result<Vec<_>>>()?;
        let mut tokens = batch.tokens.clone();
        if let (Some(p), Some(width)) = (padding, table_width) {
            // Empty entries up to the shape's sequences, then the padding rows' sequence: one past
            // position (the dummy slot, the one key each padding row sees) and no step rows of its
            // own to see (however many padding rows there are, none is another's key); its rows at
            // position 1, each writing its keys into the dummy slot.
            for _ in num_seqs..p.shape.num_seqs {
                seqs.extend([0, u32_of(n, "row")?, 0, u32_of(flat_tables.len(), "table start")?]);
                flat_tables.resize(flat_tables.len() + width, 0);
            }
            seqs.extend([1, u32_of(n, "row")?, 0, u32_of(flat_tables.len(), "table start")?]);
            flat_tables.push(p.dummy_slot >> block_shift);
            flat_tables.resize(flat_tables.len() + width - 1, 0);
            row_seq[n..].fill(p.shape.num_seqs as u32);
            row_pos[n..].fill(1);
            row_slot[n..].fill(p.dummy_slot);
            // Every row gets logits; the decoder keeps the batch's.
            logit_rows.resize(rows, 0);
            tokens.resize(rows, 0);
        }
        let tokens_start = 3 * rows + seqs.len() + masks.len() + flat_tables.len();
        let mut descriptor: Vec<u32> =
            [&row_seq[..], &row_pos, &row_slot, &seqs, &masks, &flat_tables, &tokens, &logit_rows].concat();
        // The batch's carried words ride the same upload, after every section the forward reads.
        let carried = batch.carried.as_ref().map(|carried| {
            let section = (descriptor.len(), carried.words.len() + carried.room);
            descriptor.extend_from_slice(&carried.words);
            section
        });
        let max_keys = match table_width {
            // Every row's keys lie in its table's blocks: the grid's split ranges follow the table
            // width, the same every step of the shape.
            Some(width) => width * block_size,
            None => (0..num_seqs).map(|s| pasts[s] + batch.seq_range(s).len()).max().unwrap_or(0),
        };
        let layout = StepLayout {
            tokens_start,
            num_logit_rows: logit_rows.len(),
            num_rows: rows,
            num_seqs: seq_entries,
            mask_words,
            block_shift,
            max_keys,
        };
        let room = batch.carried.as_ref().map_or(0, |carried| carried.room);
        Ok(Self { words: descriptor, layout, carried, room })
    }

    /// Words the step's buffer must hold: its words and the room after them.
    pub(crate) fn needed(&self) -> usize {
        self.words.len() + self.room
    }
}

impl PagedStep {
    /// The step of `batch` (see [`StepWords::of`]) written into a buffer of `buffers` on `device`.
    pub(crate) fn new(
        batch: &ForwardBatch,
        pasts: &[usize],
        tables: &[&[u32]],
        block_size: usize,
        buffers: &Arc<StepBuffers>,
        device: &Device,
        padding: Option<&Padding>,
    ) -> Result<Self> {
        Self::write(&StepWords::of(batch, pasts, tables, block_size, padding)?, 0, buffers, device)
    }

    /// `words` written into a buffer of `buffers` on `device` (ONE upload) holding `extra_room`
    /// words past what they need.
    pub(crate) fn write(
        words: &StepWords,
        extra_room: usize,
        buffers: &Arc<StepBuffers>,
        device: &Device,
    ) -> Result<Self> {
        let held = buffers.write(&words.words, words.room + extra_room, device)?;
        Ok(Self {
            descriptor: held.section(0, words.layout.forward_words())?,
            held,
            layout: words.layout,
            carried: words.carried,
        })
    }

    /// A later step's `words` written into this step's buffer, at the same address (a captured
    /// step's): laid out as this step's, within its capacity.
    pub(crate) fn rewrite(&self, words: &StepWords) -> Result<()> {
        if words.layout != self.layout || words.needed() > self.capacity() {
            return Err(Error::Internal(format!(
                "a step of {:?} ({} words) rewritten into one of {:?} ({} words)",
                words.layout,
                words.needed(),
                self.layout,
                self.capacity()
            )));
        }
        self.held.rewrite(&words.words)
    }

    /// The address of the step's words (a CPU step's; tests of static buffers).
    #[cfg(test)]
    pub(crate) fn buffer_address(&self) -> usize {
        crate::model::candle::step_buffer::address(&self.descriptor)
    }

    /// Words the step's buffer holds.
    pub(crate) fn capacity(&self) -> usize {
        self.held.capacity()
    }

    /// The carried words `words` wrote into this step's buffer (a captured step's, rewritten).
    pub(crate) fn carried_section(&self, words: &StepWords) -> Result<Option<Tensor>> {
        words.carried.map(|(start, len)| self.held.section(start, len)).transpose()
    }

    /// The batch's carried words and their room `[words + room]` on the device, holding the
    /// step's buffer until the returned value is dropped; `None` when the batch carried nothing.
    pub(crate) fn into_carried(self) -> Result<Option<Carried>> {
        let Some((start, len)) = self.carried else { return Ok(None) };
        Ok(Some(Carried { words: self.held.section(start, len)?, _buffer: Box::new(self.held) }))
    }

    /// The rows' tokens `[n]` u32, on the device.
    pub(crate) fn tokens(&self) -> Result<Tensor> {
        Ok(self.descriptor.narrow(0, self.layout.tokens_start, self.layout.num_rows)?)
    }

    /// The rows that get logits `[L]` u32 (batch-wide, increasing), on the device.
    pub(crate) fn logit_rows(&self) -> Result<Tensor> {
        Ok(self.descriptor.narrow(0, self.layout.tokens_start + self.layout.num_rows, self.layout.num_logit_rows)?)
    }

    /// Writes the step's keys and values into their slots of one layer's `pool` (`[2, num_slots,
    /// num_kv_heads * head_dim]`) straight from the q/k/v projection's output `qkv [n, (H + 2 KV) *
    /// head_dim]` (unit column stride, the pool's dtype) — k heads normed and rotated as `heads`
    /// says (what `qkv_heads` computes), v heads as they are, rounded to the pool's dtype — and
    /// attends with the step's rows over the pool so written: the q heads are read from `qkv`
    /// and normed and rotated as they load (in f32) -> `[n, num_heads * head_dim]` in the pool's
    /// dtype (computed in f32, rounded once). One launch.
    pub(crate) fn write_and_attend(
        &self,
        pool: &Tensor,
        qkv: &Tensor,
        heads: &QkvHeads,
        scores: Scores,
    ) -> Result<Tensor> {
        let shape = Shape::from((self.layout.num_rows, heads.num_heads * heads.head_dim));
        if self.layout.num_rows == 0 {
            return Ok(Tensor::zeros(shape, pool.dtype(), qkv.device())?);
        }
        let op = WriteAndAttend {
            num_rows: self.layout.num_rows,
            num_seqs: self.layout.num_seqs,
            mask_words: self.layout.mask_words,
            heads,
            held: &self.held,
            block_shift: self.layout.block_shift,
            max_keys: self.layout.max_keys,
            scores,
            out: RefCell::new(None),
        };
        let run = || pool.inplace_op3(qkv, &self.descriptor, &op);
        // In place, with the output its own: the reference also builds its q heads in a buffer of
        // its own (the kernel, in shared memory).
        #[cfg(test)]
        let run = || crate::constraint::call_memory::count_as(1, run);
        run()?;
        let out = op.out.into_inner().ok_or_else(|| Error::Internal("paged attention: no output".into()))?;
        Ok(Tensor::from_storage(out, shape, BackpropOp::none(), false))
    }
}

/// Writes `rows [2 * num_kv_heads, n, head_dim]` f32 (k heads, then v heads) into the `slots
/// [n]` u32 of one layer's `pool` (`[2, num_slots, num_kv_heads * head_dim]`), rounded to its
/// dtype: a step's rows, or one sequence's appended ones.
pub(crate) fn write_rows(pool: &Tensor, rows: &Tensor, slots: &Tensor) -> Result<()> {
    let num_rows = slots.elem_count();
    if num_rows == 0 {
        return Ok(());
    }
    let write = || pool.inplace_op3(&rows.contiguous()?, slots, &WriteKv { num_rows });
    // In place, so no output buffer shows its launch to the launch count (`launches.rs`).
    #[cfg(test)]
    let write = || crate::constraint::call_memory::count_as(1, write);
    write()?;
    Ok(())
}

/// The descriptor's sections for a step of `n` rows, `num_seqs` sequences and `mask_words`.
struct Sections<'a> {
    row_seq: &'a [u32],
    row_pos: &'a [u32],
    row_slot: &'a [u32],
    seqs: &'a [u32],
    masks: &'a [u32],
    tables: &'a [u32],
}

impl<'a> Sections<'a> {
    fn of(descriptor: &'a [u32], n: usize, num_seqs: usize, mask_words: usize) -> candle_core::Result<Self> {
        let fixed = 3 * n + 4 * num_seqs + n * mask_words;
        if descriptor.len() < fixed {
            return Err(op_error("paged step", format!("descriptor of {} words, need {fixed}", descriptor.len())));
        }
        let (row_seq, rest) = descriptor.split_at(n);
        let (row_pos, rest) = rest.split_at(n);
        let (row_slot, rest) = rest.split_at(n);
        let (seqs, rest) = rest.split_at(4 * num_seqs);
        let (masks, tables) = rest.split_at(n * mask_words);
        Ok(Self { row_seq, row_pos, row_slot, seqs, masks, tables })
    }
}

/// A pool layer's (num_slots, row_len) and start offset, after checking it is `[2, slots, row_len]`
/// contiguous.
fn pool_shape(op: &str, layout: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    match (layout.dims(), layout.contiguous_offsets()) {
        ([2, slots, row_len], Some((start, _))) => Ok((*slots, *row_len, start)),
        (dims, _) => Err(op_error(op, format!("the pool must be [2, slots, row_len] contiguous, got {dims:?}"))),
    }
}

/// A contiguous u32 input (the step descriptor, or slots).
fn descriptor_of<'a>(op: &str, storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [u32]> {
    match (storage, layout.contiguous_offsets()) {
        (CpuStorage::U32(values), Some((start, end))) => Ok(&values[start..end]),
        _ => Err(op_error(op, "the step descriptor and slots must be contiguous u32".into())),
    }
}

struct WriteKv {
    num_rows: usize,
}

impl WriteKv {
    /// (kv_heads, head_dim, rows' start offset, pool's slots, row_len and start offset).
    fn check(&self, pool: &Layout, rows: &Layout) -> candle_core::Result<(usize, usize, usize, [usize; 3])> {
        let (slots, row_len, pool_start) = pool_shape("write_kv", pool)?;
        match (rows.dims(), rows.contiguous_offsets()) {
            ([heads, n, head_dim], Some((start, _)))
                if *n == self.num_rows && heads % 2 == 0 && (heads / 2) * head_dim == row_len =>
            {
                Ok((heads / 2, *head_dim, start, [slots, row_len, pool_start]))
            }
            (dims, _) => Err(op_error(
                "write_kv",
                format!(
                    "rows are {dims:?}, need [2 kv_heads, {}, head_dim] contiguous for rows of {row_len}",
                    self.num_rows
                ),
            )),
        }
    }

    fn reference<T: Elem>(&self, pool: &mut [T], rows: &[f32], row_slot: &[u32], shape: (usize, usize, [usize; 3])) {
        let (kv_heads, head_dim, [slots, row_len, _]) = shape;
        let n = self.num_rows;
        for which in 0..2 {
            for g in 0..kv_heads {
                for (r, &slot) in row_slot.iter().enumerate() {
                    let src = &rows[((which * kv_heads + g) * n + r) * head_dim..][..head_dim];
                    let dst = &mut pool[(which * slots + slot as usize) * row_len + g * head_dim..][..head_dim];
                    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = T::of(s));
                }
            }
        }
    }
}

impl InplaceOp3 for WriteKv {
    fn name(&self) -> &'static str {
        "paged-write-kv"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let (kv_heads, head_dim, rows_start, pool) = self.check(l1, l2)?;
        let row_slot = descriptor_of("write_kv", s3, l3)?;
        let slots = pool[0];
        if let Some(bad) = row_slot.iter().find(|&&slot| slot as usize >= slots) {
            return Err(op_error("write_kv", format!("slot {bad} is past the pool's {slots}")));
        }
        let CpuStorage::F32(rows) = s2 else { return Err(op_error("write_kv", "rows must be f32".into())) };
        let rows = &rows[rows_start..];
        let shape = (kv_heads, head_dim, pool);
        match s1 {
            CpuStorage::F32(p) => self.reference(&mut p[pool[2]..], rows, row_slot, shape),
            CpuStorage::BF16(p) => self.reference(&mut p[pool[2]..], rows, row_slot, shape),
            CpuStorage::F16(p) => self.reference(&mut p[pool[2]..], rows, row_slot, shape),
            _ => return Err(op_error("write_kv", "the pool must be f32, bf16 or f16".into())),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let (kv_heads, head_dim, rows_start, pool) = self.check(l1, l2)?;
        device::write_kv(s1, pool, (s2, rows_start), (s3, l3.start_offset()), [self.num_rows, kv_heads, head_dim])
    }
}

/// Checks that the projection `qkv` and the pool share a dtype and fit each other: (rows, row
/// stride, start of qkv; the pool's slots, row_len and start).
fn qkv_and_pool(
    op: &str,
    heads: &QkvHeads,
    num_rows: usize,
    qkv: &Layout,
    pool: &Layout,
) -> candle_core::Result<(usize, usize, [usize; 3])> {
    let (slots, row_len, pool_start) = pool_shape(op, pool)?;
    let (rows, row_stride, start) = heads.check_qkv(op, qkv)?;
    if rows != num_rows
        || heads.num_kv_heads == 0
        || !heads.num_heads.is_multiple_of(heads.num_kv_heads)
        || heads.num_kv_heads * heads.head_dim != row_len
        || heads.head_dim > MAX_HEAD_DIM
    {
        return Err(op_error(
            op,
            format!(
                "qkv has {rows} rows of {} heads ({} kv heads) of {}: need {num_rows} rows, heads a multiple of the kv \
                 heads, head_dim at most {MAX_HEAD_DIM} and kv heads * head_dim = the pool's {row_len}",
                heads.num_heads, heads.num_kv_heads, heads.head_dim
            ),
        ));
    }
    Ok((row_stride, start, [slots, row_len, pool_start]))
}

/// The projection's values on the CPU from `start` (the dtype of `pool`, which the caller matched).
fn qkv_values<'a, T: candle_core::WithDType>(
    op: &str,
    qkv: &'a CpuStorage,
    start: usize,
) -> candle_core::Result<&'a [T]> {
    match T::cpu_storage_as_slice(qkv) {
        Ok(values) => Ok(&values[start..]),
        Err(_) => Err(op_error(
            op,
            format!(
                "qkv is {:?}, the pool {:?}: they must share a dtype",
                candle_core::backend::BackendStorage::dtype(qkv),
                T::DTYPE
            ),
        )),
    }
}

/// The step's write and attention of one layer, in place on its pool; the attention's output,
/// which an in-place op cannot return, is left in `out`.
struct WriteAndAttend<'a> {
    num_rows: usize,
    num_seqs: usize,
    mask_words: usize,
    /// How the q heads are read from the projection's output (normed and rotated as they load).
    heads: &'a QkvHeads,
    /// The step's buffer, whose split-K scratch the GPU kernel uses (the reference needs none).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    held: &'a StepDescriptor,
    block_shift: u32,
    /// `StepLayout::max_keys`: how many key ranges the GPU cuts a row into (`split_count`); the
    /// reference refuses a row whose sequence holds more.
    max_keys: usize,
    scores: Scores,
    out: RefCell<Option<Storage>>,
}

/// Keys per split-K range of the GPU kernel (`KEYS_PER_SPLIT` in `cuda/paged_attention.cu`): a
/// row's keys are cut into ranges of this many, walked by blocks of their own and combined, so a
/// batch-1 step over a long context keeps many blocks busy; how a row is cut depends on its own
/// key count alone, never on its batch-mates.
const KEYS_PER_SPLIT: usize = 128;

/// The grid's split dimension: the most ranges a row of the step has (`max_keys` keys).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn split_count(max_keys: usize) -> usize {
    max_keys.div_ceil(KEYS_PER_SPLIT).max(1)
}

impl WriteAndAttend<'_> {
    /// The step's keys and values into their slots of `pool`: each row's k heads normed and
    /// rotated at its position, v heads as they are, rounded to the pool's dtype.
    fn write_reference<T: Elem>(
        &self,
        pool: &mut [T],
        qkv: &[T],
        d: &Sections,
        shape: (usize, [usize; 3]),
    ) -> candle_core::Result<()> {
        let (row_stride, [slots, row_len, _]) = shape;
        let (hd, kv_heads) = (self.heads.head_dim, self.heads.num_kv_heads);
        if let Some(bad) = d.row_slot.iter().find(|&&slot| slot as usize >= slots) {
            return Err(op_error(NAME, format!("slot {bad} is past the pool's {slots}")));
        }
        self.heads.with_tables(|tables| {
            tables.check_positions(d.row_pos)?;
            let mut values = vec![0f32; hd];
            for (which, kind) in [(0, HeadKind::K), (1, HeadKind::V)] {
                for g in 0..kv_heads {
                    for r in 0..self.num_rows {
                        let src = &qkv[r * row_stride + self.heads.offset(kind, g)..];
                        tables.head(src, kind, d.row_pos[r], &mut values);
                        let slot = d.row_slot[r] as usize;
                        let dst = &mut pool[(which * slots + slot) * row_len + g * hd..][..hd];
                        dst.iter_mut().zip(&values).for_each(|(o, &v)| *o = T::of(v));
                    }
                }
            }
            Ok(())
        })
    }

    /// The write, then attention over the written pool.
    fn reference<T: Elem>(
        &self,
        pool: &mut [T],
        qkv: &[T],
        d: &Sections,
        shape: (usize, [usize; 3]),
    ) -> candle_core::Result<Vec<T>> {
        self.write_reference(pool, qkv, d, shape)?;
        self.attention_reference(qkv, pool, d, shape)
    }

    /// The slots row `r` sees, past positions ascending then step rows ascending; None where a
    /// past position lies past its table.
    fn keys_of(&self, d: &Sections, r: usize) -> Option<Vec<usize>> {
        let s = d.row_seq[r] as usize;
        let [past, first, rows, table_start] = [0, 1, 2, 3].map(|i| d.seqs[4 * s + i] as usize);
        let table = d.tables.get(table_start..)?;
        let p = d.row_pos[r] as usize;
        let sees = |key_position: usize| self.scores.window.is_none_or(|w| p.saturating_sub(key_position) < w);
        let mask = &d.masks[r * self.mask_words..][..self.mask_words];
        let past_slots = (0..past).filter(|&c| sees(c)).map(|c| slot_of(table, c, self.block_shift));
        let step_slots = (0..rows)
            .filter(|&j| (mask[j / 32] >> (j % 32)) & 1 == 1 && sees(d.row_pos[first + j] as usize))
            .map(|j| Some(d.row_slot[first + j] as usize));
        past_slots.chain(step_slots).collect()
    }

    /// The step's q heads `[num_heads, n, head_dim]` f32 from the projection `qkv` (row stride
    /// `row_stride`): what `qkv_heads` computes, each row at its position.
    fn queries<T: Elem>(&self, qkv: &[T], row_stride: usize, d: &Sections) -> candle_core::Result<Vec<f32>> {
        let (n, hd) = (self.num_rows, self.heads.head_dim);
        self.heads.with_tables(|tables| {
            tables.check_positions(d.row_pos)?;
            let mut q = vec![0f32; self.heads.num_heads * n * hd];
            q.par_chunks_mut(n * hd).enumerate().for_each(|(h, block)| {
                for (r, dst) in block.chunks_mut(hd).enumerate() {
                    let src = &qkv[r * row_stride + self.heads.offset(HeadKind::Q, h)..];
                    tables.head(src, HeadKind::Q, d.row_pos[r], dst);
                }
            });
            Ok(q)
        })
    }

    fn attention_reference<T: Elem>(
        &self,
        qkv: &[T],
        pool: &[T],
        d: &Sections,
        shape: (usize, [usize; 3]),
    ) -> candle_core::Result<Vec<T>> {
        let (row_stride, [slots, row_len, _]) = shape;
        let q = self.queries(qkv, row_stride, d)?;
        let (num_heads, head_dim) = (self.heads.num_heads, self.heads.head_dim);
        let n = self.num_rows;
        let group = num_heads / self.heads.num_kv_heads;
        let Scores { scale, logit_softcap, .. } = self.scores;
        let keys: Vec<Option<Vec<usize>>> = (0..n).map(|r| self.keys_of(d, r)).collect();
        let bad =
            |k: &Option<Vec<usize>>| k.as_ref().is_none_or(|k| k.is_empty() || k.iter().any(|&slot| slot >= slots));
        if let Some(r) = keys.iter().position(bad) {
            return Err(op_error(
                NAME,
                format!("row {r} sees no key, or a position past its table, or a slot past the pool's {slots}"),
            ));
        }
        // The device grid cuts `max_keys` keys into splits: a row whose sequence holds more would
        // lose keys there (a captured step's grid is its key's, so its layout must cover it).
        let held = |r: usize| {
            let s = d.row_seq[r] as usize;
            d.seqs[4 * s] as usize + d.seqs[4 * s + 2] as usize
        };
        if let Some(r) = (0..n).find(|&r| held(r) > self.max_keys) {
            return Err(op_error(
                NAME,
                format!("row {r}'s sequence holds {} keys, past the {} the grid covers", held(r), self.max_keys),
            ));
        }
        let keys: Vec<Vec<usize>> = keys.into_iter().flatten().collect();
        let mut out = vec![T::of(0.0); n * num_heads * head_dim];
        out.par_chunks_mut(num_heads * head_dim).enumerate().for_each(|(r, row_out)| {
            let mut sums = vec![0f32; head_dim];
            for (h, dst) in row_out.chunks_mut(head_dim).enumerate() {
                let query = &q[(h * n + r) * head_dim..][..head_dim];
                let offset = (h / group) * head_dim;
                let scores: Vec<f32> = keys[r]
                    .iter()
                    .map(|&slot| {
                        let key = &pool[slot * row_len + offset..][..head_dim];
                        let dot = query.iter().zip(key).map(|(a, b)| a * b.get()).sum::<f32>() * scale;
                        logit_softcap.map_or(dot, |cap| cap * (dot / cap).tanh())
                    })
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total = weights.iter().sum::<f32>();
                sums.fill(0.0);
                for (&slot, w) in keys[r].iter().zip(&weights) {
                    let value = &pool[(slots + slot) * row_len + offset..][..head_dim];
                    sums.iter_mut().zip(value).for_each(|(o, v)| *o += w * v.get());
                }
                dst.iter_mut().zip(&sums).for_each(|(o, sum)| *o = T::of(sum / total));
            }
        });
        Ok(out)
    }
}

/// The fused op's name in errors (and the kernel's).
const NAME: &str = "paged_attention";

impl InplaceOp3 for WriteAndAttend<'_> {
    fn name(&self) -> &'static str {
        "paged-write-and-attend"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let (row_stride, start, pool) = qkv_and_pool(NAME, self.heads, self.num_rows, l2, l1)?;
        let d = Sections::of(descriptor_of(NAME, s3, l3)?, self.num_rows, self.num_seqs, self.mask_words)?;
        let shape = (row_stride, pool);
        let out = match s1 {
            CpuStorage::F32(p) => {
                CpuStorage::F32(self.reference(&mut p[pool[2]..], qkv_values(NAME, s2, start)?, &d, shape)?)
            }
            CpuStorage::BF16(p) => {
                CpuStorage::BF16(self.reference(&mut p[pool[2]..], qkv_values(NAME, s2, start)?, &d, shape)?)
            }
            CpuStorage::F16(p) => {
                CpuStorage::F16(self.reference(&mut p[pool[2]..], qkv_values(NAME, s2, start)?, &d, shape)?)
            }
            _ => return Err(op_error(NAME, "the pool must be f32, bf16 or f16".into())),
        };
        *self.out.borrow_mut() = Some(Storage::Cpu(out));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let (row_stride, start, pool) = qkv_and_pool(NAME, self.heads, self.num_rows, l2, l1)?;
        let out = device::paged_attention(self, (s2, start, row_stride), s1, pool, (s3, l3.start_offset()))?;
        *self.out.borrow_mut() = Some(Storage::Cuda(out));
        Ok(())
    }
}

/// Launching `cuda/paged_attention.cu`'s kernels in the pool's dtype.
#[cfg(feature = "cuda")]
mod device {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDType, WrapErr};
    use candle_core::CudaStorage;

    use crate::model::candle::fused::device::{with_device_tables, DeviceTables};
    use crate::nvrtc::{by_dtype, dtype_suffix, function, BLOCK, PAGED_ATTENTION};

    /// Threads per attention block: the kernel's WARPS warps (BLOCK, which heads.cuh's reduction
    /// over a head reads).
    const ATTENTION_THREADS: u32 = 8 * 32;

    fn load(
        device: &candle_core::CudaDevice,
        kernel: &str,
        dtype: candle_core::DType,
    ) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaFunction> {
        let name = format!("{kernel}_{}", dtype_suffix(dtype)?);
        function(device, &PAGED_ATTENTION, &name).map_err(|e| candle_core::Error::Msg(e.to_string()))
    }

    /// `write_kv_<dtype>(pool, rows, slots, n, kv_heads, head_dim, num_slots)`.
    pub fn write_kv(
        pool: &mut CudaStorage,
        [slots, _, pool_start]: [usize; 3],
        rows: (&CudaStorage, usize),
        slots_in: (&CudaStorage, usize),
        [n, kv_heads, head_dim]: [usize; 3],
    ) -> candle_core::Result<()> {
        let dtype = pool.dtype();
        by_dtype!(dtype, T => {
            let device = pool.device().clone();
            let func = load(&device, "write_kv", dtype)?;
            let rows_view = rows.0.as_cuda_slice::<f32>()?.slice(rows.1..);
            let slots_view = slots_in.0.as_cuda_slice::<u32>()?.slice(slots_in.1..);
            let mut pool_view = pool.as_cuda_slice_mut::<T>()?.slice_mut(pool_start..);
            let total = 2 * n * kv_heads * head_dim;
            let grid = total.div_ceil(BLOCK as usize).clamp(1, 4096) as u32;
            let (n, kv_heads, head_dim, slots) = (n as u32, kv_heads as u32, head_dim as u32, slots as u64);
            let stream = device.cuda_stream();
            let mut builder = stream.launch_builder(&func);
            builder.arg(&mut pool_view).arg(&rows_view).arg(&slots_view);
            builder.arg(&n).arg(&kv_heads).arg(&head_dim).arg(&slots);
            let config = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match write_kv's signature; the host checked the shapes, and
            // the slots lie in blocks the written sequences hold (PagedStep::new, PagedKv::append).
            unsafe { builder.launch(config) }.w()?;
            Ok(())
        })
    }

    /// `paged_attention_<dtype>`: one block per (row, head, split), writing the step's keys and
    /// values into the pool as it attends.
    pub fn paged_attention(
        op: &super::WriteAndAttend,
        qkv: (&CudaStorage, usize, usize),
        pool: &mut CudaStorage,
        [slots, _, pool_start]: [usize; 3],
        descriptor: (&CudaStorage, usize),
    ) -> candle_core::Result<CudaStorage> {
        if qkv.0.dtype() != pool.dtype() {
            candle_core::bail!("paged_attention: qkv and the pool must share a dtype");
        }
        by_dtype!(pool.dtype(), T => with_device_tables(op.heads, |tables| {
            typed::<T>(op, qkv, tables, pool, [slots, pool_start], descriptor)
        }))
    }

    fn typed<T: CudaDType + DeviceRepr>(
        op: &super::WriteAndAttend,
        (qkv, qkv_start, row_stride): (&CudaStorage, usize, usize),
        tables: &DeviceTables,
        pool: &mut CudaStorage,
        [slots, pool_start]: [usize; 2],
        descriptor: (&CudaStorage, usize),
    ) -> candle_core::Result<CudaStorage> {
        let device = pool.device().clone();
        let func = load(&device, "paged_attention", pool.dtype())?;
        let heads = op.heads;
        let (num_heads, head_dim) = (heads.num_heads, heads.head_dim);
        let qkv_view = qkv.as_cuda_slice::<T>()?.slice(qkv_start..);
        let mut pool_view = pool.as_cuda_slice_mut::<T>()?.slice_mut(pool_start..);
        let desc_view = descriptor.0.as_cuda_slice::<u32>()?.slice(descriptor.1..);
        // SAFETY: every element is written by the kernel (one block per row and head, or the last
        // of its splits).
        let mut out: CudaSlice<T> = unsafe { device.alloc::<T>(op.num_rows * num_heads * head_dim) }?;
        let splits = super::split_count(op.max_keys);
        // With one split the kernel reads neither buffer (one unread element each). The step's
        // kept scratch: no allocation and no zeroing per layer (the counters are zero between
        // launches: the last split of each (row, head) sets its counter back).
        let (partial_len, counter_len) = if splits > 1 {
            (op.num_rows * num_heads * splits * (head_dim + 2), op.num_rows * num_heads)
        } else {
            (1, 1)
        };
        let scratch =
            op.held.split_scratch(partial_len, counter_len).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let (partials, partials_layout) = scratch.partials.storage_and_layout();
        let (counters, counters_layout) = scratch.counters.storage_and_layout();
        let (candle_core::Storage::Cuda(partials), candle_core::Storage::Cuda(counters)) = (&*partials, &*counters)
        else {
            candle_core::bail!("paged_attention: the split-K scratch must be on the device");
        };
        let partials = partials.as_cuda_slice::<f32>()?.slice(partials_layout.start_offset()..);
        let counters = counters.as_cuda_slice::<u32>()?.slice(counters_layout.start_offset()..);
        let (q_norm, has_q) = tables.norm_arg(&tables.q_norm);
        let (k_norm, has_k) = tables.norm_arg(&tables.k_norm);
        let rope = [heads.rope_dims, usize::from(heads.interleaved)].map(|x| x as u32);
        let u32s = [op.num_rows, op.num_seqs, op.mask_words, num_heads, heads.num_kv_heads, head_dim].map(|x| x as u32);
        let (row_stride, slots) = (row_stride as u64, slots as u64);
        let cap = op.scores.logit_softcap.unwrap_or(0.0);
        let window = op.scores.window.map_or(0, |w| w.min(u32::MAX as usize) as u32);
        let stream = device.cuda_stream();
        let mut builder = stream.launch_builder(&func);
        builder.arg(&qkv_view).arg(&row_stride).arg(q_norm).arg(&has_q).arg(k_norm).arg(&has_k);
        builder.arg(&tables.cos).arg(&tables.sin).arg(&rope[0]).arg(&rope[1]).arg(&heads.eps);
        builder.arg(&mut pool_view).arg(&desc_view).arg(&mut out);
        for x in &u32s {
            builder.arg(x);
        }
        builder.arg(&slots).arg(&op.block_shift).arg(&op.scores.scale).arg(&cap).arg(&window);
        // The kernel writes both through these views: the step holds the scratch alone (its
        // buffer is taken from the free list) and the layers' launches run in turn on one stream.
        builder.arg(&partials).arg(&counters);
        let config = LaunchConfig {
            grid_dim: (op.num_rows as u32, num_heads as u32, splits as u32),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match paged_attention's signature; the host checked qkv's and the
        // pool's shapes (head_dim at most 256, the kernel's per-lane arrays and shared heads), the
        // positions against the rotary tables' context (on the CPU path; the engine sizes them
        // to the context), and the descriptor's tables and slots lie in the pool
        // (PagedStep::new), and the partials and counters hold what `splits` asks for.
        unsafe { builder.launch(config) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(out, device))
    }
}

/// The paged ops on `device` against their CPU references on the same inputs (pools in f32 and
/// bf16): two sequences (a chain after 300 positions, three split-K ranges on a GPU; a tree
/// after 17) in blocks of 16 whose tables are out of order, plain, windowed and soft-capped. `(op and case, largest absolute
/// difference, tolerance)`; on the CPU it compares the reference with itself, the device check
/// (`scripts/gpu_bench.py`) runs it on a GPU.
pub fn check_against_reference(device: &Device) -> Result<Vec<(String, f32, f32)>> {
    use crate::model::candle::fused::max_abs_diff;
    use crate::model::forward::SeqRows;

    let (heads, kv_heads, head_dim, block_size, num_blocks) = (8, 2, 128, 16, 24);
    let slots = block_size * num_blocks;
    let seqs = [SeqRows::tree(vec![1, 2, 3], vec![-1, 0, 1]), SeqRows::tree(vec![4, 5, 6, 7, 8], vec![-1, 0, 0, 1, 1])];
    // The chain's rows see 301-303 keys: three split-K ranges on a GPU (the tree's one).
    let pasts = [300, 17];
    let order: Vec<u32> = (0..num_blocks as u32).map(|i| (5 * i + 7) % num_blocks as u32).collect();
    let tables: [&[u32]; 2] = [&order[..19], &order[19..21]];
    let batch = ForwardBatch::new(&seqs, &pasts, Vec::new())?;
    let n = batch.num_rows();
    let cpu = Device::Cpu;
    let layer = LayerHeads::draw(heads, kv_heads, head_dim, 320, 1)?;
    let dev_layer = layer.to_device(device)?;
    let qkv = (draw(&[n, (heads + 2 * kv_heads) * head_dim], 2)? * 0.25)?;
    let mut report = Vec::new();
    // bf16 outputs: one rounding of results that differ in their last f32 bits may land a bf16
    // step (2^-8 of the value) apart; the written keys reach ~4 (2^-6 apart).
    for (dtype, tolerance, write_tolerance) in [(DType::F32, 1e-4f32, 1e-4f32), (DType::BF16, 1e-2, 3e-2)] {
        let pool = (draw(&[2, slots, kv_heads * head_dim], 3)? * 0.25)?.to_dtype(dtype)?;
        let dev_pool = pool.to_device(device)?;
        let (qkv, dev_qkv) = (qkv.to_dtype(dtype)?, qkv.to_dtype(dtype)?.to_device(device)?);
        let buffers = Arc::new(StepBuffers::default());
        let step = PagedStep::new(&batch, &pasts, &tables, block_size, &buffers, &cpu, None)?;
        let dev_step = PagedStep::new(&batch, &pasts, &tables, block_size, &buffers, device, None)?;
        for normed in [false, true] {
            let (op, dev_op) = (layer.op(normed)?, dev_layer.op(normed)?);
            let name = if normed { "normed " } else { "" };
            for (case, logit_softcap, window) in
                [("plain", None, None), ("window 8", None, Some(8)), ("softcap", Some(2.0), None)]
            {
                let scores = Scores { scale: 1.0 / (head_dim as f32).sqrt(), logit_softcap, window };
                let want = step.write_and_attend(&pool, &qkv, &op, scores)?;
                let got = dev_step.write_and_attend(&dev_pool, &dev_qkv, &dev_op, scores)?;
                report.push((format!("paged_attention {case} {name}{dtype:?}"), max_abs_diff(&want, &got)?, tolerance));
            }
            // The keys and values the launches wrote (the same each time).
            report.push((
                format!("paged_attention write {name}{dtype:?}"),
                max_abs_diff(&pool, &dev_pool)?,
                write_tolerance,
            ));
        }
    }
    Ok(report)
}

/// Seeded values in [-4, 4) of `shape` on the CPU (f32).
fn draw(shape: &[usize], seed: u64) -> Result<Tensor> {
    let values = crate::model::candle::fused::seeded_values(shape.iter().product(), seed);
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
}

/// A layer's head arithmetic drawn at random, for the checks and tests: rotary tables over a
/// `context` (halves, every dim rotating) and q/k norms.
struct LayerHeads {
    sizes: [usize; 3],
    cos: Tensor,
    sin: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
}

impl LayerHeads {
    fn draw(heads: usize, kv_heads: usize, head_dim: usize, context: usize, seed: u64) -> Result<Self> {
        let table = |s| -> Result<Tensor> { Ok((draw(&[context, head_dim / 2], s)? * 0.25)?) };
        let norm = |s| -> Result<Tensor> { Ok((draw(&[head_dim], s)? * 0.25)?) };
        Ok(Self {
            sizes: [heads, kv_heads, head_dim],
            cos: table(seed)?,
            sin: table(seed + 1)?,
            q_norm: norm(seed + 2)?,
            k_norm: norm(seed + 3)?,
        })
    }

    fn to_device(&self, device: &Device) -> Result<Self> {
        let on = |t: &Tensor| t.to_device(device);
        Ok(Self {
            sizes: self.sizes,
            cos: on(&self.cos)?,
            sin: on(&self.sin)?,
            q_norm: on(&self.q_norm)?,
            k_norm: on(&self.k_norm)?,
        })
    }

    fn spec(&self, normed: bool) -> HeadsSpec<'_> {
        let [num_heads, num_kv_heads, head_dim] = self.sizes;
        HeadsSpec {
            num_heads,
            num_kv_heads,
            head_dim,
            rope_dims: head_dim,
            interleaved: false,
            cos: &self.cos,
            sin: &self.sin,
            q_norm: normed.then_some(&self.q_norm),
            k_norm: normed.then_some(&self.k_norm),
            eps: 1e-6,
        }
    }

    fn op(&self, normed: bool) -> Result<QkvHeads> {
        QkvHeads::new(&self.spec(normed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::candle::attention::{attention, tree_attention};
    use crate::model::candle::fused::{max_abs_diff, seeded_values};
    use crate::model::forward::SeqRows;

    const HEADS: usize = 4;
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 40;

    fn tensor(shape: &[usize], seed: u64) -> Tensor {
        let values = seeded_values(shape.iter().product(), seed);
        (Tensor::from_vec(values, shape, &Device::Cpu).unwrap() * 0.3).unwrap()
    }

    /// The q/k/v projection's output of `n` rows (f32) and a layer's heads over a context of 64.
    fn projection(n: usize, seed: u64) -> (Tensor, LayerHeads) {
        let layer = LayerHeads::draw(HEADS, KV_HEADS, HEAD_DIM, 64, seed).unwrap();
        (tensor(&[n, (HEADS + 2 * KV_HEADS) * HEAD_DIM], seed + 10), layer)
    }

    /// `qkv_heads` of the projection at the batch's positions: `[HEADS + 2 KV_HEADS, n, hd]` f32.
    fn heads_of(qkv: &Tensor, batch: &ForwardBatch, spec: &HeadsSpec) -> Tensor {
        let positions: Vec<u32> = batch.positions.iter().map(|&p| p as u32).collect();
        let positions = Tensor::new(positions.as_slice(), &Device::Cpu).unwrap();
        crate::model::candle::fused::qkv_heads(qkv, &positions, spec).unwrap()
    }

    /// `(pool, k, v)` for `positions` of one sequence laid out through `table`: the pool holds the
    /// positions' rows at their slots, `k`, `v` (`[kv_heads, positions, hd]`) them in order.
    fn laid_out(table: &[u32], block_size: usize, positions: usize, seed: u64) -> (Tensor, Tensor, Tensor) {
        let slots = block_size * (*table.iter().max().unwrap() as usize + 1);
        let pool = tensor(&[2, slots, KV_HEADS * HEAD_DIM], seed);
        let slot_of = |p: usize| table[p / block_size] * block_size as u32 + (p % block_size) as u32;
        let index = Tensor::new((0..positions).map(slot_of).collect::<Vec<u32>>().as_slice(), &Device::Cpu).unwrap();
        let heads = |which: usize| {
            let rows = pool.get(which).unwrap().index_select(&index, 0).unwrap(); // [positions, row_len]
            rows.reshape((positions, KV_HEADS, HEAD_DIM)).unwrap().transpose(0, 1).unwrap().contiguous().unwrap()
        };
        let (k, v) = (heads(0), heads(1));
        (pool, k, v)
    }

    /// A chain after a past and a tree after another, in one step: each sequence's rows equal
    /// The grid has as many split-K ranges as the step's longest row: 128 keys each.
    /// The batch's carried words ride the step's one upload, after every section the forward
    /// reads, with their room after them, in the step's static buffer: the same address step
    /// after step. A batch that carries nothing gets none back.
    #[test]
    fn carried_words_ride_the_one_upload_in_a_static_buffer() {
        use crate::model::candle::step_buffer::address;
        use crate::model::candle::UPLOADS;
        use crate::model::forward::{CarriedWords, LogitRows};
        let buffers = Arc::new(StepBuffers::default());
        let seqs = [SeqRows::chain(vec![1, 2, 3], LogitRows::All)];
        let step = |carried: Option<CarriedWords>| {
            let batch = ForwardBatch { carried, ..ForwardBatch::new(&seqs, &[0], vec![]).unwrap() };
            PagedStep::new(&batch, &[0], &[&[0]], 16, &buffers, &Device::Cpu, None).unwrap()
        };
        let mut first_address = None;
        for i in 0..3u32 {
            let uploads = UPLOADS.get();
            let paged = step(Some(CarriedWords { words: vec![7 + i, 8, 9], room: 100 }));
            assert_eq!(UPLOADS.get() - uploads, 1, "step {i}");
            let tokens = paged.tokens().unwrap().to_vec1::<u32>().unwrap();
            let carried = paged.into_carried().unwrap().expect("carried words");
            assert_eq!((tokens, carried.words.dims1().unwrap()), (vec![1, 2, 3], 103));
            assert_eq!(carried.words.narrow(0, 0, 3).unwrap().to_vec1::<u32>().unwrap(), [7 + i, 8, 9]);
            let at = address(&carried.words);
            assert_eq!(*first_address.get_or_insert(at), at, "step {i}: the same buffer");
        }
        assert!(step(None).into_carried().unwrap().is_none());
    }

    #[test]
    fn split_k_ranges_follow_the_longest_rows_keys() {
        assert_eq!(split_count(0), 1);
        assert_eq!(split_count(128), 1);
        assert_eq!(split_count(129), 2);
        // Llama-8B decode over 1k keys: 8 ranges per (row, head), 256 blocks at batch 1.
        assert_eq!(split_count(1024), 8);
    }

    /// attention.rs's chain and tree attention over the same keys, with and without a window and
    /// soft-cap, for several block sizes, of the q heads `qkv_heads` computes (normed and rotated:
    /// what the paged kernel does to each q head as it loads it).
    #[test]
    fn the_reference_is_attention_rs_on_chains_and_trees() {
        let parents = vec![-1, 0, 0, 1, 2, 4];
        for block_size in [1, 4, 16] {
            let (chain_past, tree_past) = (23, 9);
            let blocks = |len: usize, first: u32| -> Vec<u32> {
                // Blocks out of order: reversed from `first`.
                (0..len.div_ceil(block_size) as u32).rev().map(|b| first + b).collect()
            };
            let chain_table = blocks(chain_past + 3, 0);
            let tree_table = blocks(tree_past + parents.len(), chain_table.len() as u32);
            let mut table = chain_table.clone();
            table.extend(&tree_table);
            let seqs = [SeqRows::tree(vec![1, 2, 3], vec![-1, 0, 1]), SeqRows::tree(vec![0; 6], parents.clone())];
            let batch = ForwardBatch::new(&seqs, &[chain_past, tree_past], Vec::new()).unwrap();
            let n = batch.num_rows();
            // One pool holding both sequences; each sequence's keys in position order.
            let (pool, _, _) = laid_out(&table, block_size, table.len() * block_size, 7);
            let keys_of = |t: &[u32], len| {
                let (slots, row_len) = (block_size * table.len(), KV_HEADS * HEAD_DIM);
                let slot_of = |p: usize| t[p / block_size] as usize * block_size + p % block_size;
                let index: Vec<u32> = (0..len).map(|p| slot_of(p) as u32).collect();
                let index = Tensor::new(index.as_slice(), &Device::Cpu).unwrap();
                let pick = |which: usize| {
                    let rows = pool.narrow(0, which, 1).unwrap().reshape((slots, row_len)).unwrap();
                    let rows = rows.index_select(&index, 0).unwrap();
                    rows.reshape((len, KV_HEADS, HEAD_DIM)).unwrap().transpose(0, 1).unwrap().contiguous().unwrap()
                };
                (pick(0), pick(1))
            };
            let (qkv, layer) = projection(n, 8);
            let spec = layer.spec(true);
            let q = heads_of(&qkv, &batch, &spec).narrow(0, 0, HEADS).unwrap(); // [HEADS, n, hd]
            let step = PagedStep::new(
                &batch,
                &[chain_past, tree_past],
                &[&chain_table, &tree_table],
                block_size,
                &Arc::default(),
                &Device::Cpu,
                None,
            )
            .unwrap();
            for (logit_softcap, window) in [(None, None), (Some(1.5), None), (None, Some(5)), (Some(1.5), Some(12))] {
                let scores = Scores { scale: 0.4, logit_softcap, window };
                // [n, heads * hd]; the step's keys and values land in the pool the reference reads below.
                let got = step.write_and_attend(&pool, &qkv, &QkvHeads::new(&spec).unwrap(), scores).unwrap();
                let (k, v) = keys_of(&chain_table, chain_past + 3);
                let chain = attention(&q.narrow(1, 0, 3).unwrap(), &k, &v, chain_past, scores).unwrap();
                let (k, v) = keys_of(&tree_table, tree_past + 6);
                let sees: Vec<Vec<usize>> = (3..n)
                    .map(|row| (0..tree_past).chain(batch.path(1, row).iter().map(|a| tree_past + a)).collect())
                    .collect();
                let tree = tree_attention(&q.narrow(1, 3, 6).unwrap(), &k, &v, &sees, scores).unwrap();
                let want = Tensor::cat(&[chain, tree], 0).unwrap();
                let diff = max_abs_diff(&got, &want).unwrap();
                assert!(diff < 1e-5, "block size {block_size}, softcap {logit_softcap:?}, window {window:?}: {diff}");
            }
        }
    }

    /// A sequence's rows are the same bits alone as beside another sequence's.
    #[test]
    fn a_rows_output_does_not_depend_on_its_batch_mates() {
        let table: Vec<u32> = (0..8).rev().collect();
        let (pool, _, _) = laid_out(&table, 4, 32, 3);
        let (qkv, layer) = projection(7, 4);
        let heads = layer.op(true).unwrap();
        let scores = Scores { scale: 0.3, logit_softcap: None, window: None };
        // Together: a 4-row tree (rows 1 and 2 siblings) and a 3-row chain on another table.
        let other: Vec<u32> = vec![0, 1, 2];
        let seqs = [SeqRows::tree(vec![0; 4], vec![-1, 0, 0, 2]), SeqRows::tree(vec![0; 3], vec![-1, 0, 1])];
        let batch = ForwardBatch::new(&seqs, &[11, 5], Vec::new()).unwrap();
        let together =
            PagedStep::new(&batch, &[11, 5], &[&table, &other], 4, &Arc::default(), &Device::Cpu, None).unwrap();
        let together = together.write_and_attend(&pool, &qkv, &heads, scores).unwrap();
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        // Each sequence alone, and the tree's last row as the step's only row but its path.
        for (s, rows) in [(0, 0..4), (1, 4..7)] {
            let alone = ForwardBatch::new(&seqs[s..s + 1], &[[11, 5][s]], Vec::new()).unwrap();
            let alone = PagedStep::new(
                &alone,
                &[[11, 5][s]],
                &[[&table[..], &other[..]][s]],
                4,
                &Arc::default(),
                &Device::Cpu,
                None,
            )
            .unwrap();
            let alone =
                alone.write_and_attend(&pool, &qkv.narrow(0, rows.start, rows.len()).unwrap(), &heads, scores).unwrap();
            assert_eq!(bits(&together.narrow(0, rows.start, rows.len()).unwrap()), bits(&alone), "sequence {s}");
        }
    }

    /// The step's keys and values land in their slots (through out-of-order blocks) in the pool's
    /// dtype, each what `qkv_heads` computes (k normed and rotated at its position, v as it is),
    /// rounded once; other slots are untouched; a row without a block is refused before any write.
    #[test]
    fn the_step_writes_each_rows_keys_and_values_in_its_slot() {
        let table: Vec<u32> = vec![3, 1];
        let pool = Tensor::zeros((2, 16, KV_HEADS * HEAD_DIM), DType::BF16, &Device::Cpu).unwrap();
        let batch = ForwardBatch::new(&[SeqRows::tree(vec![0; 3], vec![-1, 0, 1])], &[3], Vec::new()).unwrap();
        let step = PagedStep::new(&batch, &[3], &[&table], 4, &Arc::default(), &Device::Cpu, None).unwrap();
        let (qkv, layer) = projection(3, 9);
        let qkv = qkv.to_dtype(DType::BF16).unwrap();
        let spec = layer.spec(true);
        let scores = Scores { scale: 0.3, logit_softcap: None, window: None };
        step.write_and_attend(&pool, &qkv, &QkvHeads::new(&spec).unwrap(), scores).unwrap();
        // [2 KV_HEADS, 3, hd]: k heads, then v heads, rounded as the pool stores them.
        let rows = heads_of(&qkv, &batch, &spec).narrow(0, HEADS, 2 * KV_HEADS).unwrap();
        let rows = rows.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        // Positions 3, 4, 5: block 3 row 3 (slot 15), block 1 rows 0 and 1 (slots 4, 5).
        let pool = pool.to_dtype(DType::F32).unwrap();
        for (r, slot) in [(0, 15), (1, 4), (2, 5)] {
            for which in 0..2 {
                let stored = pool.get(which).unwrap().get(slot).unwrap();
                let heads = rows.narrow(0, which * KV_HEADS, KV_HEADS).unwrap().narrow(1, r, 1).unwrap();
                assert_eq!(max_abs_diff(&stored, &heads.flatten_all().unwrap()).unwrap(), 0.0, "row {r} slot {slot}");
            }
        }
        let sum = |t: &Tensor| -> f32 { t.abs().unwrap().sum_all().unwrap().to_scalar().unwrap() };
        assert!((sum(&pool) - sum(&rows)).abs() < 1e-2, "nothing else written");
        let long = ForwardBatch::new(&[SeqRows::tree(vec![0; 6], vec![-1, 0, 1, 2, 3, 4])], &[3], Vec::new()).unwrap();
        let e =
            PagedStep::new(&long, &[3], &[&table], 4, &Arc::default(), &Device::Cpu, None).err().unwrap().to_string();
        assert!(e.contains("no block"), "{e}");
    }

    /// A padded step's descriptor is laid out by its shape and table width alone: two batches of
    /// other pasts, row counts and sequence counts but one shape share its length and every
    /// section's offset; a batch that does not fit the shape is refused.
    #[test]
    fn a_padded_descriptor_is_laid_out_by_its_shape_alone() {
        use crate::model::candle::step_shape::StepShape;
        let shape = StepShape { num_seqs: 4, rows_per_seq: 5 };
        let layout = |seqs: &[SeqRows], pasts: &[usize], tables: &[&[u32]]| {
            let batch = ForwardBatch::new(seqs, pasts, Vec::new()).unwrap();
            let padding = Padding::new(shape, 60, tables);
            let step = PagedStep::new(&batch, pasts, tables, 4, &Arc::default(), &Device::Cpu, Some(&padding)).unwrap();
            let l = step.layout;
            (step.descriptor.elem_count(), l.tokens_start, l.num_rows, l.num_seqs, l.max_keys)
        };
        let chain = |n: usize| SeqRows::chain(vec![1; n], crate::model::LogitRows::All);
        let a = layout(&[chain(5), chain(1)], &[3, 9], &[&[0, 1], &[2, 3, 4]]);
        let b = layout(
            &[SeqRows::tree(vec![0; 4], vec![-1, 0, 0, 1]), chain(2), chain(3)],
            &[0, 6, 1],
            &[&[5], &[6, 7, 9], &[8]],
        );
        assert_eq!(a, b);
        assert_eq!(
            (a.2, a.3, a.4),
            (20, 5, 16),
            "20 rows, 4 sequence entries and the padding rows', 4 blocks of 4 keys"
        );
        let batch = ForwardBatch::new(&[chain(6)], &[0], Vec::new()).unwrap();
        let padding = Padding::new(shape, 60, &[&[0, 1]]);
        let e = PagedStep::new(&batch, &[0], &[&[0, 1]], 4, &Arc::default(), &Device::Cpu, Some(&padding));
        assert!(e.err().unwrap().to_string().contains("do not fit the padded"));
    }

    /// Past 32 padding rows (more than a mask word holds), attention of a padded step gives the
    /// batch's rows the eager step's bits, and each padding row sees the dummy slot alone.
    #[test]
    fn many_padding_rows_leave_the_batchs_rows_alone() {
        use crate::model::candle::step_shape::StepShape;
        use crate::model::LogitRows;
        let blocks: Vec<u32> = (0..11).collect();
        let (pool, _, _) = laid_out(&blocks, 4, 44, 2); // block 10 (slots 40..44): the dummy
        let seqs = [
            SeqRows::chain(vec![1; 17], LogitRows::All),
            SeqRows::chain(vec![2], LogitRows::All),
            SeqRows::chain(vec![3], LogitRows::All),
        ];
        let pasts = [6, 9, 3];
        let tables: [&[u32]; 3] = [&blocks[..6], &blocks[6..9], &blocks[9..10]];
        let batch = ForwardBatch::new(&seqs, &pasts, Vec::new()).unwrap();
        let shape = StepShape::of(&batch).unwrap();
        assert_eq!(shape.num_rows() - batch.num_rows(), 49, "4 sequences x 17 rows, 19 of them the batch's");
        let padding = Padding::new(shape, 40, &tables);
        let (qkv, layer) = projection(shape.num_rows(), 3);
        let heads = layer.op(true).unwrap();
        let scores = Scores { scale: 0.3, logit_softcap: None, window: None };
        let attend = |padding: Option<&Padding>, rows: usize| {
            let step = PagedStep::new(&batch, &pasts, &tables, 4, &Arc::default(), &Device::Cpu, padding).unwrap();
            step.write_and_attend(&pool, &qkv.narrow(0, 0, rows).unwrap(), &heads, scores).unwrap()
        };
        let eager = attend(None, batch.num_rows());
        let padded = attend(Some(&padding), shape.num_rows());
        let bits = |t: &Tensor| {
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert!(bits(&padded.narrow(0, 0, batch.num_rows()).unwrap()) == bits(&eager), "the batch's rows");
        // A padding row sees one key: its output is the dummy slot's value head.
        let value = pool.get(1).unwrap().get(40).unwrap().narrow(0, 0, HEAD_DIM).unwrap();
        let last = padded.get(shape.num_rows() - 1).unwrap().narrow(0, 0, HEAD_DIM).unwrap();
        assert!(max_abs_diff(&last, &value).unwrap() < 1e-6);
    }

    /// The paged ops refuse a projection of another dtype than the pool's, or of other head sizes,
    /// by name.
    #[test]
    fn a_projection_unlike_the_pool_is_refused_by_name() {
        let table: Vec<u32> = vec![0];
        let pool = Tensor::zeros((2, 4, KV_HEADS * HEAD_DIM), DType::BF16, &Device::Cpu).unwrap();
        let batch =
            ForwardBatch::new(&[SeqRows::chain(vec![0; 2], crate::model::LogitRows::All)], &[0], Vec::new()).unwrap();
        let step = PagedStep::new(&batch, &[0], &[&table], 4, &Arc::default(), &Device::Cpu, None).unwrap();
        let (qkv, layer) = projection(2, 5);
        let heads = layer.op(false).unwrap();
        let scores = Scores { scale: 1.0, logit_softcap: None, window: None };
        let e = step.write_and_attend(&pool, &qkv, &heads, scores).unwrap_err().to_string();
        assert!(e.contains("paged_attention") && e.contains("share a dtype"), "{e}");
        let narrow = qkv.narrow(1, 0, HEAD_DIM).unwrap().to_dtype(DType::BF16).unwrap();
        let e = step.write_and_attend(&pool, &narrow, &heads, scores).unwrap_err().to_string();
        assert!(e.contains("need [n, "), "{e}");
    }
}
