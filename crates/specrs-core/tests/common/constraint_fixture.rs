//! The SmolLM2 tokenizer and its constraint compiler, built once for the constraint tests
//! (constraint.rs, grammar_cache.rs, grammar_limits.rs).

use std::sync::OnceLock;

use specrs_core::constraint::ConstraintCompiler;
use specrs_core::gguf::GgufFile;
use specrs_core::tokenizer::TextTokenizer;

pub struct Fixture {
    pub tokenizer: TextTokenizer,
    pub compiler: ConstraintCompiler,
}

pub fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let gguf = GgufFile::open(super::smollm2_path()).expect("open SmolLM2");
        let tokenizer = TextTokenizer::from_gguf(&gguf).expect("SmolLM2 tokenizer");
        let started = std::time::Instant::now();
        let compiler = ConstraintCompiler::new(&tokenizer).expect("constraint compiler");
        println!("ConstraintCompiler::new on {} tokens: {:?}", tokenizer.vocab_size(), started.elapsed());
        Fixture { tokenizer, compiler }
    })
}
