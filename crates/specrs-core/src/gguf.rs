//! Opening a GGUF file: header, metadata accessors and tensor loading with errors that name the
//! file and the fix.
//!
//! Invariant: `GgufFile::open` (and `from_bytes`, the same checks on bytes in memory) only
//! succeeds when the header parses and every tensor's data lies inside the file (sizes computed
//! without overflow, rows made of whole quantization blocks, no empty tensor), starts at a multiple
//! of the file's alignment and overlaps no other tensor's data, as llama.cpp's loader requires; so a
//! truncated download or a misplaced tensor fails at load time, not as garbage output. Shapes against the model's config are checked
//! by `model/gguf_layout.rs`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Cursor, Read, Seek};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::{Error, Result};

/// Where the bytes come from: a file on disk, or memory (`from_bytes`: tests and fuzzing).
trait Source: Read + Seek + Send + Sync {}
impl<T: Read + Seek + Send + Sync> Source for T {}

pub struct GgufFile {
    pub path: PathBuf,
    content: Content,
    reader: Box<dyn Source>,
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
        Self::read(path, Box::new(BufReader::new(file)), file_size)
    }

    /// A GGUF file held in memory; `name` stands for its path in error messages.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        let file_size = bytes.len() as u64;
        Self::read(name.into(), Box::new(Cursor::new(bytes)), file_size)
    }

    fn read(path: PathBuf, mut reader: Box<dyn Source>, file_size: u64) -> Result<Self> {
        let shown = path.display();
        if alignment_is_zero(&mut reader) {
            return Err(Error::model_load(format!(
                "{shown} is corrupt: its metadata 'general.alignment' is 0; re-download it or convert the model again"
            )));
        }
        let content = Content::read(&mut reader).map_err(|e| {
            Error::model_load(format!(
                "{shown} is not a valid GGUF file ({e}); re-download it or convert the model to GGUF"
            ))
        })?;
        let alignment = data_alignment(&content.metadata);
        let mut extents = Vec::with_capacity(content.tensor_infos.len());
        for (name, info) in &content.tensor_infos {
            let num_bytes = check_tensor_extent(info, content.tensor_data_offset, file_size)
                .and_then(|num_bytes| check_tensor_alignment(info, alignment).map(|()| num_bytes))
                .map_err(|why| Error::model_load(format!("{shown}: tensor '{name}' {why}")))?;
            extents.push((info.offset, info.offset + num_bytes, name.as_str()));
        }
        check_no_overlap(&mut extents).map_err(|why| Error::model_load(format!("{shown}: {why}")))?;
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

/// GGML's integer tensor types, which candle's reader does not know (llama.cpp writes an eagle3
/// head's `d2t` as I64).
const GGML_I32: u32 = 26;
const GGML_I64: u32 = 27;

/// A GGUF file that may hold integer tensors (llama.cpp's eagle3 heads): their values by name, and
/// the file opened with each of them relabelled as F32 data of the same byte size, so candle's
/// reader takes the rest (a relabelled tensor is read from the returned map, never as floats).
/// Without integer tensors this is `GgufFile::open`.
pub fn open_with_integer_tensors(path: &Path) -> Result<(GgufFile, HashMap<String, Vec<i64>>)> {
    let file = File::open(path).map_err(|e| Error::model_load(format!("cannot open {}: {e}", path.display())))?;
    let integer = integer_tensor_infos(&mut BufReader::new(file))
        .map_err(|e| Error::model_load(format!("{} is not a valid GGUF file ({e}); re-convert it", path.display())))?;
    if integer.is_empty() {
        return Ok((GgufFile::open(path)?, HashMap::new()));
    }
    let bytes = std::fs::read(path).map_err(|e| Error::model_load(format!("cannot read {}: {e}", path.display())))?;
    from_bytes_with_integer_tensors(path, bytes)
}

/// `open_with_integer_tensors` on bytes in memory; `name` stands for the path in messages.
pub fn from_bytes_with_integer_tensors(
    name: impl Into<PathBuf>,
    mut bytes: Vec<u8>,
) -> Result<(GgufFile, HashMap<String, Vec<i64>>)> {
    let name = name.into();
    let shown = name.display().to_string();
    let integer = integer_tensor_infos(&mut Cursor::new(&bytes))
        .map_err(|e| Error::model_load(format!("{shown} is not a valid GGUF file ({e}); re-convert it")))?;
    let mut values = HashMap::new();
    for t in integer {
        let width = if t.ggml_type == GGML_I64 { 8 } else { 4 };
        let count = t.dims.iter().try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
        let range = count
            .and_then(|c| c.checked_mul(width))
            .and_then(|len| (t.data_start as usize).checked_add(len))
            .map(|end| t.data_start as usize..end)
            .filter(|r| r.end <= bytes.len() && !r.is_empty())
            .ok_or_else(|| Error::model_load(format!("{shown}: tensor '{}' runs past the end of the file", t.name)))?;
        let data = &bytes[range];
        let ints: Vec<i64> = if width == 8 {
            data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
        } else {
            data.chunks_exact(4).map(|b| i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes")))).collect()
        };
        // Relabel: F32, with an I64 row twice as long, so the byte size is unchanged.
        bytes[t.type_at..t.type_at + 4].copy_from_slice(&0u32.to_le_bytes());
        let row = t.dims[0].saturating_mul(width as u64 / 4);
        bytes[t.first_dim_at..t.first_dim_at + t.dim_width].copy_from_slice(&row.to_le_bytes()[..t.dim_width]);
        values.insert(t.name, ints);
    }
    Ok((GgufFile::from_bytes(name, bytes)?, values))
}

/// Where an integer tensor's info and data sit in a GGUF file.
struct IntegerTensor {
    name: String,
    ggml_type: u32,
    /// GGUF order (ne[0] first).
    dims: Vec<u64>,
    /// Byte positions of its type field and of its first dimension (`dim_width` bytes wide).
    type_at: usize,
    first_dim_at: usize,
    dim_width: usize,
    data_start: u64,
}

/// The integer tensors of the GGUF file `r` (header and tensor infos only).
fn integer_tensor_infos(r: &mut dyn Source) -> std::io::Result<Vec<IntegerTensor>> {
    let alignment = scan_alignment(r)?.filter(|&a| a > 0).unwrap_or(32);
    r.rewind()?;
    let mut magic_and_version = [0u8; 8];
    r.read_exact(&mut magic_and_version)?;
    if &magic_and_version[..4] != b"GGUF" {
        return Err(std::io::Error::other("no GGUF magic"));
    }
    let wide = u32::from_le_bytes(magic_and_version[4..].try_into().expect("4 bytes")) != 1;
    let num_tensors = read_len(r, wide)?;
    for _ in 0..read_len(r, wide)? {
        let key_len = read_len(r, wide)?;
        seek_forward(r, key_len)?;
        let value_type = read_u32(r)?;
        skip_value(r, value_type, wide, 0)?;
    }
    let mut found = Vec::new();
    for _ in 0..num_tensors {
        let name_len = read_len(r, wide)?;
        let mut name = vec![0u8; usize::try_from(name_len).map_err(std::io::Error::other)?.min(1 << 16)];
        r.read_exact(&mut name)?;
        let n_dims = read_u32(r)?.min(8);
        let first_dim_at = r.stream_position()? as usize;
        let dims = (0..n_dims).map(|_| read_len(r, wide)).collect::<std::io::Result<Vec<u64>>>()?;
        let type_at = r.stream_position()? as usize;
        let ggml_type = read_u32(r)?;
        let offset = read_len(r, wide)?;
        if (ggml_type == GGML_I32 || ggml_type == GGML_I64) && !dims.is_empty() {
            let name = String::from_utf8_lossy(&name).into_owned();
            let dim_width = if wide { 8 } else { 4 };
            // The offset is relative to the data section, which starts after the last info.
            found.push(IntegerTensor { name, ggml_type, dims, type_at, first_dim_at, dim_width, data_start: offset });
        }
    }
    let data_section = r.stream_position()?.div_ceil(alignment) * alignment;
    for t in &mut found {
        t.data_start =
            data_section.checked_add(t.data_start).ok_or_else(|| std::io::Error::other("offset overflows"))?;
    }
    Ok(found)
}

/// The alignment of the tensor data, as candle's reader takes it (`Content::read`): an integer
/// `general.alignment` of up to 32 bits that is not negative, else GGUF's default of 32.
fn data_alignment(metadata: &HashMap<String, Value>) -> u64 {
    match metadata.get("general.alignment") {
        Some(Value::U8(v)) => u64::from(*v),
        Some(Value::U16(v)) => u64::from(*v),
        Some(Value::U32(v)) => u64::from(*v),
        Some(Value::I8(v)) if *v >= 0 => *v as u64,
        Some(Value::I16(v)) if *v >= 0 => *v as u64,
        Some(Value::I32(v)) if *v >= 0 => *v as u64,
        _ => DEFAULT_ALIGNMENT,
    }
}

/// GGUF's alignment when the file sets none (candle's and llama.cpp's `GGUF_DEFAULT_ALIGNMENT`).
const DEFAULT_ALIGNMENT: u64 = 32;

/// Why tensor `info` is misplaced, if it is: every writer starts each tensor's data at a multiple
/// of the alignment (llama.cpp refuses other files), so an offset off by a few bytes means the
/// file is corrupt, and reading it as is would give garbage weights and silently wrong output.
fn check_tensor_alignment(info: &TensorInfo, alignment: u64) -> std::result::Result<(), String> {
    if info.offset.is_multiple_of(alignment) {
        return Ok(());
    }
    Err(format!(
        "starts at byte {} of the tensor data, which is not a multiple of the file's alignment {alignment} \
         (general.alignment, {DEFAULT_ALIGNMENT} when unset): its data is misplaced and the file is corrupt; \
         re-download it or convert the model again",
        info.offset
    ))
}

/// Why the tensors' data ranges `(start, end, name)` (relative to the data section) are not
/// disjoint, if they are not: two tensors sharing bytes is no writer's output (llama.cpp lays them
/// out one after the other and refuses anything else), so at least one of them is misplaced.
fn check_no_overlap(extents: &mut [(u64, u64, &str)]) -> std::result::Result<(), String> {
    extents.sort_unstable();
    for pair in extents.windows(2) {
        let ((start, end, first), (next_start, _, second)) = (pair[0], pair[1]);
        if next_start < end {
            return Err(format!(
                "the data of tensors '{first}' (bytes {start}..{end} of the tensor data) and '{second}' (from byte \
                 {next_start}) overlap: at least one is misplaced and the file is corrupt; re-download it or \
                 convert the model again"
            ));
        }
    }
    Ok(())
}

/// The size in bytes of tensor `info`, if it can be read from a file of `file_size` bytes whose
/// tensor data starts at `data_offset`; else why not: a row that does not split into whole
/// quantization blocks, a size whose arithmetic overflows, or data that runs past the end of the
/// file.
fn check_tensor_extent(info: &TensorInfo, data_offset: u64, file_size: u64) -> std::result::Result<u64, String> {
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
    // An empty tensor is no model's, and candle would cast its dangling data pointer to blocks of a
    // stricter alignment (undefined behaviour) when reading it.
    if num_bytes == 0 {
        return Err(format!("has shape {dims:?}, no elements; the file is corrupt, re-convert the model"));
    }
    let end = data_offset.checked_add(info.offset).and_then(|start| start.checked_add(num_bytes as u64));
    match end {
        Some(end) if end <= file_size => Ok(num_bytes as u64),
        _ => Err(format!(
            "({dims:?} {dtype:?}, {num_bytes} bytes at offset {}) ends past the end of the file ({file_size} \
             bytes); the file is truncated or corrupt (an incomplete download?): fetch it again",
            data_offset.saturating_add(info.offset)
        )),
    }
}

/// Whether the header sets `general.alignment` to 0, which candle's reader divides by without a
/// check (a panic). Parses only what it takes to skip each value; anything malformed is left
/// for candle's reader to report. Leaves `reader` at the start.
fn alignment_is_zero(reader: &mut dyn Source) -> bool {
    let zero = scan_alignment(reader).unwrap_or(None) == Some(0);
    let _ = reader.rewind();
    zero
}

/// The last `general.alignment` integer in the header (candle keeps the last of repeated keys).
fn scan_alignment(r: &mut dyn Source) -> std::io::Result<Option<u64>> {
    let mut magic_and_version = [0u8; 8];
    r.read_exact(&mut magic_and_version)?;
    // GGUF v1 writes lengths and counts as u32, later versions as u64.
    let wide = u32::from_le_bytes(magic_and_version[4..].try_into().unwrap()) != 1;
    let _tensor_count = read_len(r, wide)?;
    let mut alignment = None;
    for _ in 0..read_len(r, wide)? {
        let key_len = read_len(r, wide)?;
        let mut key = [0u8; 17];
        let is_alignment = key_len == 17 && {
            r.read_exact(&mut key)?;
            &key == b"general.alignment"
        };
        if key_len != 17 {
            seek_forward(r, key_len)?;
        }
        let value_type = read_u32(r)?;
        if is_alignment && value_type <= 5 {
            // u8, i8, u16, i16, u32, i32: the integer types candle reads the alignment from.
            let mut value = [0u8; 4];
            let width = [1, 1, 2, 2, 4, 4][value_type as usize];
            r.read_exact(&mut value[..width])?;
            alignment = Some(u64::from(u32::from_le_bytes(value)));
        } else {
            skip_value(r, value_type, wide, 0)?;
        }
    }
    Ok(alignment)
}

fn read_u32(r: &mut dyn Source) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_len(r: &mut dyn Source, wide: bool) -> std::io::Result<u64> {
    if !wide {
        return read_u32(r).map(u64::from);
    }
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn seek_forward(r: &mut dyn Source, n: u64) -> std::io::Result<()> {
    let n = i64::try_from(n).map_err(|_| std::io::Error::other("length past the end"))?;
    r.seek(std::io::SeekFrom::Current(n)).map(|_| ())
}

fn skip_value(r: &mut dyn Source, value_type: u32, wide: bool, depth: usize) -> std::io::Result<()> {
    let fixed = |t: u32| -> Option<u64> {
        match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    };
    match value_type {
        8 => {
            let len = read_len(r, wide)?;
            seek_forward(r, len)
        }
        9 if depth < 4 => {
            let element_type = read_u32(r)?;
            let len = read_len(r, wide)?;
            match fixed(element_type) {
                Some(size) => {
                    seek_forward(r, len.checked_mul(size).ok_or_else(|| std::io::Error::other("array too long"))?)
                }
                // Each element reads at least one length, so a bogus count ends at the file's end.
                None => (0..len).try_for_each(|_| skip_value(r, element_type, wide, depth + 1)),
            }
        }
        t => match fixed(t) {
            Some(size) => seek_forward(r, size),
            None => Err(std::io::Error::other("unknown value type")),
        },
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF v3 file: `kvs` as (key, type id, value bytes), one f32 tensor of GGUF dims `dims`
    /// with `data` bytes of data.
    fn gguf_bytes(kvs: &[(&str, u32, Vec<u8>)], dims: &[u64], data: usize) -> Vec<u8> {
        gguf_with_tensors(kvs, &[("t.weight", dims, 0)], data)
    }

    /// A GGUF v3 file: `kvs` as (key, type id, value bytes), f32 tensors (name, GGUF dims, offset
    /// in the tensor data), and `data` bytes of tensor data.
    fn gguf_with_tensors(kvs: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u64)], data: usize) -> Vec<u8> {
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (key, value_type, value) in kvs {
            string(&mut out, key);
            out.extend(value_type.to_le_bytes());
            out.extend(value);
        }
        for (name, dims, offset) in tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(0u32.to_le_bytes()); // f32
            out.extend(offset.to_le_bytes());
        }
        out.resize(out.len().next_multiple_of(32) + data, 0);
        out
    }

    fn load_error(bytes: Vec<u8>) -> String {
        match GgufFile::from_bytes("t.gguf", bytes) {
            Ok(_) => panic!("loaded"),
            Err(e) => {
                assert!(matches!(e, Error::ModelLoad(_)), "{e:?}");
                e.to_string()
            }
        }
    }

    #[test]
    fn from_bytes_reads_what_open_reads() {
        let name = ("general.name", 8, [&5u64.to_le_bytes()[..], b"tiny!"].concat());
        let gguf = GgufFile::from_bytes("t.gguf", gguf_bytes(&[name], &[4, 2], 32)).unwrap();
        assert_eq!(gguf.get_str("general.name").unwrap(), "tiny!");
        assert_eq!(gguf.tensor_dims("t.weight"), Some(vec![2, 4]));
        assert!(load_error(gguf_bytes(&[], &[4, 2], 31)).contains("is truncated"));
    }

    // The three below were found by fuzz/fuzz_targets/gguf_reader.rs and gguf_edits.rs; each
    // panicked (or, in a release build, read out of bounds or misaligned) before it was checked.

    #[test]
    fn a_zero_alignment_is_an_error_not_a_division_by_zero() {
        for (value_type, value) in [(4, 0u32.to_le_bytes().to_vec()), (0, vec![0]), (3, vec![0, 0])] {
            let bytes = gguf_bytes(&[("general.alignment", value_type, value)], &[4], 16);
            assert!(load_error(bytes).contains("'general.alignment' is 0"));
        }
        // A valid alignment still loads, and the scan leaves the reader where candle expects it.
        let bytes = gguf_bytes(&[("general.alignment", 4, 32u32.to_le_bytes().to_vec())], &[4], 16);
        GgufFile::from_bytes("t.gguf", bytes).unwrap();
    }

    // Issue 38: a tensor whose offset was shifted by one byte loaded and generated "".
    #[test]
    fn a_tensor_off_the_alignment_is_an_error_naming_it_and_the_alignment() {
        let tensors = |b_offset| [("a.weight", &[8u64][..], 0), ("b.weight", &[8u64][..], b_offset)];
        GgufFile::from_bytes("t.gguf", gguf_with_tensors(&[], &tensors(32), 64)).unwrap();
        let err = load_error(gguf_with_tensors(&[], &tensors(33), 96));
        assert!(err.contains("tensor 'b.weight' starts at byte 33"), "{err}");
        assert!(err.contains("not a multiple of the file's alignment 32"), "{err}");
        // The alignment is the file's own: 16 allows what 32 refuses, and 64 refuses what 32 allows.
        let alignment = |a: u32| vec![("general.alignment", 4, a.to_le_bytes().to_vec())];
        GgufFile::from_bytes("t.gguf", gguf_with_tensors(&alignment(16), &tensors(48), 96)).unwrap();
        let err = load_error(gguf_with_tensors(&alignment(64), &tensors(32), 96));
        assert!(err.contains("tensor 'b.weight' starts at byte 32") && err.contains("alignment 64"), "{err}");
    }

    #[test]
    fn tensors_sharing_bytes_are_an_error() {
        // 'a' holds 16 f32 values (64 bytes); 'b' at byte 32 starts inside it.
        let tensors = [("a.weight", &[16u64][..], 0), ("b.weight", &[8u64][..], 32)];
        let err = load_error(gguf_with_tensors(&[], &tensors, 128));
        assert!(
            err.contains("tensors 'a.weight' (bytes 0..64 of the tensor data) and 'b.weight' (from byte 32) overlap")
        );
        let apart = [("a.weight", &[16u64][..], 0), ("b.weight", &[8u64][..], 64)];
        GgufFile::from_bytes("t.gguf", gguf_with_tensors(&[], &apart, 128)).unwrap();
    }

    #[test]
    fn dimensions_whose_product_overflows_are_an_error() {
        assert!(load_error(gguf_bytes(&[], &[1 << 32, 1 << 32], 16)).contains("whose size overflows"));
    }

    #[test]
    fn an_empty_tensor_is_an_error() {
        assert!(load_error(gguf_bytes(&[], &[0, 1 << 40], 16)).contains("no elements"));
    }
}
