//! Preallocated key/value cache with O(1) rollback.
//!
//! Keys and values are stored as f16, token-major (`[capacity, num_kv_heads * head_dim]` per
//! layer), like llama.cpp's default cache: half the memory of f32, and the same rounding as the
//! reference implementation the golden tests compare against.
//!
//! Invariant: rows `0..len()` of every layer hold the keys and values of the tokens the model has
//! consumed, in order; `truncate(n)` only moves the length, so rejecting draft tokens costs
//! nothing. Storage grows (rarely, by doubling) only when a request outgrows what was reserved.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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

pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
    capacity: usize,
    max_len: usize,
    /// Values per token per layer: num_kv_heads * head_dim.
    row_len: usize,
    accounting: Option<Arc<KvBytes>>,
}

impl KvCache {
    /// `capacity` positions are allocated now; the cache may grow up to `max_len` (the model's
    /// context length).
    pub fn new(num_layers: usize, row_len: usize, capacity: usize, max_len: usize) -> Self {
        let capacity = capacity.clamp(1, max_len.max(1));
        let layers = (0..num_layers)
            .map(|_| LayerKv { k: vec![f16::ZERO; capacity * row_len], v: vec![f16::ZERO; capacity * row_len] })
            .collect();
        Self { layers, len: 0, capacity, max_len, row_len, accounting: None }
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
        2 * self.layers.len() * self.capacity * self.row_len * std::mem::size_of::<f16>()
    }

    /// Keep the first `len` positions; O(1).
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate({len}) beyond cache length {}", self.len);
        self.len = len;
    }

    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Frees the buffers (a finished request's cache); the cache is empty and can grow again.
    pub fn release(&mut self) {
        if let Some(counter) = &self.accounting {
            counter.sub(self.num_bytes());
        }
        for layer in &mut self.layers {
            layer.k = Vec::new();
            layer.v = Vec::new();
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
            self.capacity = needed.max(2 * self.capacity).min(self.max_len);
            if let Some(counter) = &self.accounting {
                counter.add(self.num_bytes() - old_bytes);
            }
            for layer in &mut self.layers {
                layer.k.resize(self.capacity * self.row_len, f16::ZERO);
                layer.v.resize(self.capacity * self.row_len, f16::ZERO);
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
        let start = self.len * self.row_len;
        let layer = &mut self.layers[layer];
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
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        (&self.layers[layer].k, &self.layers[layer].v)
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
