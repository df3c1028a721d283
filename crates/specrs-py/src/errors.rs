//! The one mapping from specrs-core errors (and caught panics) to Python exceptions.
//!
//! The exception classes live in `specrs/errors.py` (so they can inherit from both `SpecrsError`
//! and builtins such as `ValueError`); this file only picks the class for each error kind.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use specrs_core::Error;

fn class_name(error: &Error) -> &'static str {
    match error {
        Error::ModelLoad(_) => "ModelLoadError",
        Error::TokenizerMismatch(_) => "TokenizerMismatchError",
        Error::Config(_) => "ConfigError",
        Error::ContextLength(_) => "ContextLengthError",
        Error::Device(_) => "DeviceError",
        Error::Proposer(_) => "ProposerError",
        Error::Candle(_) | Error::Internal(_) => "SpecrsError",
    }
}

pub fn to_py(error: Error) -> PyErr {
    Python::attach(|py| {
        let message = error.to_string();
        match py.import("specrs.errors").and_then(|m| m.getattr(class_name(&error))) {
            Ok(class) => match class.call1((message,)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            Err(_) => PyRuntimeError::new_err(message),
        }
    })
}

/// Runs `f`, turning a Rust panic into a `SpecrsError` instead of letting it cross the FFI.
pub fn guard<T>(f: impl FnOnce() -> specrs_core::Result<T>) -> specrs_core::Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::Internal(format!("{what} (please report this bug)")))
        }
    }
}

/// `guard` with the GIL released, mapped to a Python exception.
pub fn run_detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> specrs_core::Result<T> + Send) -> PyResult<T> {
    py.detach(|| guard(f)).map_err(to_py)
}
