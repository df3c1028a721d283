//! Rust's tables as Python values: the speculative methods' facts (`spec_config::methods`), the
//! shipped heads (`spec_config::shipped`) and the scheduler's defaults (`SchedulerConfig`).
//!
//! Invariant: Python keeps no copy of these; `specrs.heads`, `specrs.serve` and `specrs.engine`
//! read them from here, in the shapes they had when Python held them.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use specrs_core::spec_config::{methods, shipped};
use specrs_core::SchedulerConfig;

/// `{name: {"aliases", "keys", "weight_keys", "default_k", "draft_probs",
/// "one_forward_per_draft", "needs_proposer_object"}}` for every speculative method, in the order messages list them
/// (`MethodSpec`'s fields).
#[pyfunction]
pub fn method_facts(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let facts = PyDict::new(py);
    for spec in &methods::ALL {
        let fact = PyDict::new(py);
        fact.set_item("aliases", spec.aliases.to_vec())?;
        fact.set_item("keys", spec.keys.to_vec())?;
        fact.set_item("weight_keys", spec.weight_keys.to_vec())?;
        fact.set_item("default_k", spec.default_k)?;
        fact.set_item("draft_probs", spec.draft_probs)?;
        fact.set_item("one_forward_per_draft", spec.one_forward_per_draft)?;
        fact.set_item("needs_proposer_object", spec.needs_proposer_object)?;
        facts.set_item(spec.name, fact)?;
    }
    Ok(facts)
}

/// The heads specrs ships: `{"targets": {name: {"match": {architecture, vocab_size, num_layers,
/// weight_bytes}, "heads": {method: directory relative to heads/}}}, "head_methods": {method:
/// {"num_speculative_tokens", and "quantization" where the head has one}}}`.
#[pyfunction]
pub fn shipped_heads(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let targets = PyDict::new(py);
    for target in &shipped::TARGETS {
        let matched = PyDict::new(py);
        matched.set_item("architecture", target.architecture)?;
        matched.set_item("vocab_size", target.vocab_size)?;
        matched.set_item("num_layers", target.num_layers)?;
        matched.set_item("weight_bytes", target.weight_bytes)?;
        let heads = PyDict::new(py);
        for (method, dir) in target.heads {
            heads.set_item(method, dir)?;
        }
        let entry = PyDict::new(py);
        entry.set_item("match", matched)?;
        entry.set_item("heads", heads)?;
        targets.set_item(target.name, entry)?;
    }
    let head_methods = PyDict::new(py);
    for defaults in &shipped::HEAD_DEFAULTS {
        let entry = PyDict::new(py);
        entry.set_item("num_speculative_tokens", defaults.num_speculative_tokens)?;
        if let Some(q) = defaults.quantization {
            entry.set_item("quantization", q)?;
        }
        head_methods.set_item(defaults.method, entry)?;
    }
    let table = PyDict::new(py);
    table.set_item("targets", targets)?;
    table.set_item("head_methods", head_methods)?;
    Ok(table)
}

/// `SchedulerConfig::default()` by field name, as `Scheduler(...)` takes them (`SCHEDULER_DEFAULTS`).
pub fn scheduler_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let defaults = SchedulerConfig::default();
    let dict = PyDict::new(py);
    dict.set_item("max_num_seqs", defaults.max_num_seqs)?;
    dict.set_item("max_num_batched_tokens", defaults.max_num_batched_tokens)?;
    dict.set_item("max_kv_tokens", defaults.max_kv_tokens)?;
    dict.set_item("prefill_chunk", defaults.prefill_chunk)?;
    dict.set_item("draft_budget", defaults.draft_budget.name())?;
    dict.set_item("cost_curve_s", defaults.cost_curve_s)?;
    dict.set_item("draft_chains_together", defaults.draft_chains_together)?;
    Ok(dict)
}
