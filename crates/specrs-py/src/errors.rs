//! The one mapping from specrs-core errors (and caught panics) to Python exceptions.
//!
//! The exception classes live in `specrs/errors.py` (so they can inherit from both `SpecrsError`
//! and builtins such as `ValueError`); this file only picks the class for each error kind.
//! Invariant: every PyO3 entry point runs its Rust work through `guard` (or `run_detached`), so a
//! Rust panic surfaces as a `SpecrsError`, never as PyO3's `PanicException`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard, PoisonError};

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

/// Runs `f`; a panic comes back as `Err` with the panic's message.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
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

/// Runs `f`, turning a Rust panic into a `SpecrsError` instead of letting it cross the FFI.
pub fn guard<T>(f: impl FnOnce() -> specrs_core::Result<T>) -> specrs_core::Result<T> {
    catch_panic(f).unwrap_or_else(|message| Err(panic_error(&message)))
}

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
