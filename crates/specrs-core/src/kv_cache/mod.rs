//! The key/value cache: one [`KvStore`] per sequence, in one of two layouts, behind the
//! [`KvCache`] every model and proposer takes.
//!
//! - `contiguous.rs`: a buffer per layer per sequence, position i at row i, growing by doubling;
//!   on the host (f16, the CPU decoder) or on a candle device (the candle-ops decoder).
//! - `paged.rs`: fixed-size blocks from a pool preallocated once per model (f16 rows on the host,
//!   or a tensor per layer on a candle device), whose addresses never move; a block table per
//!   sequence; `keep` remaps whole blocks, `truncate` returns them, and samples of one prompt
//!   share its full blocks instead of copying them.
//!
//! Invariant (every layout): positions `0..len()` of every layer hold the keys and values of the
//! tokens the model has consumed, in order. A forward `reserve`s room, `append`s each layer's new
//! rows after `len()`, and `commit`s them once every layer has; `truncate(n)` costs nothing
//! beyond returning blocks, so rejecting draft tokens is free, and `keep` compacts a tree's
//! accepted path. Readers see a layer through [`KvView`]: on the host, f16 token-major rows
//! addressed through [`Slots`] (the identity, or a block table), which the CPU attention walks
//! run by run in the same order whatever the layout, so logits do not depend on it.

mod contiguous;
pub mod paged;

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use half::f16;

pub use contiguous::{DeviceContiguous, HostContiguous};
pub use paged::{PagedKv, PagedPool};

use crate::error::{Error, Result};

/// Live and peak bytes held by a group of caches (all target caches, or all draft caches), for
/// `Engine::memory`.
#[derive(Debug, Default)]
pub struct KvBytes {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl KvBytes {
    fn add(&self, num_bytes: usize) {
        let now = self.live.fetch_add(num_bytes, Ordering::Relaxed) + num_bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn sub(&self, num_bytes: usize) {
        self.live.fetch_sub(num_bytes, Ordering::Relaxed);
    }

    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
}

/// One step's new keys and values of one layer, as the model computed them.
#[derive(Clone, Copy)]
pub enum KvRows<'a> {
    /// `[num_new, row_len]` f32 each, rounded to f16 when stored.
    Host { k: &'a [f32], v: &'a [f32] },
    /// `[num_kv_heads, num_new, head_dim]` each, rounded to the cache's dtype when stored.
    Device { k: &'a Tensor, v: &'a Tensor },
}

/// Where one layer's f16 host rows (`row_len` values each, token-major) of a sequence's
/// positions are.
#[derive(Debug, Clone)]
pub enum Slots<'a> {
    /// Position j is row j of `k` and `v`.
    Identity { k: &'a [f16], v: &'a [f16] },
    /// Position j is row `j % block_size` of block `j / block_size`: the sequence's block table
    /// resolved to its blocks' rows (`block_size * row_len` values each). Slices of the blocks
    /// this sequence holds, not of the whole pool, so another sequence writing its own blocks
    /// meanwhile is never aliased. `block_size` is `1 << block_shift`, so resolving a slot is a
    /// shift and a mask (attention resolves one per key row and one per run of value rows).
    Blocks { k: Vec<&'a [f16]>, v: Vec<&'a [f16]>, block_shift: u32 },
}

/// Position `position`'s block and row in it, for blocks of `1 << block_shift` rows.
fn block_and_row(position: usize, block_shift: u32) -> (usize, usize) {
    (position >> block_shift, position & ((1 << block_shift) - 1))
}

/// Position `position`'s slot in a paged pool (its block's first slot plus its row) through a
/// sequence's block `table` of blocks of `1 << block_shift` positions; None past the table.
pub(crate) fn slot_of(table: &[u32], position: usize, block_shift: u32) -> Option<usize> {
    let (block, row) = block_and_row(position, block_shift);
    table.get(block).map(|&first| ((first as usize) << block_shift) | row)
}

impl<'a> Slots<'a> {
    /// Key and value values addressable (positions times `row_len`).
    pub fn num_values(&self) -> (usize, usize) {
        match self {
            Slots::Identity { k, v } => (k.len(), v.len()),
            Slots::Blocks { k, v, .. } => (k.iter().map(|b| b.len()).sum(), v.iter().map(|b| b.len()).sum()),
        }
    }

    /// Positions from `position` on that lie in one run of rows `row_len` apart (to the end of
    /// its block).
    pub fn run_len(&self, position: usize) -> usize {
        match self {
            Slots::Identity { .. } => usize::MAX,
            Slots::Blocks { block_shift, .. } => (1 << block_shift) - block_and_row(position, *block_shift).1,
        }
    }

    /// Keys from `position`'s row to the end of its run.
    pub fn keys_from(&self, position: usize, row_len: usize) -> &'a [f16] {
        match self {
            Slots::Identity { k, .. } => &k[position * row_len..],
            Slots::Blocks { k, block_shift, .. } => {
                let (block, row) = block_and_row(position, *block_shift);
                &k[block][row * row_len..]
            }
        }
    }

    /// Values from `position`'s row to the end of its run.
    pub fn values_from(&self, position: usize, row_len: usize) -> &'a [f16] {
        match self {
            Slots::Identity { v, .. } => &v[position * row_len..],
            Slots::Blocks { v, block_shift, .. } => {
                let (block, row) = block_and_row(position, *block_shift);
                &v[block][row * row_len..]
            }
        }
    }
}

/// One layer's keys and values as a reader sees them.
pub enum KvView<'a> {
    /// f16 token-major rows, addressed through the slots.
    Host(Slots<'a>),
    /// `[num_kv_heads, num_positions, head_dim]` each: a narrowed view, no copy.
    Device { k: Tensor, v: Tensor },
}

/// How an engine lays out its target model's host KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvLayout {
    /// A buffer per sequence (`contiguous.rs`).
    #[default]
    Contiguous,
    /// `num_blocks` blocks of `block_size` positions, shared by the engine's sequences
    /// (`paged.rs`); `num_blocks * block_size` is the engine's `max_kv_tokens`.
    Paged { block_size: usize, num_blocks: usize },
}

impl KvLayout {
    /// Positions per block when a paged layout is named without one (vLLM's default).
    pub const DEFAULT_BLOCK_SIZE: usize = 16;

    /// The name "auto" stands for on `device` ("cpu", "cuda[:N]"): "paged" on CUDA, where the
    /// step's one attention kernel and its captured graphs run over the pool; "contiguous" on the
    /// CPU, where a pool sized for a full context up front is memory a laptop should not give
    /// (each request's buffer grows as it needs). Other names are returned as they are.
    pub fn resolve_name<'a>(name: &'a str, device: &str) -> &'a str {
        match name {
            "auto" if device.starts_with("cuda") => "paged",
            "auto" => "contiguous",
            other => other,
        }
    }

    /// The layout a user names on `device`: "contiguous", or "paged" with blocks of `block_size`
    /// positions and a pool of `max_kv_tokens` positions rounded up to whole blocks (None:
    /// `context_length`, one full-length sequence, as llama.cpp's `n_ctx` sizes its cache), or
    /// "auto" (`resolve_name`).
    pub fn named(
        name: &str,
        device: &str,
        block_size: usize,
        max_kv_tokens: Option<usize>,
        context_length: usize,
    ) -> Result<Self> {
        match Self::resolve_name(name, device) {
            "contiguous" if max_kv_tokens.is_none() => Ok(KvLayout::Contiguous),
            "contiguous" => Err(Error::config(
                "max_kv_tokens sizes the pool of the paged KV layout; the contiguous layout grows per \
                 sequence (bound it with the scheduler's max_kv_tokens) or pass kv_layout='paged'",
            )),
            "paged" => {
                if !block_size.is_power_of_two() || max_kv_tokens == Some(0) {
                    return Err(Error::config(format!(
                        "the paged KV layout needs a kv_block_size that is a power of two (e.g. 16) and a \
                         max_kv_tokens of at least 1 (got {block_size} and {max_kv_tokens:?})"
                    )));
                }
                let num_blocks = max_kv_tokens.unwrap_or(context_length).div_ceil(block_size);
                Ok(KvLayout::Paged { block_size, num_blocks })
            }
            other => Err(Error::config(format!("unknown KV layout {other:?}: use 'auto', 'contiguous' or 'paged'"))),
        }
    }
}

/// One sequence's keys and values in one layout.
pub trait KvStore: Send + Sync {
    /// Positions held.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Positions the store holds room for without asking for more.
    fn capacity(&self) -> usize;
    /// The most positions it may ever hold (the model's context length).
    fn max_len(&self) -> usize;
    fn num_layers(&self) -> usize;
    /// Values per position per layer: num_kv_heads * head_dim.
    fn row_len(&self) -> usize;
    /// Makes room for `num_new` positions after `len()`: a `ContextLength` error past
    /// `max_len()` (or, paged, past the pool).
    fn reserve(&mut self, num_new: usize) -> Result<()>;
    /// Writes `layer`'s new rows after `len()`; the length moves only in `commit`.
    fn append(&mut self, layer: usize, rows: KvRows<'_>) -> Result<()>;
    /// Counts `num_new` appended positions as held.
    fn commit(&mut self, num_new: usize);
    /// Keeps the first `len` positions (at most `len()`).
    fn truncate(&mut self, len: usize);
    /// Keeps positions `..start` and, of those from `start` on, the ones at offsets `kept`
    /// (strictly increasing), moved down to `start..start + kept.len()`.
    fn keep(&mut self, start: usize, kept: &[usize]) -> Result<()>;
    /// `layer`'s first `num_positions` positions (held plus appended).
    fn view(&self, layer: usize, num_positions: usize) -> Result<KvView<'_>>;
    /// Makes this empty store hold the first `len` positions of `source` (same model, same
    /// kind): a copy, or shared blocks.
    fn share_prefix(&mut self, source: &dyn KvStore, len: usize) -> Result<()>;
    /// Returns everything held; the store is empty and can grow again.
    fn release(&mut self);
    /// Allocation units held: positions of room (contiguous) or blocks (paged).
    fn blocks_held(&self) -> usize;
    /// Bytes held (all layers, keys and values; a shared block counts in every holder).
    fn num_bytes(&self) -> usize;
    fn as_any(&self) -> &dyn Any;
}

pub(crate) fn context_error(needed: usize, max_len: usize) -> Error {
    Error::ContextLength(format!(
        "the sequence would reach {needed} tokens but the model's context is {max_len} tokens; \
         shorten the prompt or lower max_tokens"
    ))
}

/// `keep(start, kept)`'s arguments against a store of `len` positions.
pub(crate) fn check_keep(start: usize, kept: &[usize], len: usize) -> Result<()> {
    if start > len || kept.windows(2).any(|w| w[0] >= w[1]) || kept.last().is_some_and(|&last| start + last >= len) {
        return Err(Error::Internal(format!(
            "keep({start}, {kept:?}) on a cache of {len} positions: offsets must increase and stay inside it"
        )));
    }
    Ok(())
}

/// `share_prefix(source, len)`'s preconditions: `this` empty, `source` of the same model and
/// kind (`same_kind`), holding at least `len` positions.
pub(crate) fn check_prefix_source(this: &dyn KvStore, source: &dyn KvStore, same_kind: bool, len: usize) -> Result<()> {
    if !this.is_empty()
        || len > source.len()
        || !same_kind
        || (this.num_layers(), this.row_len()) != (source.num_layers(), source.row_len())
    {
        return Err(Error::Internal(format!(
            "copy_prefix_from({len}): needs an empty cache of the same model and kind and at most the {} \
             positions the source holds (this one holds {})",
            source.len(),
            this.len()
        )));
    }
    Ok(())
}

/// A sequence's cache: a [`KvStore`] and the byte counter it reports to.
pub struct KvCache {
    store: Box<dyn KvStore>,
    /// Values per token per layer: num_kv_heads * head_dim.
    row_len: usize,
    accounting: Option<Arc<KvBytes>>,
    /// Bytes last reported to `accounting`.
    counted: usize,
}

impl KvCache {
    /// A contiguous host cache: `capacity` positions are allocated now; the cache may grow up to
    /// `max_len` (the model's context length).
    pub fn new(num_layers: usize, row_len: usize, capacity: usize, max_len: usize) -> Self {
        Self::from_store(Box::new(HostContiguous::new(num_layers, row_len, capacity, max_len)))
    }

    /// A contiguous cache on `device` (any candle device, the CPU included) for the candle-ops
    /// model, holding keys and values in `dtype`.
    pub fn on_device(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let store = DeviceContiguous::new(num_layers, num_kv_heads, head_dim, capacity, max_len, dtype, device)?;
        Ok(Self::from_store(Box::new(store)))
    }

    /// A paged cache drawing blocks from `pool` (host or device), up to `max_len` positions.
    pub fn paged(pool: &Arc<PagedPool>, max_len: usize) -> Self {
        Self::from_store(Box::new(PagedKv::new(pool.clone(), max_len)))
    }

    pub fn from_store(store: Box<dyn KvStore>) -> Self {
        let row_len = store.row_len();
        Self { store, row_len, accounting: None, counted: 0 }
    }

    /// Counts this cache's bytes (now and as it grows, until it is dropped) in `counter`.
    pub fn tracked_by(mut self, counter: Arc<KvBytes>) -> Self {
        self.counted = self.store.num_bytes();
        counter.add(self.counted);
        self.accounting = Some(counter);
        self
    }

    /// Brings the counter to the bytes held now.
    fn recount(&mut self) {
        if let Some(counter) = &self.accounting {
            let now = self.store.num_bytes();
            if now > self.counted {
                counter.add(now - self.counted);
            } else {
                counter.sub(self.counted - now);
            }
            self.counted = now;
        }
    }

    /// Values per position per layer: num_kv_heads * head_dim.
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.store.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.store.capacity()
    }

    pub fn max_len(&self) -> usize {
        self.store.max_len()
    }

    /// Bytes held by the buffers (all layers, keys and values).
    pub fn num_bytes(&self) -> usize {
        self.store.num_bytes()
    }

    /// Allocation units held: positions of room (contiguous) or blocks (paged).
    pub fn blocks_held(&self) -> usize {
        self.store.blocks_held()
    }

    /// Keep the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.store.truncate(len);
        self.recount();
    }

    /// Keeps positions `..start` and, of the positions from `start` on, those at offsets `kept`
    /// (strictly increasing: a tree's accepted path in row order), moved down to
    /// `start..start + kept.len()`; the rest are dropped. Only rows that move are copied (paged:
    /// whole blocks that move are remapped), so keeping a prefix costs what `truncate` does.
    pub fn keep(&mut self, start: usize, kept: &[usize]) -> Result<()> {
        let kept = self.store.keep(start, kept);
        self.recount();
        kept
    }

    pub fn reset(&mut self) {
        self.truncate(0);
    }

    /// Makes this cache hold the first `len` positions of `source` (a copy, or shared full
    /// blocks): how samples of one prompt share its prefill. Both caches must be of the same
    /// model and kind, this one empty.
    pub fn copy_prefix_from(&mut self, source: &KvCache, len: usize) -> Result<()> {
        let shared = self.store.share_prefix(source.store.as_ref(), len);
        self.recount();
        shared
    }

    /// Frees the buffers (a finished request's cache); the cache is empty and can grow again.
    pub fn release(&mut self) {
        self.store.release();
        self.recount();
    }

    /// Make room for `num_new` more positions.
    pub fn reserve(&mut self, num_new: usize) -> Result<()> {
        let reserved = self.store.reserve(num_new);
        self.recount();
        reserved
    }

    /// Writes this step's keys/values of `layer` (`[num_new, row_len]` f32, rounded to f16) after
    /// the held positions. The length itself moves only in `commit`, once every layer has
    /// appended.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.store.append(layer, KvRows::Host { k, v })
    }

    /// Where `layer`'s host rows are (held plus appended positions).
    pub fn host_layer(&self, layer: usize) -> Result<Slots<'_>> {
        match self.store.view(layer, self.capacity())? {
            KvView::Host(slots) => Ok(slots),
            KvView::Device { .. } => Err(Error::Internal("host read of a device kv cache".into())),
        }
    }

    /// Keys and values of `layer` of a contiguous host cache, `[capacity, row_len]`; rows past
    /// the held and appended positions are stale.
    ///
    /// Panics on a device or paged cache: the host model reads `host_layer`, and
    /// `CausalLm::new_cache` builds the kind its model reads.
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        match self.host_layer(layer) {
            Ok(Slots::Identity { k, v }) => (k, v),
            Ok(Slots::Blocks { .. }) => panic!("contiguous read of a paged kv cache"),
            Err(_) => panic!("host read of a device kv cache"),
        }
    }

    /// Device twin of `append`: writes `k` and `v` (`[num_kv_heads, num_new, head_dim]`, rounded
    /// to the cache's dtype) of `layer` after the held positions.
    pub fn append_tensors(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.store.append(layer, KvRows::Device { k, v })
    }

    /// A sequence on a device paged pool: the pool and its block table, for a forward that
    /// writes and reads every sequence's rows at once (`model/candle/paged_attention.rs`); None
    /// for any other layout.
    pub fn device_blocks(&self) -> Option<(&Arc<PagedPool>, &[u32])> {
        let paged = self.store.as_any().downcast_ref::<PagedKv>()?;
        paged.pool().device_layer(0).map(|_| (paged.pool(), paged.table()))
    }

    /// Device twin of `layer`: views `[num_kv_heads, num_positions, head_dim]` of the first
    /// `num_positions` keys and values of `layer` (held plus appended), without copying.
    pub fn layer_tensors(&self, layer: usize, num_positions: usize) -> Result<(Tensor, Tensor)> {
        match self.store.view(layer, num_positions)? {
            KvView::Device { k, v } => Ok((k, v)),
            KvView::Host(_) => Err(Error::Internal("device read of a host kv cache".into())),
        }
    }

    /// Counts `num_new` appended positions as held.
    pub fn commit(&mut self, num_new: usize) {
        self.store.commit(num_new);
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        if let Some(counter) = &self.accounting {
            counter.sub(self.counted);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first_column(cache: &KvCache, layer: usize) -> Vec<f32> {
        let (k, _) = cache.layer(layer);
        (0..cache.len()).map(|row| k[row * cache.row_len].to_f32()).collect()
    }

    #[test]
    fn auto_is_paged_on_cuda_and_contiguous_on_the_cpu() {
        assert_eq!(KvLayout::named("auto", "cpu", 16, None, 100).unwrap(), KvLayout::Contiguous);
        let paged = KvLayout::Paged { block_size: 16, num_blocks: 7 };
        assert_eq!(KvLayout::named("auto", "cuda:1", 16, None, 100).unwrap(), paged);
        assert_eq!(KvLayout::named("paged", "cpu", 16, None, 100).unwrap(), paged);
        assert_eq!(KvLayout::named("contiguous", "cuda", 16, None, 100).unwrap(), KvLayout::Contiguous);
        // A pool size is the paged layout's: on the CPU "auto" refuses it as "contiguous" does.
        let error = KvLayout::named("auto", "cpu", 16, Some(64), 100).unwrap_err().to_string();
        assert!(error.contains("kv_layout='paged'"), "{error}");
        let error = KvLayout::named("pages", "cuda", 16, None, 100).unwrap_err().to_string();
        assert!(error.contains("'auto', 'contiguous' or 'paged'"), "{error}");
    }

    #[test]
    fn truncate_then_append_overwrites_the_rejected_positions() {
        let mut cache = KvCache::new(1, 4, 2, 16);
        cache.reserve(3).unwrap();
        cache.append(0, &[1.0; 12], &[1.0; 12]).unwrap();
        cache.commit(3);
        cache.truncate(1);
        assert_eq!(cache.len(), 1);
        cache.reserve(2).unwrap();
        cache.append(0, &[7.0; 8], &[7.0; 8]).unwrap();
        cache.commit(2);
        assert_eq!(first_column(&cache, 0), vec![1.0, 7.0, 7.0]);
    }

    /// A tree's path (rows 1 and 3 of 4 new ones) moves down behind the kept prefix; offsets out
    /// of order or past the cache are refused.
    #[test]
    fn copy_prefix_from_copies_the_held_rows_and_refuses_misuse() {
        let mut source = KvCache::new(2, 4, 8, 16);
        for layer in 0..2 {
            let k: Vec<f32> = (0..12).map(|i| (i + 100 * layer) as f32).collect();
            source.append(layer, &k, &k).unwrap();
        }
        source.commit(3);
        let mut copy = KvCache::new(2, 4, 1, 16);
        copy.copy_prefix_from(&source, 2).unwrap();
        assert_eq!(copy.len(), 2);
        for layer in 0..2 {
            assert_eq!(copy.layer(layer).0[..8], source.layer(layer).0[..8]);
            assert_eq!(copy.layer(layer).1[..8], source.layer(layer).1[..8]);
        }
        assert!(copy.copy_prefix_from(&source, 1).is_err(), "the copy is no longer empty");
        assert!(KvCache::new(2, 4, 1, 16).copy_prefix_from(&source, 4).is_err(), "past what the source holds");
        assert!(KvCache::new(1, 4, 1, 16).copy_prefix_from(&source, 1).is_err(), "another model's layout");
    }

    #[test]
    fn keep_compacts_the_kept_rows_and_refuses_bad_offsets() {
        let mut cache = KvCache::new(1, 4, 8, 16);
        cache.reserve(6).unwrap();
        let rows: Vec<f32> = (0..6).flat_map(|r| [r as f32; 4]).collect();
        cache.append(0, &rows, &rows).unwrap();
        cache.commit(6);
        cache.keep(2, &[1, 3]).unwrap();
        assert_eq!(first_column(&cache, 0), vec![0.0, 1.0, 3.0, 5.0]);
        for bad in [&[1, 1][..], &[2, 1], &[4]] {
            assert!(cache.keep(2, bad).is_err(), "{bad:?}");
        }
        cache.keep(4, &[]).unwrap();
        assert_eq!(cache.len(), 4);
    }

    #[test]
    fn growth_keeps_contents_and_respects_the_context() {
        let mut cache = KvCache::new(2, 4, 1, 8);
        for step in 0..8 {
            cache.reserve(1).unwrap();
            for layer in 0..2 {
                cache.append(layer, &[step as f32; 4], &[step as f32; 4]).unwrap();
            }
            cache.commit(1);
        }
        assert_eq!(cache.capacity(), 8);
        let err = cache.reserve(1).unwrap_err();
        assert!(matches!(err, Error::ContextLength(_)), "{err}");
        assert_eq!(first_column(&cache, 1), (0..8).map(|x| x as f32).collect::<Vec<_>>());
    }

    /// The device layout: growth keeps the held positions, truncation drops the rejected ones,
    /// and a released cache grows again from nothing.
    #[test]
    fn device_cache_grows_truncates_and_recovers_from_release() {
        let device = Device::Cpu;
        let mut cache = KvCache::on_device(2, 2, 3, 1, 16, DType::F32, &device).unwrap();
        let rows = |values: &[f32]| Tensor::new(values, &device).unwrap().reshape((2, values.len() / 6, 3)).unwrap();
        for (step, num_new) in [(1.0, 2), (2.0, 3)] {
            cache.reserve(num_new).unwrap();
            for layer in 0..2 {
                let kv = rows(&vec![step; 6 * num_new]);
                cache.append_tensors(layer, &kv, &kv).unwrap();
            }
            cache.commit(num_new);
        }
        cache.truncate(3);
        let (k, _) = cache.layer_tensors(1, cache.len()).unwrap();
        assert_eq!(k.dims(), [2, 3, 3]);
        assert_eq!(
            k.narrow(2, 0, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [1., 1., 2., 1., 1., 2.]
        );
        cache.release();
        cache.reserve(1).unwrap();
        cache.append_tensors(0, &rows(&[5.0; 6]), &rows(&[5.0; 6])).unwrap();
        assert!(cache.append_tensors(0, &rows(&[5.0; 12]), &rows(&[5.0; 12])).is_err(), "overflow");
        cache.commit(1);
        let mut copy = KvCache::on_device(2, 2, 3, 1, 16, DType::F32, &device).unwrap();
        copy.copy_prefix_from(&cache, 1).unwrap();
        let (k, _) = copy.layer_tensors(0, copy.len()).unwrap();
        assert_eq!(k.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [5.0; 6]);
        assert!(KvCache::new(2, 6, 1, 16).copy_prefix_from(&cache, 1).is_err(), "a host cache from a device one");
    }

    #[test]
    fn accounting_follows_growth_and_drop() {
        let counter = Arc::new(KvBytes::default());
        let mut cache = KvCache::new(2, 4, 2, 16).tracked_by(counter.clone());
        assert_eq!(counter.live(), cache.num_bytes());
        cache.reserve(5).unwrap();
        assert_eq!(counter.live(), cache.num_bytes());
        let grown = cache.num_bytes();
        cache.release();
        assert_eq!(counter.live(), 0);
        cache.reserve(1).unwrap();
        assert_eq!(counter.live(), cache.num_bytes());
        drop(cache);
        assert_eq!((counter.live(), counter.peak()), (0, grown));
    }
}
