//! A head's tensors, from a safetensors checkpoint (a directory as the EAGLE repository, SpecForge,
//! `speculators`, Medusa and IBM's fms-extras write it, or one `.safetensors` file) or from a GGUF
//! file (llama.cpp's `eagle3` heads, the `nextn` MTP layers of a target's GGUF), read once into
//! f32 tensors on the head's device (linear weights optionally quantized to Q8_0 / Q4_0).
//!
//! Invariant: every tensor is checked against the shape the head's config implies before any
//! head is built; a missing tensor or a wrong shape is a `ModelLoadError` naming the file, the
//! tensor, both shapes and the fix.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Module, Tensor};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::kernels::qlinear::QLinear;

/// A linear layer's weight: f32 as read, or quantized at load (`"quantization"` in the head's
/// config), which cuts the bytes a draft step reads 4x (Q8_0) or 7x (Q4_0).
enum Weight {
    /// `[out_features, in_features]` f32.
    Dense(Tensor),
    /// specrs' CPU kernels (the target's own).
    Native(QLinear),
    /// candle's quantized matmul (CUDA).
    Quantized(QMatMul),
}

/// A linear layer: weight `[out_features, in_features]`, optional `[out_features]` f32 bias.
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    /// out_features * in_features: what one row through it multiplies.
    num_weights: usize,
}

impl Linear {
    /// How many weights one row through it multiplies (out_features * in_features).
    pub fn num_weights(&self) -> usize {
        self.num_weights
    }

    /// `[n, in_features]` -> `[n, out_features]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::Dense(w) => x.matmul(&w.t()?)?,
            Weight::Quantized(w) => w.forward(x)?,
            Weight::Native(w) => {
                let n = x.dim(0)?;
                let rows = w.forward_rows(&x.flatten_all()?.to_vec1::<f32>()?, n)?;
                Tensor::from_vec(rows, (n, w.out_features()), x.device())?
            }
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

enum Source {
    Safetensors(MmapedSafetensors),
    Gguf(Box<GgufFile>),
}

pub struct HeadWeights {
    /// The directory or file read, for messages.
    path: PathBuf,
    source: Source,
    /// Integer tensors of a GGUF file (`gguf::open_with_integer_tensors`), by name.
    integers: HashMap<String, Vec<i64>>,
    device: Device,
    /// Linear weights are quantized to this at load (None: kept f32).
    quantize: Option<GgmlDType>,
    pub num_bytes: usize,
}

impl HeadWeights {
    /// Every `*.safetensors` file of `dir` (or `dir` itself when it is one file).
    pub fn safetensors(path: &Path, device: &Device) -> Result<Self> {
        let files: Vec<PathBuf> = if path.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::model_load(format!("cannot read {}: {e}", path.display())))?
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            files.sort();
            files
        } else {
            vec![path.to_path_buf()]
        };
        if files.is_empty() {
            return Err(Error::model_load(format!(
                "{} holds no .safetensors file; a head directory needs config.json and its weights \
                 (model.safetensors, or pytorch_model.bin converted to safetensors)",
                path.display()
            )));
        }
        // SAFETY: read-only mappings of files specrs never writes (as in hf_dir.rs).
        let st = unsafe { MmapedSafetensors::multi(&files) }
            .map_err(|e| Error::model_load(format!("{}: cannot read the safetensors files: {e}", path.display())))?;
        Ok(Self {
            path: path.to_path_buf(),
            source: Source::Safetensors(st),
            integers: HashMap::new(),
            device: device.clone(),
            quantize: None,
            num_bytes: 0,
        })
    }

    /// A GGUF file and its integer tensors (`gguf::open_with_integer_tensors`).
    pub fn gguf(gguf: GgufFile, integers: HashMap<String, Vec<i64>>, device: &Device) -> Self {
        Self {
            path: gguf.path.clone(),
            source: Source::Gguf(Box::new(gguf)),
            integers,
            device: device.clone(),
            quantize: None,
            num_bytes: 0,
        }
    }

    /// The GGUF file, for its metadata (None for safetensors).
    pub fn gguf_file(&self) -> Option<&GgufFile> {
        match &self.source {
            Source::Gguf(g) => Some(g),
            Source::Safetensors(_) => None,
        }
    }

    /// Quantizes every linear weight read from now on to `dtype` (Q8_0 or Q4_0: blocks of 32, so
    /// every head width of a real model fits; a row of another width stays f32).
    pub fn quantize_linears(&mut self, dtype: Option<GgmlDType>) {
        self.quantize = dtype;
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn has(&self, name: &str) -> bool {
        match &self.source {
            Source::Safetensors(st) => st.get(name).is_ok(),
            Source::Gguf(g) => g.has_tensor(name),
        }
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = match &self.source {
            Source::Safetensors(st) => st.tensors().into_iter().map(|(n, _)| n).collect(),
            Source::Gguf(g) => g.tensor_names(),
        };
        names.sort();
        names
    }

    /// The first of `names` the checkpoint holds (formats name one tensor differently).
    pub fn first_of<'n>(&self, names: &[&'n str]) -> Option<&'n str> {
        names.iter().copied().find(|n| self.has(n))
    }

    /// Shape of `name` (rows first), None when absent.
    pub fn dims(&self, name: &str) -> Option<Vec<usize>> {
        match &self.source {
            Source::Safetensors(st) => st.get(name).ok().map(|v| v.shape().to_vec()),
            Source::Gguf(g) => g.tensor_dims(name),
        }
    }

    /// Entries of the integer tensor `name` of a GGUF file, if it has one.
    pub fn integer_len(&self, name: &str) -> Option<usize> {
        self.integers.get(name).map(Vec::len)
    }

    /// `name` as stored (any dtype), on the CPU.
    fn read(&mut self, name: &str) -> Result<Tensor> {
        if !self.has(name) {
            return Err(Error::model_load(format!(
                "{}: the head has no tensor '{name}'; it is incomplete or not a head of the method \
                 asked for (its tensors: {})",
                self.path.display(),
                summarize(&self.names())
            )));
        }
        let path = self.path.display().to_string();
        let t = match &mut self.source {
            Source::Safetensors(st) => st.load(name, &Device::Cpu)?,
            Source::Gguf(g) => g.tensor(name, &Device::Cpu)?.dequantize(&Device::Cpu)?,
        };
        if t.dtype() == DType::U8 {
            return Err(Error::model_load(format!("{path}: tensor '{name}' is stored as bytes; expected numbers")));
        }
        Ok(t)
    }

    /// `name` as f32 on the CPU, checked against `shape`.
    fn checked(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.read(name)?;
        if t.dims() != shape {
            return Err(Error::model_load(format!(
                "{}: tensor '{name}' has shape {:?} but the head's config implies {shape:?}; the config and \
                 the weights belong to different heads",
                self.path.display(),
                t.dims()
            )));
        }
        Ok(t.to_dtype(DType::F32)?)
    }

    /// `name` as f32 on the head's device, checked against `shape`.
    pub fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.checked(name, shape)?;
        self.num_bytes += t.elem_count() * 4;
        Ok(t.to_device(&self.device)?)
    }

    pub fn optional(&mut self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.has(name) {
            self.tensor(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// `{name}.weight` `[out, in]` with `{name}.bias` `[out]` when present.
    pub fn linear(&mut self, name: &str, out_features: usize, in_features: usize) -> Result<Linear> {
        let weight_name = format!("{name}.weight");
        let shape = [out_features, in_features];
        let weight = match self.quantize.filter(|q| in_features.is_multiple_of(q.block_size())) {
            None => Weight::Dense(self.tensor(&weight_name, &shape)?),
            Some(dtype) => {
                // Quantized from the f32 weight on the host, once, straight onto the device.
                let f32_weight = self.checked(&weight_name, &shape)?;
                let q = Arc::new(QTensor::quantize_onto(&f32_weight, dtype, &self.device)?);
                self.num_bytes += q.storage_size_in_bytes();
                let native = if self.device.is_cpu() { Some(QLinear::new(q.clone())?) } else { None };
                match native.filter(QLinear::is_native) {
                    Some(native) => Weight::Native(native),
                    None => Weight::Quantized(QMatMul::from_arc(q)?),
                }
            }
        };
        let bias = self.optional(&format!("{name}.bias"), &[out_features])?;
        Ok(Linear { weight, bias, num_weights: out_features * in_features })
    }

    /// An integer vector (`d2t`) as i64 values on the host, checked to have `len` entries.
    pub fn ids(&mut self, name: &str, len: usize) -> Result<Vec<i64>> {
        if let Some(ids) = self.integers.get(name) {
            if ids.len() != len {
                return Err(Error::model_load(format!(
                    "{}: tensor '{name}' has {} entries; expected {len} (one per draft-vocabulary token)",
                    self.path.display(),
                    ids.len()
                )));
            }
            return Ok(ids.clone());
        }
        let t = self.read(name)?;
        if t.dims() != [len] {
            return Err(Error::model_load(format!(
                "{}: tensor '{name}' has shape {:?}; expected [{len}] (one entry per draft-vocabulary token)",
                self.path.display(),
                t.dims()
            )));
        }
        Ok(match t.dtype() {
            DType::I64 => t.to_vec1::<i64>()?,
            DType::U32 => t.to_vec1::<u32>()?.into_iter().map(i64::from).collect(),
            // Floats hold ids exactly up to 2^24, past any vocabulary here.
            _ => t.to_dtype(DType::F64)?.to_vec1::<f64>()?.into_iter().map(|x| x as i64).collect(),
        })
    }
}

/// The first names of a long list, for messages.
fn summarize(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(12).map(String::as_str).collect();
    if names.len() > shown.len() {
        format!("{}, ... ({} in all)", shown.join(", "), names.len())
    } else {
        shown.join(", ")
    }
}
