//! Preallocated key/value cache with O(1) rollback.
//!
//! Invariant: positions `0..len()` of every layer hold the keys and values of the tokens the model
//! has consumed, in order; `truncate(n)` only moves the length, so rejecting draft tokens costs
//! nothing. Storage grows (rarely, by doubling) only when a request outgrows what was reserved.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// One layer's buffers, `[capacity, num_kv_heads * head_dim]` each (token-major, so appending
/// n tokens is one contiguous copy and a token's row never moves).
struct LayerKv {
    k: Tensor,
    v: Tensor,
}

pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
    capacity: usize,
    max_len: usize,
    num_kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
}

impl KvCache {
    /// `capacity` positions are allocated now; the cache may grow up to `max_len` (the model's
    /// context length).
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let capacity = capacity.clamp(1, max_len);
        let layers = (0..num_layers)
            .map(|_| {
                let shape = (capacity, num_kv_heads * head_dim);
                Ok(LayerKv { k: Tensor::zeros(shape, dtype, device)?, v: Tensor::zeros(shape, dtype, device)? })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers, len: 0, capacity, max_len, num_kv_heads, head_dim, dtype, device: device.clone() })
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
        2 * self.layers.len() * self.num_kv_heads * self.capacity * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Keep the first `len` positions; O(1).
    pub fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate({len}) beyond cache length {}", self.len);
        self.len = len;
    }

    pub fn reset(&mut self) {
        self.len = 0;
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
        if needed <= self.capacity {
            return Ok(());
        }
        let new_capacity = needed.max(2 * self.capacity).min(self.max_len);
        for layer in &mut self.layers {
            for buf in [&mut layer.k, &mut layer.v] {
                let shape = (new_capacity, self.num_kv_heads * self.head_dim);
                let grown = Tensor::zeros(shape, self.dtype, &self.device)?;
                if self.len > 0 {
                    grown.slice_set(&buf.narrow(0, 0, self.len)?, 0, 0)?;
                }
                *buf = grown;
            }
        }
        self.capacity = new_capacity;
        Ok(())
    }

    /// Writes this step's keys/values of `layer` after the held positions. `k`, `v`:
    /// `[num_new, num_kv_heads * head_dim]`. The length itself moves only in `commit`, once
    /// every layer has appended.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let num_new = k.dim(0)?;
        if self.len + num_new > self.capacity {
            return Err(Error::Internal(format!("kv cache overflow: call reserve({num_new}) before the forward")));
        }
        let buffers = &self.layers[layer];
        buffers.k.slice_set(&k.contiguous()?, 0, self.len)?;
        buffers.v.slice_set(&v.contiguous()?, 0, self.len)?;
        Ok(())
    }

    /// The whole buffers of `layer` (`[capacity, num_kv_heads * head_dim]`); rows past the
    /// held and appended positions are stale.
    pub fn buffers(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.layers[layer].k, &self.layers[layer].v)
    }

    /// Counts `num_new` appended positions as held.
    pub fn commit(&mut self, num_new: usize) {
        debug_assert!(self.len + num_new <= self.capacity);
        self.len += num_new;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(n: usize, value: f32) -> Tensor {
        Tensor::full(value, (n, 8), &Device::Cpu).unwrap()
    }

    fn first_column(cache: &KvCache, layer: usize) -> Vec<f32> {
        let k = cache.buffers(layer).0.narrow(0, 0, cache.len()).unwrap();
        k.to_vec2::<f32>().unwrap().iter().map(|row| row[0]).collect()
    }

    #[test]
    fn truncate_then_append_overwrites_the_rejected_positions() {
        let mut cache = KvCache::new(1, 2, 4, 2, 16, DType::F32, &Device::Cpu).unwrap();
        cache.reserve(3).unwrap();
        cache.append(0, &filled(3, 1.0), &filled(3, 1.0)).unwrap();
        cache.commit(3);
        cache.truncate(1);
        assert_eq!(cache.len(), 1);
        cache.reserve(2).unwrap();
        cache.append(0, &filled(2, 7.0), &filled(2, 7.0)).unwrap();
        cache.commit(2);
        assert_eq!(first_column(&cache, 0), vec![1.0, 7.0, 7.0]);
    }

    #[test]
    fn growth_keeps_contents_and_respects_the_context() {
        let mut cache = KvCache::new(2, 2, 4, 1, 8, DType::F32, &Device::Cpu).unwrap();
        for step in 0..8 {
            cache.reserve(1).unwrap();
            for layer in 0..2 {
                cache.append(layer, &filled(1, step as f32), &filled(1, step as f32)).unwrap();
            }
            cache.commit(1);
        }
        assert_eq!(cache.capacity(), 8);
        let err = cache.reserve(1).unwrap_err();
        assert!(matches!(err, Error::ContextLength(_)), "{err}");
        assert_eq!(first_column(&cache, 1), (0..8).map(|x| x as f32).collect::<Vec<_>>());
    }
}
