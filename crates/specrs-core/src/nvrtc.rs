//! Our CUDA kernels (`cuda/*.cu`, `--features cuda`): every source, compiled with NVRTC for the
//! device's architecture on first use (once per process), and the helpers the kernels' hosts share
//! (`batch/cuda.rs`, `model/candle/fused.rs`, `bandwidth.rs`).
//!
//! A source's text may begin with `cuda/block.cuh` (BLOCK and block-wide reductions),
//! `cuda/dtype.cuh` (load/store per dtype) and `cuda/heads.cuh` (one head normed and rotated),
//! prepended here: NVRTC compiles one string with no includes.
//!
//! Invariant: `SOURCES` lists every kernel source with its entry points, so the CPU suite compiles
//! all of them for every architecture we ship for (`compile_for`) without a GPU.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;

use crate::error::{Error, Result};

/// Threads per block: every kernel's `BLOCK`.
pub const BLOCK: u32 = 256;

/// One kernel source: its file name (also its module's name on the device) and entry points.
pub struct Source {
    pub file: &'static str,
    pub text: &'static str,
    pub entries: &'static [&'static str],
}

pub const ACCEPT: Source = Source {
    file: "accept.cu",
    text: concat!(include_str!("../../../cuda/block.cuh"), include_str!("../../../cuda/accept.cu")),
    entries: &["accept_kernel", "tree_accept_kernel"],
};
pub const NGRAM: Source =
    Source { file: "ngram.cu", text: include_str!("../../../cuda/ngram.cu"), entries: &["ngram_kernel"] };
pub const FUSED: Source = Source {
    file: "fused.cu",
    text: concat!(
        include_str!("../../../cuda/block.cuh"),
        include_str!("../../../cuda/dtype.cuh"),
        include_str!("../../../cuda/heads.cuh"),
        include_str!("../../../cuda/fused.cu")
    ),
    entries: &[
        "add_rms_norm_f32",
        "add_rms_norm_bf16",
        "add_rms_norm_f16",
        "act_mul_f32",
        "act_mul_bf16",
        "act_mul_f16",
        "qkv_heads_f32",
        "qkv_heads_bf16",
        "qkv_heads_f16",
    ],
};
pub const PAGED_ATTENTION: Source = Source {
    file: "paged_attention.cu",
    text: concat!(
        include_str!("../../../cuda/block.cuh"),
        include_str!("../../../cuda/dtype.cuh"),
        include_str!("../../../cuda/heads.cuh"),
        include_str!("../../../cuda/paged_attention.cu")
    ),
    entries: &[
        "write_kv_f32",
        "write_kv_bf16",
        "write_kv_f16",
        "paged_attention_f32",
        "paged_attention_bf16",
        "paged_attention_f16",
    ],
};
pub const SUFFIX: Source = Source {
    file: "suffix.cu",
    text: include_str!("../../../cuda/suffix.cu"),
    entries: &["suffix_write_kernel", "suffix_kernel"],
};
pub const BANDWIDTH: Source =
    Source { file: "bandwidth.cu", text: include_str!("../../../cuda/bandwidth.cu"), entries: &["read_sum_kernel"] };

pub const SOURCES: [&Source; 6] = [&ACCEPT, &NGRAM, &SUFFIX, &FUSED, &PAGED_ATTENTION, &BANDWIDTH];
/// The architectures CI compiles every source for: Ampere (A100) and Hopper (H100, H200).
pub const ARCHITECTURES: [&str; 2] = ["compute_80", "compute_90"];

/// The suffix of a kernel's instance for an element dtype (`add_rms_norm_bf16`, ...).
pub fn dtype_suffix(dtype: candle_core::DType) -> candle_core::Result<&'static str> {
    match dtype {
        candle_core::DType::F32 => Ok("f32"),
        candle_core::DType::BF16 => Ok("bf16"),
        candle_core::DType::F16 => Ok("f16"),
        other => Err(candle_core::Error::Msg(format!("our kernels take f32, bf16 or f16, not {other:?}"))),
    }
}

/// `$body` with `$t` the element type of `$dtype` (f32, `half::bf16` or `half::f16`); any other
/// dtype is `dtype_suffix`'s error.
macro_rules! by_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => Err($crate::nvrtc::dtype_suffix(other).unwrap_err()),
        }
    };
}
pub(crate) use by_dtype;

pub fn device_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Device(format!("{what}: {e}"))
}

pub fn open(ordinal: usize) -> Result<Device> {
    Device::new_cuda(ordinal).map_err(|e| device_error(&format!("opening CUDA device {ordinal}"), e))
}

pub fn cuda_device(device: &Device) -> Result<&CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        other => Err(Error::Device(format!("the CUDA kernels need a CUDA device, got {other:?}"))),
    }
}

/// `entry` of `source`, loaded on `device`: the source compiled for the device's architecture once
/// per process (every GPU of one machine is assumed to share an architecture). Launch it on the
/// device's stream (`device.cuda_stream().launch_builder(&f)`), so it orders after candle's work.
pub fn function(device: &CudaDevice, source: &Source, entry: &str) -> Result<CudaFunction> {
    static PTX: [OnceLock<String>; SOURCES.len()] = [const { OnceLock::new() }; SOURCES.len()];
    let index = SOURCES.iter().position(|s| s.file == source.file).expect("every source is in SOURCES");
    let ptx = match PTX[index].get() {
        Some(ptx) => ptx,
        None => {
            let context = device.cuda_stream().context().clone();
            let attribute = |a| context.attribute(a).map_err(|e| device_error("reading the compute capability", e));
            let major = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let compiled = compile(source, &format!("compute_{major}{minor}"))?;
            PTX[index].get_or_init(|| compiled)
        }
    };
    let module = format!("specrs_{}", source.file.trim_end_matches(".cu"));
    Ok(device.get_or_load_custom_func(entry, &module, ptx)?.into_cuda_function())
}

/// PTX of `source` for an architecture such as "compute_90", without a device.
pub fn compile(source: &Source, arch: &str) -> Result<String> {
    let options = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some(source.file.to_string()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(source.text, options)
        .map_err(|e| device_error(&format!("NVRTC on {} for {arch}", source.file), e))?;
    Ok(ptx.to_src())
}

/// Whether GPU 0 opens (device tests return early where it does not, saying so).
#[cfg(test)]
pub fn gpu_present() -> bool {
    match open(0) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("no CUDA device here ({e}); the kernels were not run on a GPU");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs without a GPU (NVRTC only needs its library): every source, every architecture, every
    /// entry point present in the PTX.
    #[test]
    fn every_kernel_compiles_with_nvrtc_for_every_architecture() {
        for arch in ARCHITECTURES {
            for source in SOURCES {
                let ptx = compile(source, arch).unwrap();
                for entry in source.entries {
                    assert!(
                        ptx.contains(&format!(".entry {entry}(")),
                        "{} for {arch}: no {entry} in its PTX",
                        source.file
                    );
                }
            }
        }
    }

    /// What the GPU would run, assembled here: ptxas (the toolkit's assembler, on PATH under
    /// `make test-cuda-build`, from scripts/cuda-env.sh) turns each source's PTX into machine code
    /// for sm_80 and sm_90, and no kernel spills registers to local memory (a spill is a memory
    /// round trip per use in a step bound by memory bandwidth: the per-lane arrays of
    /// paged_attention, say, must stay in registers).
    #[test]
    fn every_kernel_assembles_without_register_spills() {
        let dir = std::env::temp_dir().join(format!("specrs-ptxas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for arch in ARCHITECTURES {
            let sm = arch.replace("compute_", "sm_");
            for source in SOURCES {
                let path = dir.join(format!("{}.{sm}.ptx", source.file));
                std::fs::write(&path, compile(source, arch).unwrap()).unwrap();
                let run = std::process::Command::new("ptxas")
                    .args(["-arch", &sm, "-v", "-o", "/dev/null"])
                    .arg(&path)
                    .output()
                    .expect("ptxas on PATH (eval \"$(scripts/cuda-env.sh)\", as make test-cuda-build does)");
                let log = String::from_utf8_lossy(&run.stderr);
                assert!(run.status.success(), "ptxas on {} for {sm}: {log}", source.file);
                // "Function properties for NAME" then "N bytes stack frame, S bytes spill stores, L
                // bytes spill loads".
                let mut checked = 0;
                let mut lines = log.lines();
                while let Some(line) = lines.next() {
                    let Some((_, name)) = line.split_once("Function properties for ") else { continue };
                    let properties = lines.next().unwrap_or_default();
                    assert!(
                        properties.contains(" 0 bytes spill stores, 0 bytes spill loads"),
                        "{} for {sm}: {name} spills: {properties}",
                        source.file
                    );
                    checked += usize::from(source.entries.contains(&name.trim()));
                }
                assert_eq!(checked, source.entries.len(), "{} for {sm}: every entry reported: {log}", source.file);
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
