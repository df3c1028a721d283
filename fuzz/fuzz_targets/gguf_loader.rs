//! GGUF loader on raw bytes (seeded with `tests/golden/gguf/*.gguf`): open, tokenizer,
//! `model::load`, then a short generation (`specrs_fuzz::pipeline`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    specrs_fuzz::pipeline::run_gguf(data.to_vec());
});
