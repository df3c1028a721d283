//! Custom proposers written in Python: any object with `propose(context_ids, max_tokens)`
//! returning a list of token ids, or `(token_ids, draft_probs)` with `draft_probs` array-like
//! `[len(token_ids), vocab_size]`, or a token tree `(token_ids, draft_probs, parents)` (`draft_probs`
//! may be None; `parents[i]` is the index of token i's parent, -1 for the newest context token),
//! and optionally `observe(num_accepted)`. With `"tree"` set in the config, `max_tokens` is the
//! node budget, and a tree must stay within `tree_depth` levels and `tree_top_k` children per node.
//!
//! Invariant: the Python object only guesses. `Session` checks its draft's shape and values and
//! the verifier decides what is emitted, so a buggy proposer can slow a request or fail it with a
//! `ProposerError`, never change its output.

use numpy::PyReadonlyArray2;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use specrs_core::error::{Error, Result};
use specrs_core::proposer::{Draft, Feedback, Proposer, TreeLimits};

pub struct PyProposer {
    object: Py<PyAny>,
    has_observe: bool,
}

impl PyProposer {
    /// Wraps `object`; fails unless it has a callable `propose`.
    pub fn new(py: Python<'_>, object: Py<PyAny>) -> Result<Self> {
        let bound = object.bind(py);
        let callable = |name: &str| bound.getattr(name).map(|m| m.is_callable()).unwrap_or(false);
        if !callable("propose") {
            return Err(Error::config(format!(
                "a custom proposer needs a method propose(context_ids: list[int], max_tokens: int) -> list[int]; \
                 {} has none",
                bound.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "the object".into())
            )));
        }
        let has_observe = callable("observe");
        Ok(Self { object, has_observe })
    }
}

fn raised(method: &str, error: PyErr) -> Error {
    Error::Proposer(format!("the custom proposer's {method}() raised {error}"))
}

fn parse_draft(result: &Bound<'_, PyAny>) -> Result<Draft> {
    let shape_error = || {
        Error::Proposer(format!(
            "the custom proposer's propose() must return a list of token ids, a (token_ids, draft_probs) \
             tuple or a (token_ids, draft_probs or None, parents) tree; it returned {}",
            result.repr().map(|r| r.to_string()).unwrap_or_else(|_| "an unprintable object".into())
        ))
    };
    let parts = result.cast::<PyTuple>().ok().filter(|t| {
        (t.len() == 2 || t.len() == 3) && t.get_item(0).is_ok_and(|x| !x.is_instance_of::<pyo3::types::PyInt>())
    });
    let Some(parts) = parts else {
        let token_ids: Vec<u32> = result.extract().map_err(|_| shape_error())?;
        return Ok(Draft::tokens(token_ids));
    };
    let token_ids: Vec<u32> = parts.get_item(0).and_then(|x| x.extract()).map_err(|_| shape_error())?;
    let probs = parts.get_item(1).map_err(|_| shape_error())?;
    let probs = if probs.is_none() { None } else { Some(parse_probs(&probs)?) };
    let parents = match parts.get_item(2) {
        Ok(parents) => Some(parents.extract::<Vec<i32>>().map_err(|_| {
            Error::Proposer(
                "the custom proposer's parents must be a list of ints (-1 for the newest context token)".into(),
            )
        })?),
        Err(_) => None,
    };
    if probs.is_none() && parents.is_none() {
        return Err(shape_error());
    }
    Ok(Draft { token_ids, probs, parents })
}

/// `draft_probs` as a row-major `[len(token_ids), vocab_size]` float32 copy.
fn parse_probs(probs: &Bound<'_, PyAny>) -> Result<Vec<f32>> {
    let probs = probs
        .py()
        .import("numpy")
        .and_then(|np| np.call_method1("ascontiguousarray", (probs, "float32")))
        .map_err(|e| Error::Proposer(format!("the custom proposer's draft_probs are not array-like: {e}")))?;
    let probs: PyReadonlyArray2<f32> = probs.extract().map_err(|_| {
        Error::Proposer("the custom proposer's draft_probs must be 2-D: [len(token_ids), vocab_size]".into())
    })?;
    Ok(probs.as_slice().map_err(|e| Error::Internal(e.to_string()))?.to_vec())
}

impl Proposer for PyProposer {
    /// A tree mode's node budget is the Python `max_tokens`; `Session` checks the rest. The depth
    /// the engine plans for this step (from the tokens left and each level's measured cost) can be
    /// below the configured one and is not passed to Python, so deeper tokens are cut here, not
    /// refused.
    fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
        let mut draft = self.propose(context, limits.max_nodes)?;
        draft.cut_to_depth(max_depth);
        Ok(draft)
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        Python::attach(|py| {
            let result = self
                .object
                .call_method1(py, "propose", (context.to_vec(), max_tokens))
                .map_err(|e| raised("propose", e))?;
            parse_draft(result.bind(py))
        })
    }

    fn observe(&mut self, feedback: &Feedback<'_>) -> Result<()> {
        let num_accepted = feedback.num_accepted_tokens;
        if !self.has_observe {
            return Ok(());
        }
        Python::attach(|py| {
            self.object.call_method1(py, "observe", (num_accepted,)).map(|_| ()).map_err(|e| raised("observe", e))
        })
    }
}
