//! specrs-core: a speculative-decoding inference engine on candle, with no Python in it.
//!
//! Module map: `gguf` (file access) -> `model` (CausalLm families) + `kv_cache` (O(1) rollback) ->
//! `tokenizer` / `chat_template` / `special_text` / `detokenizer` (text) -> `sampler` -> `proposer` (guesses) +
//! `verify` (lossless acceptance) + `draft_length` -> `engine` (requests, configured by
//! `spec_config`) and `metrics`; `constraint` holds outputs to a grammar (JSON schema, regex,
//! Lark; llguidance); `quantize` writes requantized GGUF copies (the `quantized_self` draft);
//! `bandwidth` measures the memory roof decode steps are held against; `batch` holds the batched
//! kernels (CPU references, and CUDA with the `cuda` feature); `nvrtc` compiles our CUDA sources.
//! The Python bindings live in `specrs-py`.

pub mod bandwidth;
pub mod batch;
pub mod chat_template;
pub mod config;
pub mod constraint;
pub mod costs;
pub mod detokenizer;
pub mod draft_budget;
pub mod draft_length;
pub mod engine;
pub mod error;
pub mod gguf;
pub mod kv_cache;
pub mod metrics;
pub mod model;
#[cfg(feature = "cuda")]
pub mod nvrtc;
pub mod proposer;
pub mod quantize;
pub mod sampler;
pub mod spec_config;
mod special_text;
pub mod tokenizer;
pub mod tree;
pub mod verify;

pub use config::SamplingParams;
pub use engine::scheduler::{DraftBudget, RequestOutput, Scheduler, SchedulerConfig, SchedulerTotals, StepReport};
pub use engine::step_together::step_together;
pub use engine::{Engine, FinishReason, Generation, Session, Speculation, StepOutput};
pub use error::{Error, Result};
pub use spec_config::SpeculativeConfig;
