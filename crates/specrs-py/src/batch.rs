//! Python access to the batched kernels (`specrs_core::batch`): the CPU references, and with a
//! CUDA build the device kernels, so the device check can compare the two on the same inputs.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray2, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::prelude::*;
use specrs_core::batch::accept::{accept, AcceptInput};
use specrs_core::batch::ngram::{ngram_lookup, NgramInput};
use specrs_core::batch::tree_accept::{tree_accept, TreeAcceptInput};
use specrs_core::Error;

use crate::errors::{run_detached, to_py};

/// "cpu" or "cuda[:N]"; None for the CPU.
fn cuda_ordinal(device: &str) -> PyResult<Option<usize>> {
    match device {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        d => d
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Some)
            .ok_or_else(|| to_py(Error::config(format!("unknown device '{d}'; use 'cpu' or 'cuda[:N]'")))),
    }
}

/// Batched acceptance: `(num_accepted_tokens, next_token_ids)`, one per sequence.
/// `target_logits` `[batch, k + 1, vocab]` f32, `draft_token_ids` `[batch, k]` u32,
/// `num_draft_tokens` `[batch]`, `temperatures` `[batch]` (0 = greedy), `uniforms` `[batch, k + 1]`,
/// `draft_probs` `[batch, k, vocab]` or None.
#[pyfunction]
#[pyo3(signature = (target_logits, draft_token_ids, num_draft_tokens, temperatures, uniforms, draft_probs=None, device="cpu"))]
#[allow(clippy::too_many_arguments)]
pub fn batch_accept(
    py: Python<'_>,
    target_logits: PyReadonlyArray3<f32>,
    draft_token_ids: PyReadonlyArray2<u32>,
    num_draft_tokens: Vec<u32>,
    temperatures: Vec<f32>,
    uniforms: PyReadonlyArray2<f32>,
    draft_probs: Option<PyReadonlyArray3<f32>>,
    device: &str,
) -> PyResult<(Vec<u32>, Vec<u32>)> {
    let shape = target_logits.shape();
    let (batch, k, vocab) = (shape[0], shape[1].saturating_sub(1), shape[2]);
    let logits = target_logits.as_slice()?.to_vec();
    let drafts = draft_token_ids.as_slice()?.to_vec();
    let uniforms = uniforms.as_slice()?.to_vec();
    let probs = draft_probs.map(|p| p.as_slice().map(<[f32]>::to_vec)).transpose()?;
    let ordinal = cuda_ordinal(device)?;
    run_detached(py, move || {
        let input = AcceptInput {
            batch,
            max_draft_tokens: k,
            vocab_size: vocab,
            target_logits: &logits,
            draft_token_ids: &drafts,
            num_draft_tokens: &num_draft_tokens,
            draft_probs: probs.as_deref(),
            temperatures: &temperatures,
            uniforms: &uniforms,
        };
        check_accept(&input)?;
        let out = match ordinal {
            None => accept(&input)?,
            Some(ordinal) => on_cuda_accept(ordinal, &input)?,
        };
        Ok((out.num_accepted_tokens, out.next_token_ids))
    })
}

/// `(num_accepted_tokens [batch], accepted_nodes [batch, n], next_token_ids [batch])` as numpy
/// arrays.
type TreeAcceptArrays<'py> = (Bound<'py, PyArray1<u32>>, Bound<'py, PyArray2<u32>>, Bound<'py, PyArray1<u32>>);

/// Batched tree acceptance of deterministic token trees: per sequence, the number of accepted
/// nodes, the accepted path (node indices, padded with 2**32 - 1) and the next token.
/// `target_logits` `[batch, n + 1, vocab]` f32 (row 0: the root, row i + 1: node i),
/// `draft_token_ids` `[batch, n]` u32, `parents` `[batch, n]` i32 (-1 = the root, parents before
/// children), `num_nodes` `[batch]`, `temperatures` `[batch]` (0 = greedy), `uniforms`
/// `[batch, n + 1]` (uniform d decides depth d). `device` None or "cpu": the CPU reference;
/// "cuda[:N]": the kernel.
#[pyfunction]
#[pyo3(signature = (target_logits, draft_token_ids, parents, num_nodes, temperatures, uniforms, device=None))]
#[allow(clippy::too_many_arguments)]
pub fn batch_tree_accept<'py>(
    py: Python<'py>,
    target_logits: PyReadonlyArray3<f32>,
    draft_token_ids: PyReadonlyArray2<u32>,
    parents: PyReadonlyArray2<i32>,
    num_nodes: Vec<u32>,
    temperatures: Vec<f32>,
    uniforms: PyReadonlyArray2<f32>,
    device: Option<&str>,
) -> PyResult<TreeAcceptArrays<'py>> {
    let shape = target_logits.shape();
    let (batch, n, vocab) = (shape[0], shape[1].saturating_sub(1), shape[2]);
    let logits = target_logits.as_slice()?.to_vec();
    let drafts = draft_token_ids.as_slice()?.to_vec();
    let parents = parents.as_slice()?.to_vec();
    let uniforms = uniforms.as_slice()?.to_vec();
    let ordinal = cuda_ordinal(device.unwrap_or("cpu"))?;
    let out = run_detached(py, move || {
        let input = TreeAcceptInput {
            batch,
            max_nodes: n,
            vocab_size: vocab,
            target_logits: &logits,
            draft_token_ids: &drafts,
            parents: &parents,
            num_nodes: &num_nodes,
            temperatures: &temperatures,
            uniforms: &uniforms,
        };
        input.check().map_err(caller_error)?;
        check_draws(input.temperatures, input.uniforms)?;
        match ordinal {
            None => tree_accept(&input),
            Some(ordinal) => on_cuda_tree_accept(ordinal, &input),
        }
    })?;
    let paths = Array2::from_shape_vec((batch, n), out.accepted_nodes)
        .map_err(|e| to_py(Error::Internal(format!("accepted_nodes: {e}"))))?;
    Ok((out.num_accepted_tokens.into_pyarray(py), paths.into_pyarray(py), out.next_token_ids.into_pyarray(py)))
}

/// Batched n-gram lookup: `(drafts [batch * k], draft_lengths [batch])` for histories
/// `[batch, max_len]` with `lengths` `[batch]`.
#[pyfunction]
#[pyo3(signature = (histories, lengths, min_n, max_n, k, device="cpu"))]
pub fn batch_ngram(
    py: Python<'_>,
    histories: PyReadonlyArray2<u32>,
    lengths: Vec<u32>,
    min_n: usize,
    max_n: usize,
    k: usize,
    device: &str,
) -> PyResult<(Vec<u32>, Vec<u32>)> {
    let max_len = histories.shape()[1];
    let histories = histories.as_slice()?.to_vec();
    let ordinal = cuda_ordinal(device)?;
    run_detached(py, move || {
        let input = NgramInput { histories: &histories, max_len, lengths: &lengths, min_n, max_n, k };
        input.step().map_err(caller_error)?;
        match ordinal {
            None => ngram_lookup(&input),
            Some(ordinal) => on_cuda_ngram(ordinal, &input),
        }
    })
}

/// The kernels' input contract reports a violation as an internal error (inside the engine it is
/// a bug); here the arrays are the caller's, so it is a ConfigError naming what to change.
fn caller_error(error: Error) -> Error {
    match error {
        Error::Internal(message) => Error::Config(message),
        other => other,
    }
}

/// Every array's shape, every draft token id against the vocabulary (`AcceptInput::check`), and
/// the values the CPU reference and the kernel would silently compute garbage from.
fn check_accept(input: &AcceptInput) -> specrs_core::Result<()> {
    input.check().map_err(caller_error)?;
    check_draws(input.temperatures, input.uniforms)
}

/// Temperatures and uniforms the kernels would silently compute garbage from.
fn check_draws(temperatures: &[f32], uniforms: &[f32]) -> specrs_core::Result<()> {
    if let Some(t) = temperatures.iter().find(|t| !t.is_finite() || **t < 0.0) {
        return Err(Error::config(format!("temperatures must be finite and >= 0 (0 = greedy); got {t}")));
    }
    if let Some(u) = uniforms.iter().find(|u| !(0.0..1.0).contains(*u)) {
        return Err(Error::config(format!("uniforms must lie in [0, 1); got {u}")));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
use specrs_core::batch::cuda::{
    accept_from_host as on_cuda_accept, ngram_lookup_from_host as on_cuda_ngram,
    tree_accept_from_host as on_cuda_tree_accept,
};

#[cfg(not(feature = "cuda"))]
fn no_cuda<T>() -> specrs_core::Result<T> {
    Err(Error::Device("the CUDA kernels need a CUDA build of specrs (make wheel-cuda); use device='cpu'".into()))
}

#[cfg(not(feature = "cuda"))]
fn on_cuda_accept(_: usize, _: &AcceptInput) -> specrs_core::Result<specrs_core::batch::accept::AcceptOutput> {
    no_cuda()
}

#[cfg(not(feature = "cuda"))]
fn on_cuda_ngram(_: usize, _: &NgramInput) -> specrs_core::Result<(Vec<u32>, Vec<u32>)> {
    no_cuda()
}

#[cfg(not(feature = "cuda"))]
fn on_cuda_tree_accept(
    _: usize,
    _: &TreeAcceptInput,
) -> specrs_core::Result<specrs_core::batch::tree_accept::TreeAcceptOutput> {
    no_cuda()
}
