//! Memory bandwidth of a device, measured with a device-to-device copy: the roof a decode step
//! is held against. Plain decoding reads every weight once per token, so weight bytes divided by
//! this bandwidth is the fastest a token can come (the "HBM bound" on a GPU).
//!
//! Invariant: bytes read and bytes written both count, as copy benchmarks report it (a copy of
//! N bytes moves 2N).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Median bytes per second over `repeats` copies of a `num_bytes` buffer on `device`.
pub fn copy_bandwidth(device: &Device, num_bytes: usize, repeats: usize) -> Result<f64> {
    if num_bytes < 1 << 20 || repeats == 0 {
        return Err(Error::config("copy_bandwidth needs at least 1 MiB and one repeat"));
    }
    // Ones, not zeros: a zeroed host allocation maps one shared page, which reads from cache.
    let source = Tensor::ones(num_bytes / 4, DType::F32, device)?;
    // Into a buffer allocated once, so no copy pays for allocation or first-touch page faults.
    let destination = Tensor::zeros(num_bytes / 4, DType::F32, device)?;
    destination.slice_set(&source, 0, 0)?;
    device.synchronize()?;
    let mut rates = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        destination.slice_set(&source, 0, 0)?;
        device.synchronize()?;
        rates.push(2.0 * num_bytes as f64 / t0.elapsed().as_secs_f64());
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[rates.len() / 2])
}
