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

/// Runs `f`, returning its panic's message as `Err` instead of unwinding further.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into())
    })
}

/// The error a caught panic becomes.
pub fn panic_error(message: &str) -> Error {
    Error::Internal(format!("{message} (please report this bug)"))
}

/// Runs `f`, with a panic turned into an internal error: a bug met by one request ends that
/// request (or call), not the process or the other requests batched with it.
pub fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_panic(f).unwrap_or_else(|message| Err(panic_error(&message)))
}

/// `message` without the Rust backtraces in it: with `RUST_BACKTRACE` set, candle appends the
/// backtrace of where its error was made ("   0: candle_core::...\n             at /src/...rs:1:2")
/// to the error's text, which then reaches a Python exception or an HTTP error body. Those frames
/// are for a debugger, not for whoever reads the message (and they show the build's file paths).
pub fn without_backtraces(message: &str) -> String {
    let mut kept: Vec<&str> = Vec::new();
    let mut in_backtrace = false;
    for line in message.split('\n') {
        let text = line.trim_start();
        let indented = text.len() < line.len();
        let frame = indented
            && text.split_once(':').is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if frame && (in_backtrace || text.starts_with("0:")) {
            in_backtrace = true;
            continue;
        }
        if in_backtrace && indented && text.starts_with("at ") {
            continue;
        }
        if matches!(text, "disabled backtrace" | "unsupported backtrace") {
            continue;
        }
        // A backtrace's text ends with a line break: the empty line after it is its own.
        let ends_backtrace = in_backtrace && line.is_empty();
        in_backtrace = false;
        if ends_backtrace {
            continue;
        }
        kept.push(line);
    }
    // The line break that introduced a backtrace at the end goes with it.
    kept.join("\n").trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backtraces_leave_the_message() {
        let backtrace = std::backtrace::Backtrace::force_capture().to_string();
        assert!(backtrace.lines().count() > 2, "{backtrace}");
        let inner = format!("shape mismatch in matmul\n{backtrace}");
        assert_eq!(without_backtraces(&inner), "shape mismatch in matmul");
        // Wrapped in another message that goes on after it.
        let wrapped = format!("cannot load head.safetensors: {inner}\nsee the head's config.json");
        assert_eq!(
            without_backtraces(&wrapped),
            "cannot load head.safetensors: shape mismatch in matmul\nsee the head's config.json"
        );
        // Text that merely looks a little like a frame stays.
        for text in ["0: first\n1: second", "a\n  note: 12 tokens", "line one\n  at the end"] {
            assert_eq!(without_backtraces(text), text);
        }
    }
}
