//! Every integration test of specrs-core, in one test binary: each file beside this one is a
//! module. One binary links the crate (thin LTO in release) once, where one binary per file linked
//! it 18 times (22-73 s each here). Run one file's tests with
//! `cargo test --release -p specrs-core --test integration <file>::`.

mod common;

mod constraint;
mod continuous_batching;
mod cross_tokenizer;
mod forward_batch;
mod forward_pins;
mod gguf_families_decoder;
mod grammar_cache;
mod grammar_limits;
mod heads_golden;
mod heads_plumbing;
mod kv_layouts;
mod real_model;
mod scheduler;
mod seeded_pins;
mod stop_strings;
mod tree_drafts;
mod tree_speculation;
mod verify_pins;
