//! GGUF loader on structure-aware inputs: one of the six golden models with a few metadata and
//! tensor edits chosen by the fuzzer's bytes (`specrs_fuzz::gguf_edit`), then the loader pipeline.
#![no_main]

use std::sync::OnceLock;

use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;
use specrs_fuzz::gguf_edit::Model;

fn golden_models() -> &'static [Model] {
    static MODELS: OnceLock<Vec<Model>> = OnceLock::new();
    MODELS.get_or_init(|| {
        let dir = specrs_fuzz::golden_dir().join("gguf");
        ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
            .iter()
            .map(|family| Model::parse(&std::fs::read(dir.join(format!("{family}-q8_0.gguf"))).expect("golden GGUF")))
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let models = golden_models();
    let Ok(index) = u.choose_index(models.len()) else { return };
    let mut model = models[index].clone();
    // Inputs that run out of bytes mid-edit keep the edits made so far.
    let _ = model.edit(&mut u);
    specrs_fuzz::pipeline::run_gguf(model.write());
});
