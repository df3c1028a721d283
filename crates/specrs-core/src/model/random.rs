//! Seeded random weights, for models built without a file (the GPU check's Llama-3-8B-shaped
//! model, unit tests).
//!
//! Invariant: the values depend only on (seed, stream, index), never on the device, the thread
//! count or the dtype asked for, so a model built on the CPU and on CUDA from one seed holds the
//! same weights (up to the dtype's rounding).

use candle_core::{DType, Device, Shape, Tensor};
use rayon::prelude::*;

use crate::error::Result;

/// Values per parallel chunk; each chunk starts its own generator, so the split is fixed.
const CHUNK: usize = 1 << 16;

/// SplitMix64: a full-period 64-bit generator whose every output is a bijective hash of its
/// state, so chunk `c` of stream `s` can start anywhere without generating what comes before.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A tensor of `shape` on `device` in `dtype`, uniform with mean 0 and standard deviation `std`.
/// `stream` tells the tensors of one model apart.
pub fn uniform(
    shape: impl Into<Shape>,
    std: f32,
    seed: u64,
    stream: u64,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let shape = shape.into();
    let half_width = std * 3f32.sqrt();
    let mut values = vec![0f32; shape.elem_count()];
    values.par_chunks_mut(CHUNK).enumerate().for_each(|(chunk, out)| {
        let mut state =
            seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ (chunk as u64).wrapping_mul(0xA24B_AED4_963E_E407);
        for v in out {
            // The top 24 bits give a uniform f32 in [0, 1) exactly.
            let unit = (splitmix64(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
            *v = (2.0 * unit - 1.0) * half_width;
        }
    });
    // Cast on the device: moving f32 costs twice the bytes, but a CPU cast of 8B values is slow.
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?.to_device(device)?.to_dtype(dtype)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_streams_are_reproducible_distinct_and_scaled() {
        let a = uniform(100_000, 0.5, 7, 1, DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        let again = uniform(100_000, 0.5, 7, 1, DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        let other = uniform(100_000, 0.5, 7, 2, DType::F32, &Device::Cpu).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(a, again);
        assert_ne!(a[..10], other[..10]);
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let std = (a.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / a.len() as f32).sqrt();
        assert!(mean.abs() < 0.01 && (std - 0.5).abs() < 0.01, "mean {mean} std {std}");
    }
}
