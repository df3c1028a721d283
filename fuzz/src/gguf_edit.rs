//! Structure-aware GGUF inputs: a golden model parsed into metadata and tensors, a few edits
//! chosen from the fuzzer's bytes (a metadata value set, replaced or removed, an array element
//! changed, a tensor's shape, type, name or data changed), written back as a GGUF v3 file.
//!
//! Invariant: `write` emits a well-formed file for any `Model` (valid header, aligned data), so
//! the loader sees nearly valid models whose *contents* are wrong, which raw byte flips of a
//! 150 KB file rarely produce (most break the header).

use std::io::Cursor;

use arbitrary::{Result, Unstructured};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;

const ALIGNMENT: usize = 32;

#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    /// GGUF order: the fastest-varying dimension first.
    pub dims: Vec<u64>,
    pub dtype: u32,
    pub data: Vec<u8>,
}

#[derive(Clone)]
pub struct Model {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<Tensor>,
}

fn dtype_id(dtype: GgmlDType) -> u32 {
    match dtype {
        GgmlDType::F32 => 0,
        GgmlDType::F16 => 1,
        GgmlDType::Q4_0 => 2,
        GgmlDType::Q4_1 => 3,
        GgmlDType::Q5_0 => 6,
        GgmlDType::Q5_1 => 7,
        GgmlDType::Q8_0 => 8,
        GgmlDType::Q8_1 => 9,
        GgmlDType::Q2K => 10,
        GgmlDType::Q3K => 11,
        GgmlDType::Q4K => 12,
        GgmlDType::Q5K => 13,
        GgmlDType::Q6K => 14,
        GgmlDType::Q8K => 15,
        GgmlDType::BF16 => 30,
    }
}

/// (block size, bytes per block) of the GGUF type ids candle reads.
fn dtype_layout(id: u32) -> Option<(u64, u64)> {
    Some(match id {
        0 => (1, 4),
        1 | 30 => (1, 2),
        2 => (32, 18),
        3 => (32, 20),
        6 => (32, 22),
        7 => (32, 24),
        8 => (32, 34),
        9 => (32, 36),
        10 => (256, 84),
        11 => (256, 110),
        12 => (256, 144),
        13 => (256, 176),
        14 => (256, 210),
        15 => (256, 292),
        _ => return None,
    })
}

impl Model {
    /// Parses a trusted GGUF file (the golden models).
    pub fn parse(bytes: &[u8]) -> Model {
        let content = Content::read(&mut Cursor::new(bytes)).expect("golden GGUF parses");
        let mut metadata: Vec<(String, Value)> = content.metadata.into_iter().collect();
        metadata.sort_by(|a, b| a.0.cmp(&b.0));
        let mut tensors: Vec<Tensor> = content
            .tensor_infos
            .into_iter()
            .map(|(name, info)| {
                let dtype = dtype_id(info.ggml_dtype);
                let num_bytes = info.shape.elem_count() / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
                let start = (content.tensor_data_offset + info.offset) as usize;
                let dims = info.shape.dims().iter().rev().map(|&d| d as u64).collect();
                Tensor { name, dims, dtype, data: bytes[start..start + num_bytes].to_vec() }
            })
            .collect();
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        Model { metadata, tensors }
    }

    pub fn write(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(0x4655_4747u32.to_le_bytes());
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend(value_type(value).to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            write_string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.dtype.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offset += t.data.len().next_multiple_of(ALIGNMENT) as u64;
        }
        out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        for t in &self.tensors {
            out.extend(&t.data);
            out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        }
        out
    }

    /// Applies 1..=4 edits chosen by `u`.
    pub fn edit(&mut self, u: &mut Unstructured) -> Result<()> {
        for _ in 0..u.int_in_range(1..=4)? {
            self.edit_once(u)?;
        }
        Ok(())
    }

    fn edit_once(&mut self, u: &mut Unstructured) -> Result<()> {
        let arch = self.arch();
        match u.int_in_range(0..=10)? {
            // Set a known key (or an existing one) to a fuzzed value.
            0..=2 => {
                let key = if u.arbitrary()? && !self.metadata.is_empty() {
                    self.metadata[u.choose_index(self.metadata.len())?].0.clone()
                } else {
                    u.choose(KNOWN_KEYS)?.replace("{arch}", &arch)
                };
                let value = fuzz_value(u, 0)?;
                match self.metadata.iter_mut().find(|(k, _)| *k == key) {
                    Some(entry) => entry.1 = value,
                    None => self.metadata.push((key, value)),
                }
            }
            3 if !self.metadata.is_empty() => {
                self.metadata.remove(u.choose_index(self.metadata.len())?);
            }
            // Change one element of an array (tokens, merges, token types, scores).
            4 => {
                let arrays: Vec<usize> =
                    (0..self.metadata.len()).filter(|&i| matches!(self.metadata[i].1, Value::Array(_))).collect();
                if let Some(&i) = arrays.get(u.choose_index(arrays.len().max(1))?) {
                    let element = fuzz_value(u, 1)?;
                    if let Value::Array(items) = &mut self.metadata[i].1 {
                        match u.int_in_range(0..=2)? {
                            0 if !items.is_empty() => {
                                let at = u.choose_index(items.len())?;
                                items[at] = element;
                            }
                            1 if !items.is_empty() => {
                                let keep = u.choose_index(items.len())?;
                                items.truncate(keep);
                            }
                            _ => items.push(element),
                        }
                    }
                }
            }
            5..=10 if !self.tensors.is_empty() => {
                let i = u.choose_index(self.tensors.len())?;
                let t = &mut self.tensors[i];
                match u.int_in_range(0..=6)? {
                    0 => {
                        let n = u.int_in_range(0..=4)?;
                        t.dims = (0..n).map(|_| fuzz_dim(u)).collect::<Result<_>>()?;
                    }
                    1 if !t.dims.is_empty() => {
                        let at = u.choose_index(t.dims.len())?;
                        t.dims[at] = fuzz_dim(u)?;
                    }
                    2 => t.dtype = *u.choose(&[0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30, 4, 31])?,
                    3 => t.name = u.choose(TENSOR_NAMES)?.to_string(),
                    4 => {
                        self.tensors.remove(i);
                        return Ok(());
                    }
                    5 => {
                        let keep = u.choose_index(t.data.len().max(1))?;
                        t.data.truncate(keep);
                    }
                    // Overwrite a run of data bytes (NaN/inf scales, odd quant blocks).
                    _ => {
                        if !t.data.is_empty() {
                            let at = u.choose_index(t.data.len())?;
                            let byte: u8 = u.arbitrary()?;
                            let end = (at + u.int_in_range(1..=8)?).min(t.data.len());
                            t.data[at..end].fill(byte);
                        }
                    }
                }
                // Usually keep the data the size the (new) shape and type imply, so the edit
                // reaches the model code instead of the truncation check.
                let t = &mut self.tensors[i];
                if u.ratio(3, 4)? {
                    if let Some((block, size)) = dtype_layout(t.dtype) {
                        let elems = t.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
                        if let Some(bytes) = elems.and_then(|e| (e / block).checked_mul(size)) {
                            if bytes <= 1 << 20 {
                                t.data.resize(bytes as usize, 0x3c);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn arch(&self) -> String {
        self.metadata
            .iter()
            .find(|(k, _)| k == "general.architecture")
            .and_then(|(_, v)| if let Value::String(s) = v { Some(s.clone()) } else { None })
            .unwrap_or_else(|| "llama".into())
    }
}

/// Every metadata key specrs reads (`families.rs`, `tokenizer.rs`, `gguf.rs`), `{arch}` standing
/// for the file's architecture.
pub const KNOWN_KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "{arch}.block_count",
    "{arch}.embedding_length",
    "{arch}.feed_forward_length",
    "{arch}.context_length",
    "{arch}.attention.head_count",
    "{arch}.attention.head_count_kv",
    "{arch}.attention.key_length",
    "{arch}.attention.value_length",
    "{arch}.attention.layer_norm_rms_epsilon",
    "{arch}.attention.sliding_window",
    "{arch}.attention.sliding_window_pattern",
    "{arch}.rope.freq_base",
    "{arch}.rope.freq_base_swa",
    "{arch}.rope.dimension_count",
    "{arch}.rope.scaling.type",
    "{arch}.rope.scaling.factor",
    "{arch}.attn_logit_softcapping",
    "{arch}.final_logit_softcapping",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
];

const TENSOR_NAMES: &[&str] = &[
    "token_embd.weight",
    "output.weight",
    "output_norm.weight",
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "blk.0.attn_q.weight",
    "blk.0.attn_k.weight",
    "blk.0.attn_v.weight",
    "blk.0.attn_qkv.weight",
    "blk.0.attn_output.weight",
    "blk.0.attn_norm.weight",
    "blk.0.attn_q_norm.weight",
    "blk.0.attn_k_norm.weight",
    "blk.0.attn_q.bias",
    "blk.0.ffn_up.weight",
    "blk.0.ffn_gate.weight",
    "blk.0.ffn_down.weight",
    "blk.0.ffn_norm.weight",
    "blk.1.attn_q.weight",
    "blk.1.attn_k.weight",
    "blk.1.attn_output.weight",
    "blk.1.ffn_down.weight",
    "blk.1.post_attention_norm.weight",
    "blk.2.attn_q.weight",
];

const STRINGS: &[&str] = &[
    "",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "phi3",
    "gpt2",
    "bert",
    "gpt-2",
    "smollm",
    "llama-bpe",
    "qwen2",
    "linear",
    "yarn",
    "<s>",
    "</s>",
    "<|im_end|>",
    "a b",
    "\u{2581}a",
    "{{ messages }}",
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{{ raise_exception('x') }}",
    "\u{0}",
];

fn fuzz_dim(u: &mut Unstructured) -> Result<u64> {
    Ok(match u.int_in_range(0..=5)? {
        0 => *u.choose(&[0, 1, 2, 3, 16, 31, 32, 64, 255, 256, 257, 1 << 31, 1 << 32, 1 << 62, u64::MAX])?,
        1 => u.int_in_range(0..=512)?,
        _ => u.choose(&[4, 8, 16, 32, 64, 128, 256])?.to_owned(),
    })
}

fn fuzz_value(u: &mut Unstructured, depth: usize) -> Result<Value> {
    let interesting_u64 = [0u64, 1, 2, 3, 4, 6, 8, 16, 62, 64, 255, 256, 1 << 16, 1 << 31, 1 << 32, u64::MAX];
    Ok(match u.int_in_range(0..=10)? {
        0 => Value::U32(*u.choose(&interesting_u64)? as u32),
        1 => Value::U32(u.arbitrary()?),
        2 => Value::I32(u.arbitrary()?),
        3 => Value::U64(*u.choose(&interesting_u64)?),
        4 => Value::I64(u.arbitrary()?),
        5 => Value::F32(*u.choose(&[0.0, -1.0, 1e-6, 1e-30, 1e30, f32::NAN, f32::INFINITY, -f32::INFINITY, 0.5])?),
        6 => Value::F32(u.arbitrary()?),
        7 => Value::Bool(u.arbitrary()?),
        8 => Value::String(u.choose(STRINGS)?.to_string()),
        9 => Value::String(u.arbitrary()?),
        _ if depth == 0 => {
            let n = u.int_in_range(0..=8)?;
            let kind = u.int_in_range(0..=2)?;
            Value::Array(
                (0..n)
                    .map(|_| match kind {
                        0 => Ok(Value::String(u.arbitrary()?)),
                        1 => Ok(Value::I32(u.arbitrary()?)),
                        _ => Ok(Value::F32(u.arbitrary()?)),
                    })
                    .collect::<Result<_>>()?,
            )
        }
        _ => Value::U8(u.arbitrary()?),
    })
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => write_string(out, s),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Array(items) => {
            // An empty array keeps the type of strings (any type is valid for zero elements).
            let element_type = items.first().map_or(8, value_type);
            out.extend(element_type.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                // Mixed arrays cannot be written; elements of another type become the first's.
                if value_type(item) == element_type {
                    write_value(out, item);
                } else {
                    write_value(out, &items[0]);
                }
            }
        }
    }
}
