//! Opening a GGUF file: header, metadata accessors and tensor loading with errors that name the
//! file and the fix.
//!
//! Invariant: `GgufFile::open` only succeeds when the header parses and every tensor's data lies
//! inside the file (sizes computed without overflow, rows made of whole quantization blocks), so a
//! truncated download fails at load time, not mid-generation. Shapes against the model's config
//! are checked by `model/gguf_layout.rs`.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::{Error, Result};

pub struct GgufFile {
    pub path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let shown = path.display();
        if !path.exists() {
            return Err(Error::model_load(format!(
                "model file not found: {shown}; pass the path of an existing .gguf file"
            )));
        }
        if path.is_dir() {
            return Err(Error::model_load(format!("{shown} is a directory; pass the path of a .gguf file")));
        }
        let file = File::open(&path).map_err(|e| Error::model_load(format!("cannot open model file {shown}: {e}")))?;
        let file_size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| {
            Error::model_load(format!(
                "{shown} is not a valid GGUF file ({e}); re-download it or convert the model to GGUF"
            ))
        })?;
        for (name, info) in &content.tensor_infos {
            check_tensor_extent(info, content.tensor_data_offset, file_size)
                .map_err(|why| Error::model_load(format!("{shown}: tensor '{name}' {why}")))?;
        }
        Ok(Self { path, content, reader })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn tensor_names(&self) -> Vec<String> {
        self.content.tensor_infos.keys().cloned().collect()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Shape of a tensor in GGUF order reversed to candle's (rows first).
    pub fn tensor_dims(&self, name: &str) -> Option<Vec<usize>> {
        self.content.tensor_infos.get(name).map(|i| i.shape.dims().to_vec())
    }

    pub fn tensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(Error::model_load(format!(
                "{} has no tensor '{name}'; the file is incomplete or not a supported model",
                self.path.display()
            )));
        }
        self.content
            .tensor(&mut self.reader, name, device)
            .map_err(|e| Error::model_load(format!("{}: cannot read tensor '{name}': {e}", self.path.display())))
    }

    fn value(&self, key: &str) -> Result<&Value> {
        self.content.metadata.get(key).ok_or_else(|| {
            Error::model_load(format!(
                "{} lacks the metadata key '{key}'; the GGUF was written by an incompatible converter",
                self.path.display()
            ))
        })
    }

    fn type_error(&self, key: &str, want: &str) -> Error {
        Error::model_load(format!("{}: metadata '{key}' is not {want}", self.path.display()))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.value(key)? {
            Value::String(s) => Ok(s),
            _ => Err(self.type_error(key, "a string")),
        }
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        value_as_i64(self.value(key)?)
            .filter(|v| *v >= 0)
            .map(|v| v as usize)
            .ok_or_else(|| self.type_error(key, "a non-negative integer"))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.value(key)? {
            Value::F32(v) => Ok(*v),
            Value::F64(v) => Ok(*v as f32),
            v => value_as_i64(v).map(|v| v as f32).ok_or_else(|| self.type_error(key, "a number")),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.value(key)? {
            Value::Bool(b) => Ok(*b),
            _ => Err(self.type_error(key, "a bool")),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&Vec<Value>> {
        match self.value(key)? {
            Value::Array(a) => Ok(a),
            _ => Err(self.type_error(key, "an array")),
        }
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.optional(key, Self::get_usize)
    }
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.optional(key, Self::get_f32)
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.optional(key, Self::get_bool)
    }
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        if self.content.metadata.contains_key(key) {
            self.get_str(key).map(Some)
        } else {
            Ok(None)
        }
    }

    fn optional<T>(&self, key: &str, get: impl Fn(&Self, &str) -> Result<T>) -> Result<Option<T>> {
        if self.content.metadata.contains_key(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Why tensor `info` cannot be read from a file of `file_size` bytes whose tensor data starts at
/// `data_offset`, if it cannot: a row that does not split into whole quantization blocks, a size
/// whose arithmetic overflows, or data that runs past the end of the file.
fn check_tensor_extent(info: &TensorInfo, data_offset: u64, file_size: u64) -> std::result::Result<(), String> {
    let dims = info.shape.dims(); // candle's order: GGUF's ne[0] (the row length) is last
    let (block, dtype) = (info.ggml_dtype.block_size(), info.ggml_dtype);
    let row = dims.last().copied().unwrap_or(1);
    if !row.is_multiple_of(block) {
        return Err(format!(
            "has rows of {row} values, which do not split into {dtype:?} blocks of {block}; the file is corrupt, \
             re-convert the model"
        ));
    }
    let num_bytes = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .and_then(|elems| (elems / block).checked_mul(dtype.type_size()))
        .ok_or_else(|| {
            format!("has shape {dims:?}, whose size overflows; the file is corrupt, re-convert the model")
        })?;
    let end = data_offset.checked_add(info.offset).and_then(|start| start.checked_add(num_bytes as u64));
    match end {
        Some(end) if end <= file_size => Ok(()),
        _ => Err(format!(
            "({dims:?} {dtype:?}, {num_bytes} bytes at offset {}) ends past the end of the file ({file_size} \
             bytes); the file is truncated or corrupt (an incomplete download?): fetch it again",
            data_offset.saturating_add(info.offset)
        )),
    }
}

pub fn value_as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => *x as i64,
        Value::I64(x) => *x,
        _ => return None,
    })
}
