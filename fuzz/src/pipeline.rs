//! What a user does with a model file, run on fuzzed input: open, build the tokenizer and the
//! model, wrap them in an `Engine`, tokenize, render the chat template, tokenize a chat that spells
//! special tokens, and generate two tokens (greedy and sampled).
//!
//! Invariant: every failure must come back as an `Err`; a panic, an abort or an allocation past
//! libFuzzer's `-rss_limit_mb` / `-malloc_limit_mb` is the bug the loader targets look for.

use std::sync::Arc;

use candle_core::Device;
use specrs_core::chat_template::ChatMessage;
use specrs_core::gguf::GgufFile;
use specrs_core::model::{self, hf_dir, CausalLm};
use specrs_core::tokenizer::TextTokenizer;
use specrs_core::{Engine, SamplingParams};

/// GGUF bytes -> `GgufFile::from_bytes` -> tokenizer + `model::load` -> `exercise`.
pub fn run_gguf(bytes: Vec<u8>) {
    let Ok(mut gguf) = GgufFile::from_bytes("fuzz.gguf", bytes) else { return };
    let tokenizer = TextTokenizer::from_gguf(&gguf);
    let model = model::loader::load(&mut gguf, &Device::Cpu);
    if let (Ok(tokenizer), Ok(model)) = (tokenizer, model) {
        exercise(Arc::from(model), tokenizer);
    }
}

/// A Hugging Face directory -> `hf_dir::open` + `Decoder::from_hf` + `from_hf_dir` -> `exercise`.
pub fn run_hf_dir(dir: &std::path::Path) {
    let Ok((config, mut weights)) = hf_dir::open(dir, &Device::Cpu) else { return };
    let model = model::candle::decoder::Decoder::from_hf(&mut weights, config);
    let tokenizer = TextTokenizer::from_hf_dir(dir);
    if let (Ok(model), Ok(tokenizer)) = (model, tokenizer) {
        exercise(Arc::new(model), tokenizer);
    }
}

/// Everything a request does with a freshly loaded model; results are ignored, only panics count.
pub fn exercise(model: Arc<dyn CausalLm>, tokenizer: TextTokenizer) {
    let Ok(engine) = Engine::from_model(model, tokenizer, None) else { return };
    let tokenizer = engine.tokenizer().clone();
    let mut prompt = tokenizer.encode("Hello, world! 123", true).unwrap_or_default();
    if let Ok(text) = tokenizer.decode(&prompt, true) {
        let _ = tokenizer.encode(&text, false);
    }
    if tokenizer.chat_template().is_some() {
        let messages = [ChatMessage { role: "user".into(), content: "Hi".into() }];
        if let Ok(text) = engine.render_chat(&messages, None) {
            let _ = tokenizer.encode(&text, true);
        }
        // A message spelling the model's end-of-turn tokens: the escaped path and the allowed one.
        let spelled: String = tokenizer.eos_token_ids().iter().filter_map(|&id| tokenizer.token_text(id)).collect();
        let messages = [ChatMessage { role: "user".into(), content: format!("a{spelled}b") }];
        let _ = engine.chat_prompt_ids(&messages, None, false);
        let _ = engine.chat_prompt_ids(&messages, None, true);
    }
    prompt.truncate(8);
    if prompt.is_empty() {
        prompt.push(0);
    }
    let _ = engine.generate(prompt.clone(), SamplingParams::greedy(2), None);
    let sampled = SamplingParams { max_tokens: 2, temperature: 0.8, top_p: 0.9, seed: Some(0), ..Default::default() };
    let _ = engine.generate(prompt, sampled, None);
}
