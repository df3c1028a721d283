//! Preallocated key/value cache with O(1) rollback, on the host or on a candle device.
//!
//! - Host (the CPU decoder, `cpu/decoder.rs`): f16, token-major (`[capacity, num_kv_heads * head_dim]`
//!   per layer), like llama.cpp's default cache: half the memory of f32, and the same rounding as
//!   the reference implementation the golden tests compare against.
//! - Device (the candle-ops decoder, `candle/decoder.rs`): one tensor per layer for keys and one
//!   for values, head-major (`[num_kv_heads, capacity, head_dim]`), so attention reads a narrowed
//!   view of it with no copy, in the model's activation dtype: bf16/f16 for dense bf16/f16 weights
//!   (half of f32's bytes, and what transformers keeps), f32 for quantized GGUF weights, whose
//!   activations are f32. Attention widens what it reads to f32.
//!
//! Invariant: rows `0..len()` of every layer hold the keys and values of the tokens the model has
//! consumed, in order (row i is position i); `truncate(n)` only moves the length, so rejecting
//! draft tokens costs nothing, and `keep` compacts a tree's accepted path, copying only the rows
//! that move. Storage grows (rarely, by doubling) only when a request outgrows what was reserved.
//!
//! One cache per sequence, each a contiguous slot: a batched forward (`CausalLm::forward_batch`)
//! takes several and addresses each directly. Memory bound: a sequence holds at most
//! `min(2 * len, max_len)` positions (doubling growth), plus what was reserved up front, and
//! returns all of it on `release`; there is no fragmentation inside a slot, and between slots it
//! is the allocator's. Paged blocks would share prefixes and cap waste at one block per sequence;
//! they wait for continuous batching, where many sequences of unknown length share one pool.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use half::f16;

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

struct LayerKv {
    k: Vec<f16>,
    v: Vec<f16>,
}

/// Keys and values of one layer on a device, each `[num_kv_heads, capacity, head_dim]` in the
/// cache's dtype.
struct DeviceLayerKv {
    k: Tensor,
    v: Tensor,
}

enum Storage {
    Host(Vec<LayerKv>),
    Device { layers: Vec<DeviceLayerKv>, num_kv_heads: usize, head_dim: usize, dtype: DType, device: Device },
}

pub struct KvCache {
    storage: Storage,
    num_layers: usize,
    len: usize,
    capacity: usize,
    max_len: usize,
    /// Values per token per layer: num_kv_heads * head_dim.
    row_len: usize,
    accounting: Option<Arc<KvBytes>>,
}

fn device_layers(
    num_layers: usize,
    num_kv_heads: usize,
    capacity: usize,
    head_dim: usize,
    dtype: DType,
    device: &Device,
) -> Result<Vec<DeviceLayerKv>> {
    let zeros = || Tensor::zeros((num_kv_heads, capacity, head_dim), dtype, device);
    (0..num_layers).map(|_| Ok(DeviceLayerKv { k: zeros()?, v: zeros()? })).collect()
}

impl KvCache {
    /// `capacity` positions are allocated now; the cache may grow up to `max_len` (the model's
    /// context length).
    pub fn new(num_layers: usize, row_len: usize, capacity: usize, max_len: usize) -> Self {
        let capacity = capacity.clamp(1, max_len.max(1));
        let layers = (0..num_layers)
            .map(|_| LayerKv { k: vec![f16::ZERO; capacity * row_len], v: vec![f16::ZERO; capacity * row_len] })
            .collect();
        Self { storage: Storage::Host(layers), num_layers, len: 0, capacity, max_len, row_len, accounting: None }
    }

    /// A cache on `device` (any candle device, the CPU included) for the candle-ops model, holding
    /// keys and values in `dtype`.
    pub fn on_device(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let capacity = capacity.clamp(1, max_len.max(1));
        let layers = device_layers(num_layers, num_kv_heads, capacity, head_dim, dtype, device)?;
        Ok(Self {
            storage: Storage::Device { layers, num_kv_heads, head_dim, dtype, device: device.clone() },
            num_layers,
            len: 0,
            capacity,
            max_len,
            row_len: num_kv_heads * head_dim,
            accounting: None,
        })
    }

    /// Counts this cache's bytes (now and as it grows, until it is dropped) in `counter`.
    pub fn tracked_by(mut self, counter: Arc<KvBytes>) -> Self {
        counter.add(self.num_bytes());
        self.accounting = Some(counter);
        self
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Bytes held by the buffers (all layers, keys and values).
    pub fn num_bytes(&self) -> usize {
        let elem_size = match self.storage {
            Storage::Host(_) => std::mem::size_of::<f16>(),
            Storage::Device { dtype, .. } => dtype.size_in_bytes(),
        };
        2 * self.num_layers * self.capacity * self.row_len * elem_size
    }

    /// Keep the first `len` positions; O(1).
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate({len}) beyond cache length {}", self.len);
        self.len = len;
    }

    /// Keeps positions `..start` and, of the positions from `start` on, those at offsets `kept`
    /// (strictly increasing: a tree's accepted path in row order), moved down to
    /// `start..start + kept.len()`; the rest are dropped. Only rows that move are copied, so
    /// keeping a prefix costs what `truncate` does.
    pub fn keep(&mut self, start: usize, kept: &[usize]) -> Result<()> {
        if start > self.len
            || kept.windows(2).any(|w| w[0] >= w[1])
            || kept.last().is_some_and(|&last| start + last >= self.len)
        {
            return Err(Error::Internal(format!(
                "keep({start}, {kept:?}) on a cache of {} positions: offsets must increase and stay inside it",
                self.len
            )));
        }
        // dst <= src for every kept row, so copying in order never overwrites a row still to move.
        let moves: Vec<(usize, usize)> = kept
            .iter()
            .enumerate()
            .map(|(i, &offset)| (start + i, start + offset))
            .filter(|(dst, src)| dst != src)
            .collect();
        let row_len = self.row_len;
        match &mut self.storage {
            Storage::Host(layers) => {
                for layer in layers.iter_mut() {
                    for &(dst, src) in &moves {
                        layer.k.copy_within(src * row_len..(src + 1) * row_len, dst * row_len);
                        layer.v.copy_within(src * row_len..(src + 1) * row_len, dst * row_len);
                    }
                }
            }
            Storage::Device { layers, device, .. } if !moves.is_empty() => {
                // The moved rows are gathered first, then written over their new slots.
                let first_dst = moves[0].0;
                let sources: Vec<u32> =
                    (first_dst..start + kept.len()).map(|dst| (start + kept[dst - start]) as u32).collect();
                let sources = Tensor::new(sources.as_slice(), device)?;
                for layer in layers.iter_mut() {
                    let k = layer.k.index_select(&sources, 1)?;
                    let v = layer.v.index_select(&sources, 1)?;
                    layer.k.slice_set(&k, 1, first_dst)?;
                    layer.v.slice_set(&v, 1, first_dst)?;
                }
            }
            Storage::Device { .. } => {}
        }
        self.len = start + kept.len();
        Ok(())
    }

    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Makes this cache hold the first `len` positions of `source` (a copy): how samples of one
    /// prompt share its prefill. Both caches must be of the same model and kind, this one empty.
    pub fn copy_prefix_from(&mut self, source: &KvCache, len: usize) -> Result<()> {
        let same_kind = matches!(
            (&self.storage, &source.storage),
            (Storage::Host(_), Storage::Host(_)) | (Storage::Device { .. }, Storage::Device { .. })
        );
        if self.len != 0
            || len > source.len
            || !same_kind
            || (self.num_layers, self.row_len) != (source.num_layers, source.row_len)
        {
            return Err(Error::Internal(format!(
                "copy_prefix_from({len}): needs an empty cache of the same model and kind and at most the {} \
                 positions the source holds (this one holds {})",
                source.len, self.len
            )));
        }
        self.reserve(len)?;
        let values = len * self.row_len;
        match (&mut self.storage, &source.storage) {
            (Storage::Host(layers), Storage::Host(from)) => {
                for (layer, from) in layers.iter_mut().zip(from) {
                    layer.k[..values].copy_from_slice(&from.k[..values]);
                    layer.v[..values].copy_from_slice(&from.v[..values]);
                }
            }
            (Storage::Device { layers, .. }, Storage::Device { layers: from, .. }) if len > 0 => {
                for (layer, from) in layers.iter_mut().zip(from) {
                    layer.k.slice_set(&from.k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                    layer.v.slice_set(&from.v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                }
            }
            _ => {}
        }
        self.len = len;
        Ok(())
    }

    /// Frees the buffers (a finished request's cache); the cache is empty and can grow again.
    pub fn release(&mut self) {
        if let Some(counter) = &self.accounting {
            counter.sub(self.num_bytes());
        }
        match &mut self.storage {
            Storage::Host(layers) => {
                layers.iter_mut().for_each(|layer| *layer = LayerKv { k: Vec::new(), v: Vec::new() })
            }
            Storage::Device { layers, .. } => layers.clear(),
        }
        self.len = 0;
        self.capacity = 0;
    }

    /// Make room for `num_new` more positions, reallocating (amortized) if needed.
    pub fn reserve(&mut self, num_new: usize) -> Result<()> {
        let needed = self.len + num_new;
        if needed > self.max_len {
            return Err(Error::ContextLength(format!(
                "the sequence would reach {needed} tokens but the model's context is {} tokens; \
                 shorten the prompt or lower max_tokens",
                self.max_len
            )));
        }
        if needed > self.capacity {
            let old_bytes = self.num_bytes();
            let old_capacity = self.capacity;
            self.capacity = needed.max(2 * self.capacity).min(self.max_len);
            if let Some(counter) = &self.accounting {
                counter.add(self.num_bytes() - old_bytes);
            }
            match &mut self.storage {
                Storage::Host(layers) => {
                    for layer in layers {
                        layer.k.resize(self.capacity * self.row_len, f16::ZERO);
                        layer.v.resize(self.capacity * self.row_len, f16::ZERO);
                    }
                }
                Storage::Device { layers, num_kv_heads, head_dim, dtype, device } => {
                    let mut grown =
                        device_layers(self.num_layers, *num_kv_heads, self.capacity, *head_dim, *dtype, device)?;
                    // A released cache has no layers left to copy.
                    for (new, old) in grown.iter_mut().zip(layers.iter()).filter(|_| old_capacity > 0) {
                        new.k.slice_set(&old.k, 1, 0)?;
                        new.v.slice_set(&old.v, 1, 0)?;
                    }
                    *layers = grown;
                }
            }
        }
        Ok(())
    }

    /// Writes this step's keys/values of `layer` (`[num_new, row_len]` f32, rounded to f16) after
    /// the held positions. The length itself moves only in `commit`, once every layer has
    /// appended.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let num_new = k.len() / self.row_len;
        if self.len + num_new > self.capacity || v.len() != k.len() {
            return Err(Error::Internal(format!("kv cache overflow: call reserve({num_new}) before the forward")));
        }
        let Storage::Host(layers) = &mut self.storage else {
            return Err(Error::Internal("host append on a device cache".into()));
        };
        let start = self.len * self.row_len;
        let layer = &mut layers[layer];
        for (dst, &src) in layer.k[start..start + k.len()].iter_mut().zip(k) {
            *dst = f16::from_f32(src);
        }
        for (dst, &src) in layer.v[start..start + v.len()].iter_mut().zip(v) {
            *dst = f16::from_f32(src);
        }
        Ok(())
    }

    /// Keys and values of `layer`, `[capacity, row_len]`; rows past the held and appended
    /// positions are stale.
    ///
    /// Panics on a device cache: the host model never gets one (`CausalLm::new_cache` builds
    /// the kind its model reads).
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        match &self.storage {
            Storage::Host(layers) => (&layers[layer].k, &layers[layer].v),
            Storage::Device { .. } => panic!("host read of a device kv cache"),
        }
    }

    /// Device twin of `append`: writes `k` and `v` (`[num_kv_heads, num_new, head_dim]`, rounded
    /// to the cache's dtype) of `layer` after the held positions.
    pub fn append_tensors(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let Storage::Device { layers, dtype, .. } = &mut self.storage else {
            return Err(Error::Internal("device append on a host cache".into()));
        };
        let dtype = *dtype;
        let num_new = k.dim(1)?;
        if self.len + num_new > self.capacity {
            return Err(Error::Internal(format!("kv cache overflow: call reserve({num_new}) before the forward")));
        }
        let layer = &layers[layer];
        layer.k.slice_set(&k.to_dtype(dtype)?.contiguous()?, 1, self.len)?;
        layer.v.slice_set(&v.to_dtype(dtype)?.contiguous()?, 1, self.len)?;
        Ok(())
    }

    /// Device twin of `layer`: views `[num_kv_heads, num_positions, head_dim]` of the first
    /// `num_positions` keys and values of `layer` (held plus appended), without copying.
    pub fn layer_tensors(&self, layer: usize, num_positions: usize) -> Result<(Tensor, Tensor)> {
        let Storage::Device { layers, .. } = &self.storage else {
            return Err(Error::Internal("device read of a host kv cache".into()));
        };
        let layer = &layers[layer];
        Ok((layer.k.narrow(1, 0, num_positions)?, layer.v.narrow(1, 0, num_positions)?))
    }

    /// Counts `num_new` appended positions as held.
    pub fn commit(&mut self, num_new: usize) {
        debug_assert!(self.len + num_new <= self.capacity);
        self.len += num_new;
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        if let Some(counter) = &self.accounting {
            counter.sub(self.num_bytes());
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
