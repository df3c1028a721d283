//! The device a model runs on, from its string ("cpu", "cuda", "cuda:N"), and where specrs keeps
//! files it derives (quantized self-drafts, measured costs).
//!
//! Invariant: a device string names exactly one device or is refused with what to write instead;
//! a CPU-only build refuses CUDA rather than falling back.

use std::path::PathBuf;

use candle_core::Device;

use crate::error::{Error, Result};

/// Parses a device string: "cpu", "cuda" or "cuda:N".
pub fn parse_device(device: &str) -> Result<Device> {
    let ordinal = match device {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => "0",
        d => match d.strip_prefix("cuda:") {
            Some(n) => n,
            None => return Err(Error::config(format!("unknown device '{d}'; use 'cpu' or 'cuda[:N]'"))),
        },
    };
    let ordinal: usize = ordinal
        .parse()
        .map_err(|_| Error::config(format!("bad device '{device}'; use 'cuda' or 'cuda:N' (N >= 0)")))?;
    if !cfg!(feature = "cuda") {
        return Err(Error::Device(format!(
            "device '{device}' needs a CUDA build of specrs (`make wheel-cuda`), and this one is CPU-only; \
             use device='cpu'"
        )));
    }
    Device::new_cuda(ordinal).map_err(|e| {
        Error::Device(format!(
            "cannot open CUDA device {ordinal} ({e}); check nvidia-smi, the driver (CUDA 13 or newer) \
             and CUDA_VISIBLE_DEVICES, or use device='cpu'"
        ))
    })
}

/// Where specrs keeps files for later processes (`quantized_self` drafts, cost curves, models
/// assembled from part packages by `specrs models install`): `$SPECRS_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/specrs`, else `~/.cache/specrs`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SPECRS_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("HOME").map_or_else(|| PathBuf::from(".cache"), |home| PathBuf::from(home).join(".cache"))
    });
    base.join("specrs")
}
