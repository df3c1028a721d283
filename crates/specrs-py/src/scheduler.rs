//! Python class `Scheduler`: the core's continuous-batching scheduler (`engine/scheduler.rs`)
//! behind a lock, so a server thread can step it while others add and abort requests.
//!
//! Invariant: every method takes the lock with the GIL released (a step holds the lock while it
//! runs, and a Python proposer needs the GIL during it), and no Rust panic reaches Python: a step
//! that fails in one request returns that request's end with its error (an exception object), and
//! the scheduler goes on.

use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyDict;
use specrs_core::{DraftBudget, Engine, RequestOutput, Scheduler, SchedulerConfig, SchedulerTotals, StepReport};

use crate::engine::{generation_dict, logprobs_list, token_ids_arg, PyEngine, PySamplingParams};
use crate::errors::{guard, lock_recovering, run_detached, to_py};
use crate::spec_config::config_arg;

#[pyclass(name = "Scheduler", module = "specrs._specrs", frozen)]
pub struct PyScheduler {
    engine: Py<PyEngine>,
    inner: Mutex<Scheduler>,
}

#[pymethods]
impl PyScheduler {
    /// A scheduler over `engine`'s model. `cost_curve_s` `[T(1), ..., T(n)]` pins the draft
    /// budget's batch cost curve (seconds per forward of 1..n rows); None measures it now (up to
    /// 32 rows, or reads the disk cache) unless the engine was told not to measure on demand.
    /// `draft_chains_together=False` drafts each request's draft-model chain alone (a baseline).
    #[new]
    #[pyo3(
        signature = (engine, max_num_seqs=SchedulerConfig::default().max_num_seqs, max_num_batched_tokens=SchedulerConfig::default().max_num_batched_tokens, max_kv_tokens=SchedulerConfig::default().max_kv_tokens, prefill_chunk=SchedulerConfig::default().prefill_chunk, draft_budget=SchedulerConfig::default().draft_budget.name(), cost_curve_s=None, draft_chains_together=SchedulerConfig::default().draft_chains_together),
        // The defaults above are `SchedulerConfig::default()`'s; this text repeats them for
        // Python's `inspect` (tests/test_one_owner.py checks that it says the same).
        text_signature = "(engine, max_num_seqs=16, max_num_batched_tokens=2048, max_kv_tokens=None, prefill_chunk=256, draft_budget='load', cost_curve_s=None, draft_chains_together=True)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        engine: Py<PyEngine>,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_kv_tokens: Option<usize>,
        prefill_chunk: Option<usize>,
        draft_budget: &str,
        cost_curve_s: Option<Vec<f64>>,
        draft_chains_together: bool,
    ) -> PyResult<Self> {
        let draft_budget = guard(|| DraftBudget::parse(draft_budget)).map_err(to_py)?;
        let config = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            max_kv_tokens,
            prefill_chunk,
            draft_budget,
            cost_curve_s,
            draft_chains_together,
        };
        let core: Arc<Engine> = engine.get().inner.clone();
        let scheduler = run_detached(py, move || Scheduler::new(core, config))?;
        Ok(Self { engine, inner: Mutex::new(scheduler) })
    }

    /// Queues a request under `request_id` (unique among unfinished ones); `speculative_config` is
    /// a `SpeculativeConfig` or its JSON text (None = no speculation). Raises (ConfigError,
    /// ContextLengthError, ...) for anything that can be checked before it runs.
    #[pyo3(signature = (request_id, prompt_ids, params, speculative_config=None, proposer=None))]
    fn add(
        &self,
        py: Python<'_>,
        request_id: u64,
        prompt_ids: &Bound<'_, PyAny>,
        params: &PySamplingParams,
        speculative_config: Option<&Bound<'_, PyAny>>,
        proposer: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let prompt_ids = token_ids_arg(prompt_ids, "prompt token id")?;
        let config = speculative_config.map(config_arg).transpose()?;
        let speculation = self.engine.get().speculation(py, config, proposer)?;
        let params = params.inner.clone();
        self.locked(py, move |s| s.add(request_id, prompt_ids, params, speculation))
    }

    /// Queues `params.n` samples of one prompt under `request_ids` (one each), sharing its
    /// prefill; sample i is seeded with seed + i when `params.seed` is set. Each sample gets its
    /// own proposer state from `speculative_config` (and `proposer`, shared as with `add`).
    #[pyo3(signature = (request_ids, prompt_ids, params, speculative_config=None, proposer=None))]
    fn add_samples(
        &self,
        py: Python<'_>,
        request_ids: Vec<u64>,
        prompt_ids: &Bound<'_, PyAny>,
        params: &PySamplingParams,
        speculative_config: Option<&Bound<'_, PyAny>>,
        proposer: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let prompt_ids = token_ids_arg(prompt_ids, "prompt token id")?;
        let engine = self.engine.get();
        let config = speculative_config.map(config_arg).transpose()?;
        let speculations = request_ids
            .iter()
            .map(|_| engine.speculation(py, config.clone(), proposer.as_ref().map(|p| p.clone_ref(py))))
            .collect::<PyResult<Vec<_>>>()?;
        let params = params.inner.clone();
        self.locked(py, move |s| s.add_samples(&request_ids, prompt_ids, params, speculations))
    }

    /// Stops a request: the next step returns its end (finish_reason "abort"). False if no
    /// unfinished request has that id.
    fn abort(&self, py: Python<'_>, request_id: u64) -> PyResult<bool> {
        self.locked(py, move |s| Ok(s.abort(request_id)))
    }

    /// One step of every running request in one forward, with the GIL released:
    /// `(outputs, report)`. Each output is a dict: `request_id`, `text`, `token_ids` (new this
    /// step), `finished` (the request's result dict once it ended, else None) and `error` (the
    /// exception that ended it, else None).
    fn step<'py>(&self, py: Python<'py>) -> PyResult<(Vec<Bound<'py, PyDict>>, Bound<'py, PyDict>)> {
        let (outputs, report) = self.locked(py, |s| s.step())?;
        let outputs = outputs.into_iter().map(|o| output_dict(py, o)).collect::<PyResult<Vec<_>>>()?;
        Ok((outputs, report_dict(py, &report)?))
    }

    /// `step`'s first half, with the GIL released: schedules, drafts and plans, then launches the
    /// step's forward without waiting for it (on CUDA the device runs it while this returns).
    /// `add` and `abort` may come before `finish` (a running request's abort ends it after the
    /// step). True if the step has a forward. A second `launch` before `finish` raises.
    fn launch(&self, py: Python<'_>) -> PyResult<bool> {
        self.locked(py, |s| s.launch())
    }

    /// `step`'s second half, with the GIL released: waits for the launched step, commits it, and
    /// returns `(outputs, report)` as `step` does.
    fn finish<'py>(&self, py: Python<'py>) -> PyResult<(Vec<Bound<'py, PyDict>>, Bound<'py, PyDict>)> {
        let (outputs, report) = self.locked(py, |s| s.finish())?;
        let outputs = outputs.into_iter().map(|o| output_dict(py, o)).collect::<PyResult<Vec<_>>>()?;
        Ok((outputs, report_dict(py, &report)?))
    }

    /// Whether a launched step runs on while the host goes on (the target runs on CUDA): the
    /// server then handles the step before's outputs between `launch` and `finish`. On the CPU
    /// the forward runs inside `launch`, so waiting to handle them would only delay them.
    #[getter]
    fn launches_asynchronously(&self) -> bool {
        self.engine.get().inner.model().device().is_cuda()
    }

    /// Sums of every step since the scheduler was made (draft tokens wanted, granted, verified and
    /// accepted; rows; preemptions; forward seconds).
    fn totals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let totals = self.locked(py, |s| Ok(s.totals()))?;
        totals_dict(py, &totals)
    }

    /// The draft budget's cost curve `[T(1), ..., T(n)]` seconds, and where it came from.
    fn cost_curve(&self, py: Python<'_>) -> PyResult<(Vec<f64>, String)> {
        let (curve, source) = self.locked(py, |s| Ok(s.cost_curve()))?;
        Ok((curve, source.as_str().to_string()))
    }

    #[getter]
    fn num_running(&self, py: Python<'_>) -> PyResult<usize> {
        self.locked(py, |s| Ok(s.num_running()))
    }

    #[getter]
    fn num_waiting(&self, py: Python<'_>) -> PyResult<usize> {
        self.locked(py, |s| Ok(s.num_waiting()))
    }

    #[getter]
    fn has_unfinished(&self, py: Python<'_>) -> PyResult<bool> {
        self.locked(py, |s| Ok(s.has_unfinished()))
    }
}

impl PyScheduler {
    /// Runs `f` on the scheduler with the GIL released, then the lock taken (see the header).
    fn locked<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Scheduler) -> specrs_core::Result<T> + Send,
    ) -> PyResult<T> {
        let inner = &self.inner;
        run_detached(py, move || f(&mut lock_recovering(inner)))
    }
}

fn output_dict(py: Python<'_>, output: RequestOutput) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("request_id", output.id)?;
    d.set_item("text", &output.text)?;
    d.set_item("token_ids", &output.token_ids)?;
    d.set_item("logprobs", logprobs_list(py, &output.logprobs)?)?;
    match &output.finished {
        Some(generation) => {
            let finished = generation_dict(py, generation)?;
            if output.error.is_some() {
                finished.set_item("finish_reason", "error")?;
            }
            d.set_item("finished", finished)?
        }
        None => d.set_item("finished", py.None())?,
    }
    match output.error {
        Some(error) => d.set_item("error", to_py(error).into_value(py))?,
        None => d.set_item("error", py.None())?,
    }
    Ok(d)
}

fn report_dict<'py>(py: Python<'py>, r: &StepReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_sequences", r.num_sequences)?;
    d.set_item("num_rows", r.num_rows)?;
    d.set_item("num_context_rows", r.num_context_rows)?;
    d.set_item("num_draft_tokens_wanted", r.num_draft_tokens_wanted)?;
    d.set_item("num_draft_tokens_granted", r.num_draft_tokens_granted)?;
    d.set_item("num_draft_tokens", r.num_draft_tokens)?;
    d.set_item("num_chains_drafted_together", r.num_chains_drafted_together)?;
    d.set_item("num_shared_draft_forwards", r.num_shared_draft_forwards)?;
    d.set_item("num_verifier_calls", r.num_verifier_calls)?;
    d.set_item("num_accepted_tokens", r.num_accepted_tokens)?;
    d.set_item("num_admitted", r.num_admitted)?;
    d.set_item("num_shared_prompt_tokens", r.num_shared_prompt_tokens)?;
    d.set_item("num_preempted", r.num_preempted)?;
    d.set_item("num_waiting", r.num_waiting)?;
    d.set_item("num_running", r.num_running)?;
    d.set_item("launch_s", r.launch_s)?;
    d.set_item("overlapped_host_s", r.overlapped_host_s)?;
    d.set_item("finish_s", r.finish_s)?;
    d.set_item("wait_s", r.wait_s)?;
    d.set_item("forward_s", r.forward_s)?;
    Ok(d)
}

fn totals_dict<'py>(py: Python<'py>, t: &SchedulerTotals) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_steps", t.num_steps)?;
    d.set_item("num_rows", t.num_rows)?;
    d.set_item("num_draft_tokens_wanted", t.num_draft_tokens_wanted)?;
    d.set_item("num_draft_tokens_granted", t.num_draft_tokens_granted)?;
    d.set_item("num_draft_tokens", t.num_draft_tokens)?;
    d.set_item("num_chains_drafted_together", t.num_chains_drafted_together)?;
    d.set_item("num_shared_draft_forwards", t.num_shared_draft_forwards)?;
    d.set_item("num_accepted_tokens", t.num_accepted_tokens)?;
    d.set_item("num_preemptions", t.num_preemptions)?;
    d.set_item("num_shared_prompt_tokens", t.num_shared_prompt_tokens)?;
    d.set_item("forward_s", t.forward_s)?;
    Ok(d)
}
