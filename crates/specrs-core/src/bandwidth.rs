//! The memory roof a decode step is held against: a device's read bandwidth, measured with a
//! read-only reduction over a buffer much larger than its caches, and the bound it gives a step
//! (`CausalLm::step_read_bytes` over this rate: the fastest a token can come).
//!
//! Invariant: only bytes read count. A decode step reads its weights and its KV cache and writes
//! almost nothing, so a copy's rate (which moves each byte twice, and on candle's CUDA backend runs
//! a strided kernel) is the wrong roof: it put the H200's bound at 8.1 ms where reads allow ~3.3.
//! The rate is the best of `repeats` passes: a pass can only be slowed by the machine, never sped
//! up past what the memory delivers.

use std::time::Instant;

use candle_core::Device;

use crate::error::{Error, Result};

/// Bytes read per second: the best of `repeats` timed passes of a read-only reduction over a
/// `num_bytes` buffer on `device` (the CPU's cores split the buffer; a CUDA device runs
/// `cuda/bandwidth.cu`, timed with events).
pub fn read_bandwidth(device: &Device, num_bytes: usize, repeats: usize) -> Result<f64> {
    if num_bytes < 1 << 20 || repeats == 0 {
        return Err(Error::config("read_bandwidth needs at least 1 MiB and one repeat"));
    }
    let seconds = match device {
        Device::Cpu => cpu_read_seconds(num_bytes, repeats),
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => cuda_read_seconds(cuda, num_bytes, repeats)?,
        other => return Err(Error::Device(format!("read_bandwidth runs on the CPU or CUDA, not {other:?}"))),
    };
    let best = seconds.into_iter().fold(f64::INFINITY, f64::min);
    Ok(num_bytes as f64 / best)
}

/// The seconds of each pass: the buffer split into one contiguous chunk per core, each summed as
/// u64 words (wrapping adds vectorize and need no float ordering); the sums are kept, so the reads
/// cannot be optimised away.
fn cpu_read_seconds(num_bytes: usize, repeats: usize) -> Vec<f64> {
    // Written through (not zeroed): a zeroed allocation maps one shared page, read from cache.
    let words: Vec<u64> = (0..num_bytes / 8).map(|i| i as u64).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = words.len().div_ceil(threads);
    let pass = || -> u64 {
        std::thread::scope(|scope| {
            let sums: Vec<_> = words
                .chunks(chunk)
                .map(|part| scope.spawn(move || part.iter().fold(0u64, |acc, &w| acc.wrapping_add(w))))
                .collect();
            sums.into_iter().map(|s| s.join().expect("a summing thread panicked")).fold(0, u64::wrapping_add)
        })
    };
    std::hint::black_box(pass()); // warm-up: pages touched, threads started once
    (0..repeats)
        .map(|_| {
            let t0 = Instant::now();
            std::hint::black_box(pass());
            t0.elapsed().as_secs_f64()
        })
        .collect()
}

#[cfg(feature = "cuda")]
fn cuda_read_seconds(
    device: &candle_core::cuda_backend::CudaDevice,
    num_bytes: usize,
    repeats: usize,
) -> Result<Vec<f64>> {
    use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
    use candle_core::cuda_backend::cudarc::driver::{DriverError, LaunchConfig, PushKernelArg};

    use crate::nvrtc::{device_error, function, BANDWIDTH, BLOCK};

    let func = function(device, &BANDWIDTH, "read_sum_kernel")?;
    let stream = device.cuda_stream();
    let context = stream.context().clone();
    let failed = |what: &'static str| move |e: DriverError| device_error(what, e);
    let n4 = (num_bytes / 16) as u64;
    // Ones copied from the host: every page is resident and written before the first timed pass.
    let data = stream.clone_htod(&vec![1.0f32; (n4 * 4) as usize]).map_err(failed("filling the buffer"))?;
    let sms = context
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(failed("reading the multiprocessor count"))?;
    // Eight resident blocks per multiprocessor keep enough loads in flight to saturate memory.
    let blocks = (sms as u32) * 8;
    let mut partial = stream.alloc_zeros::<f32>(blocks as usize).map_err(failed("allocating the sums"))?;
    let config = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
    let mut pass = || -> Result<()> {
        let mut launch = stream.launch_builder(&func);
        launch.arg(&data).arg(&n4).arg(&mut partial);
        // SAFETY: the arguments match read_sum_kernel's signature; it reads n4 float4s of `data`
        // and writes one float per block into `partial`, which has `blocks` of them.
        unsafe { launch.launch(config) }.map_err(failed("launching read_sum_kernel"))?;
        Ok(())
    };
    pass()?; // warm-up: the module loaded, the clocks up
    let mut seconds = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = stream.record_event(timing).map_err(failed("recording an event"))?;
        pass()?;
        let end = stream.record_event(timing).map_err(failed("recording an event"))?;
        seconds.push(start.elapsed_ms(&end).map_err(failed("reading the events"))? as f64 / 1e3);
    }
    Ok(seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_read_rate_is_a_rate_and_small_buffers_are_refused() {
        let rate = read_bandwidth(&Device::Cpu, 32 << 20, 2).unwrap();
        // Bytes over the best pass's seconds (no speed is asserted: CI machines are busy).
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
        assert!(read_bandwidth(&Device::Cpu, 1000, 2).is_err());
        assert!(read_bandwidth(&Device::Cpu, 32 << 20, 0).is_err());
    }

    /// On a machine with a GPU: the kernel compiles, launches and its events time it.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_device_read_rate_runs_on_a_gpu() {
        if !crate::nvrtc::gpu_present() {
            return;
        }
        let device = crate::nvrtc::open(0).unwrap();
        let rate = read_bandwidth(&device, 256 << 20, 3).unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
    }
}
