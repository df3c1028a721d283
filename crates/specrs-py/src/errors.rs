//! The one mapping from specrs-core errors (and caught panics) to Python exceptions.
//!
//! The exception classes live in `specrs/errors.py` (so they can inherit from both `SpecrsError`
//! and builtins such as `ValueError`); this file only picks the class for each error kind.
//! Invariant: every PyO3 entry point runs its Rust work through `guard` (or `run_detached`), so a
//! Rust panic surfaces as a `SpecrsError`, never as PyO3's `PanicException`; and a message never
//! carries a Rust backtrace (`error::without_backtraces`).

use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use specrs_core::error::without_backtraces;
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
        let message = without_backtraces(&error.to_string());
        match py.import("specrs.errors").and_then(|m| m.getattr(class_name(&error))) {
            Ok(class) => match class.call1((message,)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            Err(_) => PyRuntimeError::new_err(message),
        }
    })
}

pub use specrs_core::error::{catch_panic, guard, panic_error};

/// `guard` with the GIL released, mapped to a Python exception.
pub fn run_detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> specrs_core::Result<T> + Send) -> PyResult<T> {
    py.detach(|| guard(f)).map_err(to_py)
}

/// Locks `mutex` even when an earlier panic poisoned it. Callers keep their state consistent
/// across panics themselves (a `Stream` catches a step's panic inside its lock and marks itself
/// failed), so the poison flag carries no information they lack.
pub fn lock_recovering<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
