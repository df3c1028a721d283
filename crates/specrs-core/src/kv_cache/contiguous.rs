//! The contiguous layout: each sequence owns one buffer per layer, row i is position i, grown by
//! doubling when a request outgrows what was reserved. Two stores, one per place:
//!
//! - [`HostContiguous`] (the CPU decoder, `cpu/decoder.rs`): f16, token-major
//!   (`[capacity, num_kv_heads * head_dim]` per layer), like llama.cpp's default cache: half the
//!   memory of f32, and the same rounding as the reference implementation the golden tests
//!   compare against.
//! - [`DeviceContiguous`] (the candle-ops decoder, `candle/decoder.rs`): one tensor per layer for
//!   keys and one for values, head-major (`[num_kv_heads, capacity, head_dim]`), so attention
//!   reads a narrowed view of it with no copy, in the model's activation dtype: bf16/f16 for dense
//!   bf16/f16 weights (half of f32's bytes, and what transformers keeps), f32 for quantized GGUF
//!   weights, whose activations are f32. Attention widens what it reads to f32.
//!
//! Invariant: rows `0..len` of every layer hold the keys and values of the positions held, in
//! order; `truncate` only moves the length, and `keep` copies only the rows that move. A
//! sequence holds at most `min(2 * len, max_len)` positions (doubling growth) plus what was
//! reserved up front, and returns all of it on `release`. Growth moves the buffers, so their
//! addresses are not stable (the paged layout's are).

use std::any::Any;

use candle_core::{DType, Device, Tensor};
use half::f16;

use super::{check_keep, check_prefix_source, context_error, KvRows, KvStore, KvView, Slots};
use crate::error::{Error, Result};

/// Length and room of one contiguous sequence, shared by both places.
#[derive(Debug, Clone, Copy)]
struct Extent {
    len: usize,
    capacity: usize,
    max_len: usize,
}

impl Extent {
    fn new(capacity: usize, max_len: usize) -> Self {
        Self { len: 0, capacity: capacity.clamp(1, max_len.max(1)), max_len }
    }

    /// The capacity that holds `num_new` more positions (doubling), or `None` if this one does.
    fn grown_for(&self, num_new: usize) -> Result<Option<usize>> {
        let needed = self.len + num_new;
        if needed > self.max_len {
            return Err(context_error(needed, self.max_len));
        }
        Ok((needed > self.capacity).then(|| needed.max(2 * self.capacity).min(self.max_len)))
    }

    fn check_room(&self, num_new: usize) -> Result<()> {
        if self.len + num_new > self.capacity {
            return Err(Error::Internal(format!("kv cache overflow: call reserve({num_new}) before the forward")));
        }
        Ok(())
    }

    fn truncate(&mut self, len: usize) {
        assert!(len <= self.len, "truncate({len}) beyond cache length {}", self.len);
        self.len = len;
    }

    /// `(dst, src)` row moves of `keep(start, kept)`, in increasing order (dst <= src, so copying
    /// in order never overwrites a row still to move).
    fn keep_moves(&self, start: usize, kept: &[usize]) -> Result<Vec<(usize, usize)>> {
        check_keep(start, kept, self.len)?;
        Ok(kept.iter().enumerate().map(|(i, &offset)| (start + i, start + offset)).filter(|(d, s)| d != s).collect())
    }
}

struct HostLayer {
    k: Vec<f16>,
    v: Vec<f16>,
}

/// The host twin: f16 rows of `row_len` values, one pair of buffers per layer.
pub struct HostContiguous {
    layers: Vec<HostLayer>,
    extent: Extent,
    /// Values per token per layer: num_kv_heads * head_dim.
    row_len: usize,
}

impl HostContiguous {
    /// `capacity` positions are allocated now; the cache may grow up to `max_len`.
    pub fn new(num_layers: usize, row_len: usize, capacity: usize, max_len: usize) -> Self {
        let extent = Extent::new(capacity, max_len);
        let size = extent.capacity * row_len;
        let layers =
            (0..num_layers).map(|_| HostLayer { k: vec![f16::ZERO; size], v: vec![f16::ZERO; size] }).collect();
        Self { layers, extent, row_len }
    }
}

impl KvStore for HostContiguous {
    fn len(&self) -> usize {
        self.extent.len
    }

    fn capacity(&self) -> usize {
        self.extent.capacity
    }

    fn max_len(&self) -> usize {
        self.extent.max_len
    }

    fn num_layers(&self) -> usize {
        self.layers.len()
    }

    fn row_len(&self) -> usize {
        self.row_len
    }

    fn reserve(&mut self, num_new: usize) -> Result<()> {
        if let Some(capacity) = self.extent.grown_for(num_new)? {
            self.extent.capacity = capacity;
            for layer in &mut self.layers {
                layer.k.resize(capacity * self.row_len, f16::ZERO);
                layer.v.resize(capacity * self.row_len, f16::ZERO);
            }
        }
        Ok(())
    }

    fn append(&mut self, layer: usize, rows: KvRows<'_>) -> Result<()> {
        let KvRows::Host { k, v } = rows else {
            return Err(Error::Internal("device append on a host cache".into()));
        };
        let num_new = k.len() / self.row_len;
        if v.len() != k.len() {
            return Err(Error::Internal(format!("kv cache overflow: call reserve({num_new}) before the forward")));
        }
        self.extent.check_room(num_new)?;
        let start = self.extent.len * self.row_len;
        let layer = &mut self.layers[layer];
        for (dst, &src) in layer.k[start..start + k.len()].iter_mut().zip(k) {
            *dst = f16::from_f32(src);
        }
        for (dst, &src) in layer.v[start..start + v.len()].iter_mut().zip(v) {
            *dst = f16::from_f32(src);
        }
        Ok(())
    }

    fn commit(&mut self, num_new: usize) {
        debug_assert!(self.extent.len + num_new <= self.extent.capacity);
        self.extent.len += num_new;
    }

    fn truncate(&mut self, len: usize) {
        self.extent.truncate(len);
    }

    fn keep(&mut self, start: usize, kept: &[usize]) -> Result<()> {
        let moves = self.extent.keep_moves(start, kept)?;
        let row_len = self.row_len;
        for layer in &mut self.layers {
            for &(dst, src) in &moves {
                layer.k.copy_within(src * row_len..(src + 1) * row_len, dst * row_len);
                layer.v.copy_within(src * row_len..(src + 1) * row_len, dst * row_len);
            }
        }
        self.extent.len = start + kept.len();
        Ok(())
    }

    /// The whole buffers, `[capacity, row_len]`: rows past the held and appended positions are
    /// stale.
    fn view(&self, layer: usize, _num_positions: usize) -> Result<KvView<'_>> {
        let layer = &self.layers[layer];
        Ok(KvView::Host(Slots::Identity { k: &layer.k, v: &layer.v }))
    }

    fn share_prefix(&mut self, source: &dyn KvStore, len: usize) -> Result<()> {
        let from = source.as_any().downcast_ref::<Self>();
        check_prefix_source(self, source, from.is_some(), len)?;
        let from = from.expect("checked above");
        self.reserve(len)?;
        let values = len * self.row_len;
        for (layer, from) in self.layers.iter_mut().zip(&from.layers) {
            layer.k[..values].copy_from_slice(&from.k[..values]);
            layer.v[..values].copy_from_slice(&from.v[..values]);
        }
        self.extent.len = len;
        Ok(())
    }

    fn release(&mut self) {
        self.layers.iter_mut().for_each(|layer| *layer = HostLayer { k: Vec::new(), v: Vec::new() });
        self.extent.len = 0;
        self.extent.capacity = 0;
    }

    fn blocks_held(&self) -> usize {
        self.extent.capacity
    }

    fn num_bytes(&self) -> usize {
        2 * self.layers.len() * self.extent.capacity * self.row_len * std::mem::size_of::<f16>()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Keys and values of one layer on a device, each `[num_kv_heads, capacity, head_dim]` in the
/// cache's dtype.
struct DeviceLayer {
    k: Tensor,
    v: Tensor,
}

/// The device twin: head-major tensors in the model's activation dtype.
pub struct DeviceContiguous {
    layers: Vec<DeviceLayer>,
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    extent: Extent,
}

fn device_layers(
    num_layers: usize,
    num_kv_heads: usize,
    capacity: usize,
    head_dim: usize,
    dtype: DType,
    device: &Device,
) -> Result<Vec<DeviceLayer>> {
    let zeros = || Tensor::zeros((num_kv_heads, capacity, head_dim), dtype, device);
    (0..num_layers).map(|_| Ok(DeviceLayer { k: zeros()?, v: zeros()? })).collect()
}

impl DeviceContiguous {
    /// `capacity` positions are allocated now on `device`; the cache may grow up to `max_len`.
    pub fn new(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let extent = Extent::new(capacity, max_len);
        let layers = device_layers(num_layers, num_kv_heads, extent.capacity, head_dim, dtype, device)?;
        Ok(Self { layers, num_layers, num_kv_heads, head_dim, dtype, device: device.clone(), extent })
    }
}

impl KvStore for DeviceContiguous {
    fn len(&self) -> usize {
        self.extent.len
    }

    fn capacity(&self) -> usize {
        self.extent.capacity
    }

    fn max_len(&self) -> usize {
        self.extent.max_len
    }

    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn row_len(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn reserve(&mut self, num_new: usize) -> Result<()> {
        let Some(capacity) = self.extent.grown_for(num_new)? else {
            return Ok(());
        };
        let old_capacity = self.extent.capacity;
        self.extent.capacity = capacity;
        let mut grown =
            device_layers(self.num_layers, self.num_kv_heads, capacity, self.head_dim, self.dtype, &self.device)?;
        // A released cache has no layers left to copy.
        for (new, old) in grown.iter_mut().zip(self.layers.iter()).filter(|_| old_capacity > 0) {
            new.k.slice_set(&old.k, 1, 0)?;
            new.v.slice_set(&old.v, 1, 0)?;
        }
        self.layers = grown;
        Ok(())
    }

    /// Writes `k` and `v` (`[num_kv_heads, num_new, head_dim]`, rounded to the cache's dtype).
    fn append(&mut self, layer: usize, rows: KvRows<'_>) -> Result<()> {
        let KvRows::Device { k, v } = rows else {
            return Err(Error::Internal("host append on a device cache".into()));
        };
        self.extent.check_room(k.dim(1)?)?;
        let layer = &self.layers[layer];
        layer.k.slice_set(&k.to_dtype(self.dtype)?.contiguous()?, 1, self.extent.len)?;
        layer.v.slice_set(&v.to_dtype(self.dtype)?.contiguous()?, 1, self.extent.len)?;
        Ok(())
    }

    fn commit(&mut self, num_new: usize) {
        debug_assert!(self.extent.len + num_new <= self.extent.capacity);
        self.extent.len += num_new;
    }

    fn truncate(&mut self, len: usize) {
        self.extent.truncate(len);
    }

    fn keep(&mut self, start: usize, kept: &[usize]) -> Result<()> {
        let moves = self.extent.keep_moves(start, kept)?;
        if let Some(&(first_dst, _)) = moves.first() {
            // The moved rows are gathered first, then written over their new slots.
            let sources: Vec<u32> =
                (first_dst..start + kept.len()).map(|dst| (start + kept[dst - start]) as u32).collect();
            let sources = Tensor::new(sources.as_slice(), &self.device)?;
            for layer in &mut self.layers {
                let k = layer.k.index_select(&sources, 1)?;
                let v = layer.v.index_select(&sources, 1)?;
                layer.k.slice_set(&k, 1, first_dst)?;
                layer.v.slice_set(&v, 1, first_dst)?;
            }
        }
        self.extent.len = start + kept.len();
        Ok(())
    }

    /// Narrowed views `[num_kv_heads, num_positions, head_dim]`, no copy.
    fn view(&self, layer: usize, num_positions: usize) -> Result<KvView<'_>> {
        let layer = &self.layers[layer];
        Ok(KvView::Device { k: layer.k.narrow(1, 0, num_positions)?, v: layer.v.narrow(1, 0, num_positions)? })
    }

    fn share_prefix(&mut self, source: &dyn KvStore, len: usize) -> Result<()> {
        let from = source.as_any().downcast_ref::<Self>();
        check_prefix_source(self, source, from.is_some(), len)?;
        let from = from.expect("checked above");
        self.reserve(len)?;
        if len > 0 {
            for (layer, from) in self.layers.iter_mut().zip(&from.layers) {
                layer.k.slice_set(&from.k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                layer.v.slice_set(&from.v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
            }
        }
        self.extent.len = len;
        Ok(())
    }

    fn release(&mut self) {
        self.layers.clear();
        self.extent.len = 0;
        self.extent.capacity = 0;
    }

    fn blocks_held(&self) -> usize {
        self.extent.capacity
    }

    fn num_bytes(&self) -> usize {
        2 * self.num_layers * self.extent.capacity * self.row_len() * self.dtype.size_in_bytes()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
