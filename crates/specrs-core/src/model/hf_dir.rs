//! Hugging Face model directories: `config.json` (the family, via `families::from_hf_config`),
//! `model.safetensors` or the shards named by `model.safetensors.index.json`, read memory-mapped
//! into dense tensors in their stored dtype (f32, f16 or bf16).
//!
//! Invariant: every tensor the decoder asks for comes from the shard the index names, with the
//! shape the config implies; a missing file, a missing tensor or a wrong shape is a
//! `ModelLoadError` naming the file and what to change, before anything is built.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::config::DecoderConfig;
use super::families;
use crate::error::{Error, Result};

pub struct HfWeights {
    dir: PathBuf,
    safetensors: MmapedSafetensors,
    /// Tensor name -> shard file name, for error messages.
    shard_of: HashMap<String, String>,
    pub dtype: DType,
    pub device: Device,
    pub num_bytes: usize,
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::model_load(format!("cannot read {}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| Error::model_load(format!("{} is not valid JSON: {e}", path.display())))
}

/// Reads `dir/config.json`; `None` when the file does not exist.
pub fn read_optional_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// The family config and the weights of the model in `dir`.
pub fn open(dir: &Path, device: &Device) -> Result<(DecoderConfig, HfWeights)> {
    let config_path = dir.join("config.json");
    if !config_path.exists() {
        return Err(Error::model_load(format!(
            "{} has no config.json; a Hugging Face model directory needs config.json, *.safetensors and tokenizer.json",
            dir.display()
        )));
    }
    let config = families::from_hf_config(&read_json(&config_path)?, &config_path.display().to_string())?;

    let index_path = dir.join("model.safetensors.index.json");
    let mut shard_of = HashMap::new();
    let shards: Vec<String> = if index_path.exists() {
        let index = read_json(&index_path)?;
        let map = index.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| {
            Error::model_load(format!("{}: no weight_map object; the index is corrupt", index_path.display()))
        })?;
        let mut shards: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file.as_str().unwrap_or_default().to_string();
            if !shards.contains(&file) {
                shards.push(file.clone());
            }
            shard_of.insert(name.clone(), file);
        }
        shards
    } else {
        vec!["model.safetensors".to_string()]
    };
    for shard in &shards {
        if !dir.join(shard).is_file() {
            return Err(Error::model_load(format!(
                "{}: the shard {shard} is missing{}; download every file the index names",
                dir.display(),
                if index_path.exists() { " (named by model.safetensors.index.json)" } else { "" }
            )));
        }
    }
    let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
    // SAFETY: the files are mapped read-only; specrs never writes them, and a model directory
    // changed underneath a running engine is outside what any loader can defend against.
    let safetensors = unsafe { MmapedSafetensors::multi(&paths) }
        .map_err(|e| Error::model_load(format!("{}: cannot read the safetensors files: {e}", dir.display())))?;
    let first = safetensors.tensors().into_iter().map(|(name, _)| name).min().unwrap_or_default();
    let dtype = safetensors
        .load(&first, &Device::Cpu)
        .map_err(|e| Error::model_load(format!("{}: cannot read tensor '{first}': {e}", dir.display())))?
        .dtype();
    if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Err(Error::model_load(format!(
            "{}: weights are {dtype:?}; specrs reads f32, f16 or bf16 safetensors (quantized models: use GGUF)",
            dir.display()
        )));
    }
    let weights =
        HfWeights { dir: dir.to_path_buf(), safetensors, shard_of, dtype, device: device.clone(), num_bytes: 0 };
    Ok((config, weights))
}

impl HfWeights {
    pub fn has(&self, name: &str) -> bool {
        self.safetensors.get(name).is_ok()
    }

    /// `name` in the model dtype on the device, checked against `shape`.
    pub fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let shard = self.shard_of.get(name).cloned().unwrap_or_else(|| "model.safetensors".into());
        let t = self.safetensors.load(name, &Device::Cpu).map_err(|_| {
            Error::model_load(format!(
                "{}: tensor '{name}' is missing from {shard}; the checkpoint does not match its config.json",
                self.dir.display()
            ))
        })?;
        if t.dims() != shape {
            return Err(Error::model_load(format!(
                "{}/{shard}: tensor '{name}' has shape {:?} but config.json implies {shape:?}; the config and \
                 the weights belong to different models",
                self.dir.display(),
                t.dims()
            )));
        }
        self.num_bytes += t.elem_count() * self.dtype.size_in_bytes();
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    pub fn optional(&mut self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.has(name) {
            self.tensor(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}
