//! The one error type of specrs-core.
//!
//! Invariant: every variant's message says what the user should change. The Python layer maps each
//! variant to one exception class (`crates/specrs-py/src/errors.rs`), so adding a variant means
//! adding one line there.

/// All failures the engine reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The model file is missing, is not a GGUF file, is truncated, or describes a model specrs
    /// cannot run.
    #[error("{0}")]
    ModelLoad(String),
    /// A draft model's tokenizer differs from the target's (the message names the first
    /// differing token id and both strings).
    #[error("{0}")]
    TokenizerMismatch(String),
    /// A user-supplied setting (sampling parameter, device, config key) is invalid.
    #[error("{0}")]
    Config(String),
    /// The request does not fit in the model's context window.
    #[error("{0}")]
    ContextLength(String),
    /// A device was requested that this build or machine cannot provide.
    #[error("{0}")]
    Device(String),
    /// A proposer failed or returned an invalid draft (a custom proposer raised, or drafted ids
    /// outside the vocabulary, or probabilities of the wrong shape).
    #[error("{0}")]
    Proposer(String),
    /// A tensor operation failed inside candle: a bug in specrs, not a user error.
    #[error("internal tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// Anything else that should not happen (including a caught panic).
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn model_load(msg: impl Into<String>) -> Self {
        Error::ModelLoad(msg.into())
    }
    pub fn config(msg: impl Into<String>) -> Self {
        Error::Config(msg.into())
    }
}
