//! Shared pieces of the fuzz targets in `fuzz_targets/`: the load-and-run pipeline every loader
//! target ends in (`pipeline`), structure-aware GGUF edits (`gguf_edit`), scratch Hugging Face
//! directories on tmpfs (`hf_scratch`), and structure-aware grammars (`grammar_gen`).
//!
//! Invariant: nothing here touches the network or downloads weights; the only files read are the
//! repository's tiny golden models (`tests/golden/`) and, for the tokenizer target, the installed
//! SmolLM2 file named by `SPECRS_FUZZ_MODEL`.

pub mod gguf_edit;
pub mod grammar_gen;
pub mod hf_scratch;
pub mod pipeline;

use std::path::PathBuf;

/// `tests/golden/` of this checkout (compile-time path, so the targets need no environment).
pub fn golden_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/golden"))
}
