//! Python class `SpeculativeConfig`: a speculative config parsed once (`specrs_core::SpeculativeConfig`),
//! which Python hands to every binding call that takes a config (a request's start, `prepare`,
//! the scheduler's `add`), and asks what it needs to know about it (method, length, weights,
//! suffix cache) instead of re-parsing JSON text for each question.
//!
//! Invariant: an object holds a valid config with every default filled in, and never changes
//! (frozen), so one object may serve any number of requests and threads. A call given JSON text
//! instead (`config_arg`) parses it with the same parser, so both forms raise the same ConfigError.

use std::sync::Arc;

use pyo3::prelude::*;
use specrs_core::SpeculativeConfig;

use crate::errors::{guard, to_py};

#[pyclass(name = "SpeculativeConfig", module = "specrs._specrs", frozen)]
pub struct PySpeculativeConfig {
    pub(crate) inner: Arc<SpeculativeConfig>,
}

#[pymethods]
impl PySpeculativeConfig {
    /// Parses the JSON text of a vLLM-style speculative config (raises ConfigError when invalid).
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        parse(text).map(|inner| Self { inner })
    }

    /// The method's canonical name (an alias such as "eagle" is resolved).
    #[getter]
    fn method(&self) -> &'static str {
        self.inner.method_name()
    }

    /// The most tokens a draft may hold (a tree's node budget).
    #[getter]
    fn num_speculative_tokens(&self) -> usize {
        self.inner.num_speculative_tokens
    }

    /// Whether each draft's length is chosen by expected tokens per unit of cost.
    #[getter]
    fn adaptive_draft_length(&self) -> bool {
        self.inner.adaptive_draft_length
    }

    /// How sampled drafts of model-based methods are drawn and verified: "auto" (coupled when the
    /// request sets a seed), "coupled" (the output is plain sampling's, token for token) or
    /// "rejection".
    #[getter]
    fn verification(&self) -> &'static str {
        self.inner.verification.name()
    }

    /// Whether requests with this config draft from an engine-wide suffix cache ("suffix", and
    /// "auto"'s suffix lookup: `SpeculativeConfig::suffix_params`), whose responses Ray replicas share.
    #[getter]
    fn keeps_suffix_cache(&self) -> bool {
        self.inner.suffix_params().is_some()
    }

    /// The weights this config loads besides the target's, as `{"method", and each key naming
    /// them}` (`SpeculativeConfig::weights`), or None for a method that loads none.
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(weights) = self.inner.weights() else {
            return Ok(None);
        };
        let text = serde_json::Value::Object(weights).to_string();
        py.import("json")?.call_method1("loads", (text,)).map(Some)
    }

    /// The config as vLLM-style JSON, every default spelled out, keys sorted.
    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    fn __repr__(&self) -> String {
        format!("SpeculativeConfig.from_json({:?})", self.inner.to_json())
    }
}

fn parse(text: &str) -> PyResult<Arc<SpeculativeConfig>> {
    guard(|| SpeculativeConfig::from_json(text)).map(Arc::new).map_err(to_py)
}

/// A config argument of a binding call: a `SpeculativeConfig` object (taken as it is: parsed
/// already) or JSON text (parsed here); anything else is a ConfigError.
pub(crate) fn config_arg(value: &Bound<'_, PyAny>) -> PyResult<Arc<SpeculativeConfig>> {
    if let Ok(config) = value.cast::<PySpeculativeConfig>() {
        return Ok(config.get().inner.clone());
    }
    match value.extract::<&str>() {
        Ok(text) => parse(text),
        Err(_) => Err(to_py(specrs_core::Error::config(format!(
            "a speculative config must be a SpeculativeConfig or its JSON text (got {})",
            value.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
        )))),
    }
}
