//! Hugging Face directory loader: one of config.json, model.safetensors (whole, or its JSON
//! header in front of the golden data), tokenizer.json, tokenizer_config.json,
//! generation_config.json or model.safetensors.index.json of a golden family replaced by fuzzed
//! bytes (layout in `specrs_fuzz::hf_scratch`), then the loader pipeline.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use specrs_fuzz::hf_scratch::Scratch;

fuzz_target!(|data: &[u8]| {
    static SCRATCH: OnceLock<Scratch> = OnceLock::new();
    SCRATCH.get_or_init(Scratch::new).with_input(data, specrs_fuzz::pipeline::run_hf_dir);
});
