//! Test-only: a proposer that panics on purpose, so the tests can check that a Rust panic inside
//! one request's step ends that request alone (`tests/test_serve_abuse.py`); or that fails the way
//! a candle error does under `RUST_BACKTRACE`, its message followed by a backtrace, so the tests can
//! check that no backtrace reaches an exception or an error body (`tests/test_serve_hardening.py`).
//! It is not part of the
//! public API: it is reachable only as `specrs._specrs._testing_panicking_proposer(...)`, passed
//! as the `proposer=` of a "custom" config, and nothing else in specrs creates or looks for it.
//!
//! Invariant: each request gets its own call counter, so which call panics never depends on what
//! other requests did; until it panics it drafts the context's last token repeated (the verifier
//! decides the output, so the drafts change nothing but speed).

use std::sync::atomic::{AtomicUsize, Ordering};

use pyo3::prelude::*;
use specrs_core::error::Result;
use specrs_core::proposer::{Draft, Feedback, Proposer};

use crate::errors::to_py;

/// Which proposer hook panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hook {
    /// `propose`, inside a decoding step.
    Propose,
    /// `observe`, inside a decoding step, after the target verified the draft.
    Observe,
    /// `finish`, when the request ends (its last step, or `cancel`).
    Finish,
    /// `kv_len`, read by `Stream.kv_lens()`.
    KvLen,
    /// `propose` returns an error carrying a backtrace (when `RUST_BACKTRACE` enables one) instead
    /// of panicking.
    ProposeError,
}

impl Hook {
    const NAMES: [(&'static str, Hook); 5] = [
        ("propose", Hook::Propose),
        ("observe", Hook::Observe),
        ("finish", Hook::Finish),
        ("kv_len", Hook::KvLen),
        ("propose_error", Hook::ProposeError),
    ];
}

/// The Python handle: `_testing_panicking_proposer(after_calls, hook="propose")`.
#[pyclass(name = "_TestingPanickingProposer", module = "specrs._specrs", frozen)]
pub struct PyTestingPanickingProposer {
    after_calls: usize,
    hook: Hook,
}

impl PyTestingPanickingProposer {
    /// A fresh Rust proposer for one request.
    pub fn proposer(&self) -> PanickingProposer {
        PanickingProposer { after_calls: self.after_calls, hook: self.hook, calls: AtomicUsize::new(0) }
    }
}

#[pymethods]
impl PyTestingPanickingProposer {
    fn __repr__(&self) -> String {
        format!("_TestingPanickingProposer(after_calls={}, hook={:?})", self.after_calls, self.hook)
    }
}

/// TEST ONLY. A custom proposer whose `hook` ("propose", "observe", "finish" or "kv_len") panics
/// in Rust on call number `after_calls + 1` of that hook within a request ("propose_error": the
/// propose call fails with an error whose message ends in a backtrace, as candle's do).
#[pyfunction]
#[pyo3(name = "_testing_panicking_proposer", signature = (after_calls, hook="propose"))]
pub fn testing_panicking_proposer(after_calls: usize, hook: &str) -> PyResult<PyTestingPanickingProposer> {
    let Some(&(_, hook)) = Hook::NAMES.iter().find(|(name, _)| *name == hook) else {
        let names: Vec<&str> = Hook::NAMES.iter().map(|(name, _)| *name).collect();
        return Err(to_py(specrs_core::Error::config(format!(
            "unknown hook '{hook}'; pick one of {}",
            names.join(", ")
        ))));
    };
    Ok(PyTestingPanickingProposer { after_calls, hook })
}

pub struct PanickingProposer {
    after_calls: usize,
    hook: Hook,
    /// Calls of `hook` so far (atomic because `kv_len` takes `&self`).
    calls: AtomicUsize,
}

impl PanickingProposer {
    fn called(&self, hook: Hook) {
        if hook == self.hook && self.calls.fetch_add(1, Ordering::Relaxed) >= self.after_calls {
            panic!("testing panic: the test-only proposer's {hook:?} hook panics after {} calls", self.after_calls);
        }
    }
}

impl Proposer for PanickingProposer {
    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        self.called(Hook::Propose);
        if self.hook == Hook::ProposeError && self.calls.fetch_add(1, Ordering::Relaxed) >= self.after_calls {
            // candle's `Error::bt`: the message, then the backtrace captured as RUST_BACKTRACE allows.
            let backtrace = std::backtrace::Backtrace::capture();
            return Err(specrs_core::Error::Internal(format!("testing tensor error\n{backtrace}")));
        }
        Ok(Draft::tokens(vec![context.last().copied().unwrap_or(0); max_tokens]))
    }

    fn observe(&mut self, _feedback: &Feedback<'_>) -> Result<()> {
        self.called(Hook::Observe);
        Ok(())
    }

    fn finish(&mut self, _generated: &[u32]) {
        self.called(Hook::Finish);
    }

    fn kv_len(&self) -> Option<usize> {
        self.called(Hook::KvLen);
        None
    }
}
