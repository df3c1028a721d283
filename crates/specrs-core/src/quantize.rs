//! Requantizing a GGUF model to a lower-bit weight type: the `quantized_self` draft (the target
//! re-encoded so each forward reads fewer bytes) and `specrs.requantize` for users.
//!
//! Every 2-D weight is dequantized to f32 and quantized again to the requested type; 1-D tensors
//! (norm weights) are copied. K-quant types work on 256-wide blocks, so a weight whose rows are not
//! a multiple of 256 wide (every attention and gate/up matrix of SmolLM2, hidden size 576) falls
//! back to Q4_0, as llama.cpp's quantizer does for such tensors; the report lists what each weight
//! became.
//!
//! Invariant: the written file has the source's metadata (tokenizer included) and tensor names, so
//! it loads as the same architecture with the same vocabulary; it appears under its final name
//! only once complete (written to a temporary name, then renamed).

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::Device;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Weight types a model can be requantized to, by their llama.cpp names.
pub const QUANT_TYPES: [(&str, GgmlDType); 8] = [
    ("q2_k", GgmlDType::Q2K),
    ("q3_k", GgmlDType::Q3K),
    ("q4_0", GgmlDType::Q4_0),
    ("q4_1", GgmlDType::Q4_1),
    ("q4_k", GgmlDType::Q4K),
    ("q5_k", GgmlDType::Q5K),
    ("q6_k", GgmlDType::Q6K),
    ("q8_0", GgmlDType::Q8_0),
];

/// Parses a type name such as "q4_0" or "Q2_K".
pub fn parse_quant_type(name: &str) -> Result<GgmlDType> {
    let lower = name.to_ascii_lowercase();
    QUANT_TYPES.iter().find(|(n, _)| *n == lower).map(|(_, t)| *t).ok_or_else(|| {
        let names: Vec<&str> = QUANT_TYPES.iter().map(|(n, _)| *n).collect();
        Error::config(format!("unknown quantization type '{name}'; use one of {}", names.join(", ")))
    })
}

pub fn quant_type_name(dtype: GgmlDType) -> String {
    QUANT_TYPES
        .iter()
        .find(|(_, t)| *t == dtype)
        .map_or_else(|| format!("{dtype:?}").to_lowercase(), |(n, _)| n.to_string())
}

/// What one tensor became.
#[derive(Debug, Clone, PartialEq)]
pub struct RequantizedTensor {
    pub name: String,
    pub from: GgmlDType,
    pub to: GgmlDType,
}

/// Writes `src` requantized to `dtype` at `dst`.
pub fn requantize_gguf(src: &Path, dst: &Path, dtype: GgmlDType) -> Result<Vec<RequantizedTensor>> {
    let mut gguf = GgufFile::open(src)?;
    let mut names = gguf.tensor_names();
    names.sort();
    let mut tensors = Vec::with_capacity(names.len());
    let mut report = Vec::with_capacity(names.len());
    for name in &names {
        let tensor = gguf.tensor(name, &Device::Cpu)?;
        let from = tensor.dtype();
        let to = match tensor.shape().dims() {
            [_, width] => [dtype, GgmlDType::Q4_0].into_iter().find(|t| width % t.block_size() == 0).unwrap_or(from),
            _ => from,
        };
        let tensor = if to == from { tensor } else { QTensor::quantize(&tensor.dequantize(&Device::Cpu)?, to)? };
        report.push(RequantizedTensor { name: name.clone(), from, to });
        tensors.push(tensor);
    }
    let metadata: Vec<(&str, &gguf_file::Value)> = gguf.metadata().iter().map(|(k, v)| (k.as_str(), v)).collect();
    let named: Vec<(&str, &QTensor)> = names.iter().map(|n| n.as_str()).zip(&tensors).collect();

    let partial = dst.with_extension("gguf.partial");
    let write = || -> std::result::Result<(), String> {
        if let Some(dir) = dst.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        }
        let mut out = BufWriter::new(File::create(&partial).map_err(|e| e.to_string())?);
        gguf_file::write(&mut out, &metadata, &named).map_err(|e| e.to_string())?;
        out.into_inner().map_err(|e| e.to_string())?.sync_all().map_err(|e| e.to_string())?;
        std::fs::rename(&partial, dst).map_err(|e| e.to_string())
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&partial);
        Error::config(format!("cannot write the requantized model to {}: {e}; pass a writable path", dst.display()))
    })?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names_round_trip_and_unknown_names_list_the_valid_ones() {
        for (name, dtype) in QUANT_TYPES {
            assert_eq!(parse_quant_type(&name.to_uppercase()).unwrap(), dtype);
            assert_eq!(quant_type_name(dtype), name);
        }
        let err = parse_quant_type("q1").unwrap_err().to_string();
        assert!(err.contains("q4_0") && err.contains("q2_k"), "{err}");
    }
}
