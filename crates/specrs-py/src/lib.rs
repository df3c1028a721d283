//! `specrs._specrs`: the thin PyO3 layer over specrs-core. Long calls release the GIL; every
//! error goes through `errors::to_py`, and no panic crosses into Python.

mod batch;
mod engine;
mod errors;
mod facts;
mod proposer;
mod scheduler;
mod spec_config;
mod testing;

use pyo3::prelude::*;

#[pymodule]
fn _specrs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PySamplingParams>()?;
    m.add_class::<engine::PyStream>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<spec_config::PySpeculativeConfig>()?;
    m.add_class::<engine::PyTokenizer>()?;
    m.add_function(wrap_pyfunction!(engine::expected_speedup, m)?)?;
    m.add_function(wrap_pyfunction!(engine::requantize, m)?)?;
    m.add_function(wrap_pyfunction!(engine::read_bandwidth, m)?)?;
    m.add_function(wrap_pyfunction!(engine::check_decoder_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(engine::cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(engine::resolve_kv_layout, m)?)?;
    m.add_function(wrap_pyfunction!(facts::method_facts, m)?)?;
    m.add_function(wrap_pyfunction!(facts::shipped_heads, m)?)?;
    m.add("SCHEDULER_DEFAULTS", facts::scheduler_defaults(m.py())?)?;
    m.add("DEFAULT_KV_BLOCK_SIZE", specrs_core::kv_cache::KvLayout::DEFAULT_BLOCK_SIZE)?;
    m.add("DEFAULT_CUDA_GRAPH_MEMORY_MB", specrs_core::engine::DEFAULT_GRAPH_MEMORY >> 20)?;
    m.add_function(wrap_pyfunction!(batch::batch_accept, m)?)?;
    m.add_function(wrap_pyfunction!(batch::batch_ngram, m)?)?;
    m.add_function(wrap_pyfunction!(batch::batch_tree_accept, m)?)?;
    // Test-only (see testing.rs): a proposer that panics on purpose.
    m.add_class::<testing::PyTestingPanickingProposer>()?;
    m.add_function(wrap_pyfunction!(testing::testing_panicking_proposer, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The grammar limits by name (the server refuses JSON nested past MAX_JSON_NESTING itself).
    let limits = pyo3::types::PyDict::new(m.py());
    for (name, value) in specrs_core::constraint::limits::ALL {
        limits.set_item(name, value)?;
    }
    m.add("GRAMMAR_LIMITS", limits)?;
    Ok(())
}
