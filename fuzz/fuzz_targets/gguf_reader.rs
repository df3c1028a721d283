//! GGUF reader on raw bytes: `GgufFile::from_bytes`, every metadata accessor on every key, and
//! every tensor read and dequantized; and the integer-tensor reader of eagle3 heads
//! (`from_bytes_with_integer_tensors`). Malformed bytes must be an `Err`, never a panic or a huge
//! allocation.
#![no_main]

use candle_core::Device;
use libfuzzer_sys::fuzz_target;
use specrs_core::gguf::{from_bytes_with_integer_tensors, GgufFile};

fuzz_target!(|data: &[u8]| {
    let _ = from_bytes_with_integer_tensors("fuzz.gguf", data.to_vec());
    let Ok(mut gguf) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    let keys: Vec<String> = gguf.metadata().keys().cloned().collect();
    for key in &keys {
        let _ = gguf.get_str(key);
        let _ = gguf.get_usize(key);
        let _ = gguf.get_f32(key);
        let _ = gguf.get_bool(key);
        let _ = gguf.get_array(key);
        let _ = gguf.opt_usize(key);
    }
    for name in gguf.tensor_names() {
        let _ = gguf.tensor_dims(&name);
        if let Ok(tensor) = gguf.tensor(&name, &Device::Cpu) {
            let _ = tensor.dequantize(&Device::Cpu);
        }
    }
});
