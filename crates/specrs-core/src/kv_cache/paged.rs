//! The paged layout: rows in fixed-size blocks of `block_size` positions (a power of two), drawn
//! from a pool that one model's sequences share, allocated once so that no block ever moves;
//! each sequence maps its positions to blocks through a block table (position j is row
//! `j % block_size` of block `table[j / block_size]`, slot `table[j / block_size] * block_size +
//! j % block_size` of the pool). On the host the pool holds f16 rows (the CPU decoder reads them
//! through `Slots`); on a candle device it holds one `[2, slots, row_len]` tensor per layer in the
//! model's dtype, which the candle decoder writes and reads for a whole step at once
//! (`model/candle/paged_attention.rs`, through `KvCache::device_blocks`).
//!
//! - `reserve` takes blocks from the pool (all or none); out of blocks is a `ContextLength`
//!   error naming `max_kv_tokens`, never a panic. `truncate` and `release` return whole blocks.
//! - `keep` remaps: a destination block whose rows are exactly one source block's, in order, is
//!   swapped into place in the table (with `block_size` 1 every keep is a pure remap); rows that
//!   land in a partly kept block are copied.
//! - `share_prefix` (samples of one prompt) takes the source's full blocks by reference and
//!   copies only the partial last one.
//!
//! Invariant (what makes the pool's interior mutability sound): a block is written only by a
//! sequence that holds it alone (`&mut` that sequence, holder count 1); a block held by several
//! sequences is never written again — a write into one first copies it (copy on write). Views
//! are slices of the blocks their sequence holds, never of the whole pool, so one sequence
//! writing its own blocks never aliases another's reads. The allocator's lock is held only to
//! hand blocks out and take them back.

use std::any::Any;
use std::cell::UnsafeCell;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{DType, Device, Tensor};
use half::f16;

use super::{check_keep, check_prefix_source, context_error, slot_of, KvRows, KvStore, KvView, Slots};
use crate::error::{Error, Result};

/// Which blocks are free and how many sequences hold each.
struct Allocator {
    free: Vec<u32>,
    holders: Vec<u32>,
}

/// Where a pool's rows live.
enum Rows {
    /// Per layer, keys and values of every slot, `row_len` f16 values each.
    Host { k: Vec<Box<[UnsafeCell<f16>]>>, v: Vec<Box<[UnsafeCell<f16>]>> },
    /// Per layer `[2, slots, row_len]` (keys, then values) in the model's dtype on a candle device.
    Device { layers: Vec<Tensor> },
}

/// The blocks of one model's sequences: per layer, keys and values of `num_blocks * block_size`
/// positions (slots) of `row_len` values each.
pub struct PagedPool {
    block_size: usize,
    num_blocks: usize,
    num_layers: usize,
    row_len: usize,
    rows: Rows,
    allocator: Mutex<Allocator>,
}

// SAFETY: the cells are written only under the module invariant (a block is written by the one
// sequence holding it, through `&mut` that sequence), so no two threads touch one block's cells
// while either writes; the allocator is behind a mutex.
unsafe impl Sync for PagedPool {}

fn zeroed_cells(len: usize) -> Box<[UnsafeCell<f16>]> {
    let values = vec![f16::ZERO; len].into_boxed_slice();
    // SAFETY: `UnsafeCell<f16>` has the layout of `f16` (repr(transparent)).
    unsafe { Box::from_raw(Box::into_raw(values) as *mut [UnsafeCell<f16>]) }
}

impl PagedPool {
    /// A host pool of `num_blocks` blocks of `block_size` positions for a model of `num_layers`
    /// layers of `row_len` (num_kv_heads * head_dim) f16 values per position.
    pub fn new(num_layers: usize, row_len: usize, block_size: usize, num_blocks: usize) -> Result<Arc<Self>> {
        check_blocks(block_size, num_blocks)?;
        let size = num_blocks * block_size * row_len;
        let rows = Rows::Host {
            k: (0..num_layers).map(|_| zeroed_cells(size)).collect(),
            v: (0..num_layers).map(|_| zeroed_cells(size)).collect(),
        };
        Ok(Arc::new(Self::holding(rows, num_layers, row_len, block_size, num_blocks)))
    }

    /// A pool on `device` (any candle device, the CPU included) for the candle decoder, holding
    /// keys and values in `dtype`: one `[2, slots, row_len]` tensor per layer, allocated now, with
    /// one block past the `num_blocks` no sequence is given: the dummy block padding rows write
    /// into (`dummy_slot`).
    pub fn on_device(
        num_layers: usize,
        row_len: usize,
        block_size: usize,
        num_blocks: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Arc<Self>> {
        check_blocks(block_size, num_blocks)?;
        let slots = (num_blocks + 1) * block_size;
        if slots > u32::MAX as usize {
            return Err(Error::config(format!(
                "a paged KV pool of {slots} positions is past the 2^32 slots a step addresses"
            )));
        }
        let layers = (0..num_layers)
            .map(|_| Ok(Tensor::zeros((2, slots, row_len), dtype, device)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Self::holding(Rows::Device { layers }, num_layers, row_len, block_size, num_blocks)))
    }

    fn holding(rows: Rows, num_layers: usize, row_len: usize, block_size: usize, num_blocks: usize) -> Self {
        Self {
            block_size,
            num_blocks,
            num_layers,
            row_len,
            rows,
            // Popped from the back: blocks are handed out from 0 up.
            allocator: Mutex::new(Allocator {
                free: (0..num_blocks as u32).rev().collect(),
                holders: vec![0; num_blocks],
            }),
        }
    }

    /// `layer`'s `[2, slots, row_len]` keys and values on a device pool (None on the host): the
    /// candle decoder writes a step's rows into it and attends over it (`PagedStep`). Writes
    /// go only to slots of blocks their sequence holds alone (the module invariant).
    pub fn device_layer(&self, layer: usize) -> Option<&Tensor> {
        match &self.rows {
            Rows::Device { layers } => layers.get(layer),
            Rows::Host { .. } => None,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The first slot of a device pool's dummy block (past its `num_blocks`, held by no sequence):
    /// where a step padded to a fixed shape writes its padding rows (`model/candle/step_shape.rs`).
    /// None on the host.
    pub fn dummy_slot(&self) -> Option<u32> {
        match &self.rows {
            Rows::Device { .. } => Some((self.num_blocks * self.block_size) as u32),
            Rows::Host { .. } => None,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks no sequence holds.
    pub fn num_free(&self) -> usize {
        self.lock().free.len()
    }

    /// Bytes of one block (all layers, keys and values).
    pub fn block_bytes(&self) -> usize {
        let value_bytes = match &self.rows {
            Rows::Host { .. } => std::mem::size_of::<f16>(),
            Rows::Device { layers } => layers.first().map_or(0, |layer| layer.dtype().size_in_bytes()),
        };
        2 * self.num_layers * self.block_size * self.row_len * value_bytes
    }

    /// Blocks needed for `num_positions` positions.
    pub fn blocks_for(&self, num_positions: usize) -> usize {
        num_positions.div_ceil(self.block_size)
    }

    fn lock(&self) -> MutexGuard<'_, Allocator> {
        // A panic elsewhere while the lock was held left the lists consistent (every update is a
        // single push or pop per block).
        self.allocator.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `count` free blocks, each now held once; all or none.
    fn allocate(&self, count: usize) -> Result<Vec<u32>> {
        let mut allocator = self.lock();
        if count > allocator.free.len() {
            return Err(Error::ContextLength(format!(
                "the paged KV cache is out of blocks: {count} more blocks of {} tokens are needed and {} of {} \
                 are free; raise max_kv_tokens (now {} tokens) or run fewer or shorter requests at once",
                self.block_size,
                allocator.free.len(),
                self.num_blocks,
                self.num_blocks * self.block_size
            )));
        }
        let at = allocator.free.len() - count;
        let blocks = allocator.free.split_off(at);
        for &block in &blocks {
            allocator.holders[block as usize] = 1;
        }
        Ok(blocks)
    }

    /// One more holder for each of `blocks`.
    fn retain(&self, blocks: &[u32]) {
        let mut allocator = self.lock();
        for &block in blocks {
            allocator.holders[block as usize] += 1;
        }
    }

    /// One holder less for each of `blocks`; a block no one holds is free again.
    fn give_back(&self, blocks: &[u32]) {
        let mut allocator = self.lock();
        for &block in blocks {
            let holders = &mut allocator.holders[block as usize];
            debug_assert!(*holders > 0, "block {block} given back but not held");
            *holders -= 1;
            if *holders == 0 {
                allocator.free.push(block);
            }
        }
    }

    fn is_shared(&self, block: u32) -> bool {
        self.lock().holders[block as usize] > 1
    }

    /// Values per block per layer.
    fn block_len(&self) -> usize {
        self.block_size * self.row_len
    }

    /// Pointer to `block`'s first value of one layer's keys or values.
    fn block_ptr(cells: &[UnsafeCell<f16>], block: u32, block_len: usize) -> *mut f16 {
        debug_assert!((block as usize + 1) * block_len <= cells.len());
        // `as_ptr` covers the whole slice; UnsafeCell allows writes through it.
        unsafe { UnsafeCell::raw_get(cells.as_ptr()).add(block as usize * block_len) }
    }

    /// `block`'s keys and values of `layer` on a host pool.
    ///
    /// SAFETY: the caller holds `block`, and no one writes it while the slices live (the module
    /// invariant: a holder writes only through `&mut` itself, and only blocks it holds alone).
    unsafe fn block(&self, layer: usize, block: u32) -> Option<(&[f16], &[f16])> {
        let Rows::Host { k, v } = &self.rows else { return None };
        let len = self.block_len();
        unsafe {
            Some((
                std::slice::from_raw_parts(Self::block_ptr(&k[layer], block, len), len),
                std::slice::from_raw_parts(Self::block_ptr(&v[layer], block, len), len),
            ))
        }
    }

    /// Copies `num_rows` rows of every layer from row `src_row` of `src` to row `dst_row` of `dst`
    /// (ranges may overlap within one block).
    ///
    /// SAFETY: the caller holds `dst` alone and holds `src`; no one else writes either meanwhile.
    unsafe fn copy_rows(&self, src: u32, src_row: usize, dst: u32, dst_row: usize, num_rows: usize) -> Result<()> {
        let (len, row_len) = (self.block_len(), self.row_len);
        debug_assert!(src_row + num_rows <= self.block_size && dst_row + num_rows <= self.block_size);
        match &self.rows {
            Rows::Host { k, v } => {
                for cells in k.iter().chain(v) {
                    unsafe {
                        let from = Self::block_ptr(cells, src, len).add(src_row * row_len);
                        let to = Self::block_ptr(cells, dst, len).add(dst_row * row_len);
                        std::ptr::copy(from, to, num_rows * row_len);
                    }
                }
            }
            Rows::Device { layers } => {
                let slot = |block: u32, row: usize| block as usize * self.block_size + row;
                for layer in layers {
                    // A copy first: slice_set may not read the tensor it writes.
                    let rows = layer.narrow(1, slot(src, src_row), num_rows)?.contiguous()?;
                    layer.slice_set(&rows, 1, slot(dst, dst_row))?;
                }
            }
        }
        Ok(())
    }
}

fn check_blocks(block_size: usize, num_blocks: usize) -> Result<()> {
    if !block_size.is_power_of_two() || num_blocks == 0 || num_blocks > u32::MAX as usize {
        return Err(Error::Config(format!(
            "a paged KV cache needs a block_size that is a power of two (1, 2, 4, ... 16, 32, ...) and at \
             least 1 block (max_kv_tokens = blocks * block_size); got {num_blocks} blocks of {block_size}"
        )));
    }
    Ok(())
}

fn overflow(num_new: usize) -> Error {
    Error::Internal(format!("kv cache overflow: call reserve({num_new}) before the forward"))
}

/// One sequence's block table into a shared pool.
pub struct PagedKv {
    pool: Arc<PagedPool>,
    table: Vec<u32>,
    len: usize,
    max_len: usize,
}

impl PagedKv {
    /// An empty sequence of at most `max_len` positions (the model's context length).
    pub fn new(pool: Arc<PagedPool>, max_len: usize) -> Self {
        Self { pool, table: Vec::new(), len: 0, max_len }
    }

    pub fn pool(&self) -> &Arc<PagedPool> {
        &self.pool
    }

    /// The block table: position j is in block `table()[j / block_size]`.
    pub fn table(&self) -> &[u32] {
        &self.table
    }

    /// Makes table entry `index` a block this sequence holds alone, copying a shared one.
    fn make_writable(&mut self, index: usize) -> Result<()> {
        let block = self.table[index];
        if self.pool.is_shared(block) {
            let [copy] = self.pool.allocate(1)?[..] else { unreachable!("allocate(1) returns one block") };
            // SAFETY: `copy` is fresh (held by this sequence alone); `block` is held here and,
            // shared, is written by no one.
            if let Err(e) = unsafe { self.pool.copy_rows(block, 0, copy, 0, self.pool.block_size) } {
                self.pool.give_back(&[copy]);
                return Err(e);
            }
            self.pool.give_back(&[block]);
            self.table[index] = copy;
        }
        Ok(())
    }

    /// Returns the blocks past what `self.len` positions need.
    fn shrink_to_len(&mut self) {
        let needed = self.pool.blocks_for(self.len);
        if self.table.len() > needed {
            let spare = self.table.split_off(needed);
            self.pool.give_back(&spare);
        }
    }
}

impl KvStore for PagedKv {
    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.table.len() * self.pool.block_size
    }

    fn max_len(&self) -> usize {
        self.max_len
    }

    fn num_layers(&self) -> usize {
        self.pool.num_layers
    }

    fn row_len(&self) -> usize {
        self.pool.row_len
    }

    fn reserve(&mut self, num_new: usize) -> Result<()> {
        let needed = self.len + num_new;
        if needed > self.max_len {
            return Err(context_error(needed, self.max_len));
        }
        let wanted = self.pool.blocks_for(needed);
        if wanted > self.table.len() {
            let blocks = self.pool.allocate(wanted - self.table.len())?;
            self.table.extend(blocks);
        }
        // The rows to be written must lie in blocks held alone (fresh blocks are; a shared one
        // is there after a truncate into a shared prefix).
        for index in (self.len / self.pool.block_size..wanted).filter(|_| num_new > 0) {
            self.make_writable(index)?;
        }
        Ok(())
    }

    fn append(&mut self, layer: usize, rows: KvRows<'_>) -> Result<()> {
        match (rows, &self.pool.rows) {
            (KvRows::Host { k, v }, Rows::Host { k: pool_k, v: pool_v }) => {
                let (row_len, block_size) = (self.pool.row_len, self.pool.block_size);
                let num_new = k.len() / row_len;
                if self.len + num_new > self.capacity() || v.len() != k.len() || layer >= self.pool.num_layers {
                    return Err(overflow(num_new));
                }
                let mut row = 0;
                while row < num_new {
                    let position = self.len + row;
                    let (block, offset) = (self.table[position / block_size], position % block_size);
                    let run = (block_size - offset).min(num_new - row);
                    debug_assert!(!self.pool.is_shared(block), "append into shared block {block}");
                    let values = row * row_len..(row + run) * row_len;
                    let len = self.pool.block_len();
                    for (cells, src) in [(&pool_k[layer], &k[values.clone()]), (&pool_v[layer], &v[values])] {
                        // SAFETY: `reserve` made the blocks from `len` on this sequence's alone,
                        // and `&mut self` means none of its views is alive.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                PagedPool::block_ptr(cells, block, len).add(offset * row_len),
                                src.len(),
                            )
                        };
                        for (dst, &src) in dst.iter_mut().zip(src) {
                            *dst = f16::from_f32(src);
                        }
                    }
                    row += run;
                }
                Ok(())
            }
            (KvRows::Device { k, v }, Rows::Device { layers }) => {
                // k, v: [kv_heads, num_new, head_dim] -> [2 kv_heads, num_new, head_dim] f32.
                let num_new = k.dim(1)?;
                let Some(pool_layer) = layers.get(layer) else { return Err(overflow(num_new)) };
                if self.len + num_new > self.capacity() || v.dims() != k.dims() {
                    return Err(overflow(num_new));
                }
                let shift = self.pool.block_size.trailing_zeros();
                let slots: Vec<u32> = (self.len..self.len + num_new)
                    .map(|p| slot_of(&self.table, p, shift).map(|slot| slot as u32).ok_or_else(|| overflow(num_new)))
                    .collect::<Result<_>>()?;
                let rows = Tensor::cat(&[k, v], 0)?.to_dtype(DType::F32)?;
                let slots = Tensor::new(slots.as_slice(), k.device())?;
                crate::model::candle::paged_attention::write_rows(pool_layer, &rows, &slots)
            }
            _ => Err(Error::Internal("a host append on a device pool, or a device one on a host pool".into())),
        }
    }

    fn commit(&mut self, num_new: usize) {
        debug_assert!(self.len + num_new <= self.capacity());
        self.len += num_new;
    }

    fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate({len}) beyond cache length {}", self.len);
        self.len = len;
        self.shrink_to_len();
    }

    fn keep(&mut self, start: usize, kept: &[usize]) -> Result<()> {
        check_keep(start, kept, self.len)?;
        let block_size = self.pool.block_size;
        let new_len = start + kept.len();
        // Destinations in increasing order, one destination block at a time. Every source is at
        // or after its destination and sources increase, so neither a remap nor a copy touches
        // a row still to be read.
        let mut i = 0;
        while i < kept.len() {
            let dst = start + i;
            let (dst_block, dst_row) = (dst / block_size, dst % block_size);
            let run = (block_size - dst_row).min(kept.len() - i);
            let src = start + kept[i];
            let whole = dst_row == 0
                && run == block_size
                && src.is_multiple_of(block_size)
                && kept[i + run - 1] - kept[i] == block_size - 1;
            if whole {
                // Sources increase strictly, so `block_size` of them spanning `block_size`
                // positions are exactly block `src / block_size`, in order.
                self.table.swap(dst_block, src / block_size);
            } else if (0..run).any(|r| kept[i + r] != i + r) {
                self.make_writable(dst_block)?;
                for r in 0..run {
                    let (to, from) = (dst + r, start + kept[i + r]);
                    if to != from {
                        // SAFETY: the destination block was made this sequence's alone; the
                        // source block is held by it; `&mut self` means none of its views live.
                        unsafe {
                            self.pool.copy_rows(
                                self.table[from / block_size],
                                from % block_size,
                                self.table[dst_block],
                                dst_row + r,
                                1,
                            )
                        }?;
                    }
                }
            }
            i += run;
        }
        self.len = new_len;
        self.shrink_to_len();
        Ok(())
    }

    /// Every block held, `block_size` positions each; rows past the held and appended positions
    /// are stale. A device pool is read for a whole step through `KvCache::device_blocks`.
    fn view(&self, layer: usize, _num_positions: usize) -> Result<KvView<'_>> {
        if let Rows::Device { .. } = self.pool.rows {
            return Err(Error::Internal(
                "a device paged cache is read through its pool and block table (KvCache::device_blocks)".into(),
            ));
        }
        let (mut k, mut v) = (Vec::with_capacity(self.table.len()), Vec::with_capacity(self.table.len()));
        for &block in &self.table {
            // SAFETY: this sequence holds `block`; `&self` keeps it from writing, and a block it
            // shares is written by no one.
            let (bk, bv) = unsafe { self.pool.block(layer, block) }.expect("a host pool");
            k.push(bk);
            v.push(bv);
        }
        Ok(KvView::Host(Slots::Blocks { k, v, block_shift: self.pool.block_size.trailing_zeros() }))
    }

    fn share_prefix(&mut self, source: &dyn KvStore, len: usize) -> Result<()> {
        let from = source.as_any().downcast_ref::<Self>().filter(|from| Arc::ptr_eq(&from.pool, &self.pool));
        check_prefix_source(self, source, from.is_some(), len)?;
        let from = from.expect("checked above");
        if len > self.max_len {
            return Err(context_error(len, self.max_len));
        }
        self.release();
        let full = len / self.pool.block_size;
        self.pool.retain(&from.table[..full]);
        self.table.extend_from_slice(&from.table[..full]);
        let tail = len % self.pool.block_size;
        if tail > 0 {
            let [copy] = self.pool.allocate(1)?[..] else { unreachable!("allocate(1) returns one block") };
            // SAFETY: `copy` is fresh; the source block is held by `from`, which `&` keeps from
            // writing.
            unsafe { self.pool.copy_rows(from.table[full], 0, copy, 0, tail) }?;
            self.table.push(copy);
        }
        self.len = len;
        Ok(())
    }

    fn release(&mut self) {
        let table = std::mem::take(&mut self.table);
        self.pool.give_back(&table);
        self.len = 0;
    }

    fn blocks_held(&self) -> usize {
        self.table.len()
    }

    fn num_bytes(&self) -> usize {
        self.table.len() * self.pool.block_bytes()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for PagedKv {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvCache;

    const ROW_LEN: usize = 3;

    /// Keys and values of positions `0..len()` of every layer, read through the slots.
    fn held(cache: &KvCache, num_layers: usize) -> Vec<Vec<f16>> {
        (0..num_layers)
            .map(|layer| {
                let slots = cache.host_layer(layer).unwrap();
                (0..cache.len())
                    .flat_map(|p| {
                        let (k, v) =
                            (&slots.keys_from(p, ROW_LEN)[..ROW_LEN], &slots.values_from(p, ROW_LEN)[..ROW_LEN]);
                        k.iter().chain(v).copied().collect::<Vec<_>>()
                    })
                    .collect()
            })
            .collect()
    }

    /// Appends `num_new` rows whose values count up from `next` to both caches.
    fn feed(caches: &mut [&mut KvCache], num_layers: usize, num_new: usize, next: &mut f32) {
        let rows: Vec<f32> = (0..num_new * ROW_LEN).map(|i| *next + i as f32).collect();
        *next += rows.len() as f32;
        for cache in caches.iter_mut() {
            cache.reserve(num_new).unwrap();
            for layer in 0..num_layers {
                let v: Vec<f32> = rows.iter().map(|x| -x - layer as f32).collect();
                cache.append(layer, &rows, &v).unwrap();
            }
            cache.commit(num_new);
        }
    }

    /// Random appends, truncations and keeps (random increasing paths) hold the same rows as
    /// the contiguous layout, whatever the block size; every block comes back.
    #[test]
    fn paged_holds_what_contiguous_holds() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut below = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for block_size in [1, 2, 4, 16] {
            let pool = PagedPool::new(2, ROW_LEN, block_size, 200).unwrap();
            let mut paged = KvCache::paged(&pool, 120);
            let mut contiguous = KvCache::new(2, ROW_LEN, 1, 120);
            let mut next = 0.0;
            for step in 0..200 {
                let num_new = 1 + below(9);
                if contiguous.len() + num_new > 120 {
                    paged.truncate(0);
                    contiguous.truncate(0);
                }
                feed(&mut [&mut paged, &mut contiguous], 2, num_new, &mut next);
                match below(3) {
                    0 => {
                        let len = contiguous.len() - below(num_new + 1);
                        paged.truncate(len);
                        contiguous.truncate(len);
                    }
                    1 => {
                        let start = contiguous.len() - num_new;
                        let kept: Vec<usize> = (0..num_new).filter(|_| below(2) == 0).collect();
                        paged.keep(start, &kept).unwrap();
                        contiguous.keep(start, &kept).unwrap();
                    }
                    _ => {}
                }
                assert_eq!(held(&paged, 2), held(&contiguous, 2), "block size {block_size}, step {step}");
                assert_eq!(paged.blocks_held(), contiguous.len().div_ceil(block_size), "blocks past the length return");
            }
            assert!(paged.keep(0, &[3, 2]).is_err());
            drop(paged);
            assert_eq!(pool.num_free(), 200);
        }
    }

    /// Samples share the prompt's full blocks and copy its partial one; writes after a truncate
    /// into a shared block copy it first, so no sequence sees another's rows.
    #[test]
    fn shared_prefix_blocks_are_copied_on_write() {
        let pool = PagedPool::new(1, ROW_LEN, 4, 16).unwrap();
        let mut prompt = KvCache::paged(&pool, 64);
        let mut reference = KvCache::new(1, ROW_LEN, 1, 64);
        let mut next = 0.0;
        feed(&mut [&mut prompt, &mut reference], 1, 10, &mut next);
        let mut sample = KvCache::paged(&pool, 64);
        sample.copy_prefix_from(&prompt, 10).unwrap();
        assert_eq!(pool.num_free(), 16 - 3 - 1, "two full blocks shared, the partial third copied");
        assert_eq!(held(&sample, 1), held(&prompt, 1));
        // The sample rewrites positions 5.. inside a shared block: it gets its own copy.
        sample.truncate(5);
        let mut reference_sample = KvCache::new(1, ROW_LEN, 1, 64);
        reference_sample.copy_prefix_from(&reference, 5).unwrap();
        let mut sample_next = 1000.0;
        feed(&mut [&mut sample, &mut reference_sample], 1, 6, &mut sample_next);
        feed(&mut [&mut prompt, &mut reference], 1, 3, &mut next);
        assert_eq!(held(&sample, 1), held(&reference_sample, 1));
        assert_eq!(held(&prompt, 1), held(&reference, 1));
        let other = PagedPool::new(1, ROW_LEN, 4, 16).unwrap();
        assert!(KvCache::paged(&other, 64).copy_prefix_from(&prompt, 4).is_err(), "another pool");
        drop((prompt, sample));
        assert_eq!(pool.num_free(), 16);
    }

    /// Running out of blocks is a typed error naming max_kv_tokens, and takes nothing.
    #[test]
    fn out_of_blocks_is_a_context_error() {
        let pool = PagedPool::new(1, ROW_LEN, 4, 3).unwrap();
        let mut a = KvCache::paged(&pool, 64);
        a.reserve(9).unwrap();
        let mut b = KvCache::paged(&pool, 64);
        let err = b.reserve(5).unwrap_err();
        assert!(matches!(err, Error::ContextLength(_)) && err.to_string().contains("max_kv_tokens"), "{err}");
        assert_eq!((b.blocks_held(), pool.num_free()), (0, 0));
        a.release();
        b.reserve(5).unwrap();
        assert_eq!(pool.num_free(), 1);
        assert!(matches!(b.reserve(65), Err(Error::ContextLength(_))), "past the context");
        assert!(PagedPool::new(1, ROW_LEN, 0, 3).is_err() && PagedPool::new(1, ROW_LEN, 4, 0).is_err());
        assert!(PagedPool::new(1, ROW_LEN, 3, 3).is_err_and(|e| e.to_string().contains("power of two")));
    }
}
