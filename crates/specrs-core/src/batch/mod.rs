//! Batched kernels: many sequences' acceptance (of a draft chain or a token tree) or n-gram or
//! suffix-tree lookup in one call.
//!
//! Each concept has a CPU reference here, written as plainly as possible and tested in CI; the CUDA
//! kernels in `cuda/` compute the same function on the device (`cuda.rs`, with the `cuda` feature),
//! and the device check (`scripts/gpu_check.py`) compares the two on random inputs.

pub mod accept;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ngram;
pub mod suffix;
pub mod tree_accept;

/// What is wrong with a batched input's arrays: each `(name, values, expected)` whose length is
/// off, a per-sequence count past its maximum (`(name, counts, max, max's name)`), and draft ids
/// outside the vocabulary. Empty when all is well.
pub(crate) fn shape_errors(
    arrays: &[(&str, usize, usize)],
    counts: (&str, &[u32], usize, &str),
    draft_token_ids: &[u32],
    vocab_size: usize,
) -> Vec<String> {
    let mut wrong: Vec<String> = arrays
        .iter()
        .filter(|(_, got, want)| got != want)
        .map(|(name, got, want)| format!("{name} has {got} values, expected {want}"))
        .collect();
    let (name, values, max, max_name) = counts;
    if let Some(count) = values.iter().find(|&&count| count as usize > max) {
        wrong.push(format!("{name} {count} exceeds {max_name} {max}"));
    }
    if let Some(t) = draft_token_ids.iter().find(|&&t| t as usize >= vocab_size) {
        wrong.push(format!("draft token {t} is outside the vocabulary ({vocab_size})"));
    }
    wrong
}
