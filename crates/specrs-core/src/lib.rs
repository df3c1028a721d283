//! specrs-core: a speculative-decoding inference engine on candle, with no Python in it.
//!
//! Module map: `gguf` (file access) -> `model` (CausalLm families) + `kv_cache` (O(1) rollback) ->
//! `tokenizer` / `chat_template` / `detokenizer` (text) -> `sampler` -> `engine` (requests) and
//! `metrics`. The Python bindings live in `specrs-py`.

pub mod chat_template;
pub mod config;
pub mod detokenizer;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod kv_cache;
pub mod metrics;
pub mod model;
pub mod sampler;
pub mod tokenizer;

pub use config::SamplingParams;
pub use engine::{Engine, FinishReason, Generation, Session, StepOutput};
pub use error::{Error, Result};
