//! Scratch Hugging Face directories for the `hf_dir` target: one copy per golden family
//! (`tests/golden/hf/<family>`) under tmpfs, where one file at a time is replaced by fuzzed bytes
//! and restored after the run.
//!
//! Input layout: byte 0 picks the file (`FILES`, plus `SAFETENSORS_HEADER`: fuzzed JSON header
//! in front of the golden tensor data), byte 1 the family, the rest is the new content.

use std::path::{Path, PathBuf};

pub const FAMILIES: [&str; 6] = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"];
pub const FILES: [&str; 6] = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "model.safetensors.index.json",
];
/// Selector value: the fuzzed bytes are the safetensors JSON header; the length prefix is
/// computed and the golden data appended, so mutations land on the header.
pub const SAFETENSORS_HEADER: u8 = FILES.len() as u8;

pub struct Scratch {
    /// Per family: its directory and the original contents of `FILES` (None: absent).
    dirs: Vec<(PathBuf, Vec<Option<Vec<u8>>>)>,
}

impl Scratch {
    pub fn new() -> Self {
        let base = Path::new("/dev/shm").join(format!("specrs-fuzz-hf-{}", std::process::id()));
        let golden = crate::golden_dir().join("hf");
        let dirs = FAMILIES
            .iter()
            .map(|family| {
                let dir = base.join(family);
                std::fs::create_dir_all(&dir).expect("create scratch dir");
                let originals: Vec<Option<Vec<u8>>> =
                    FILES.iter().map(|f| std::fs::read(golden.join(family).join(f)).ok()).collect();
                for (file, content) in FILES.iter().zip(&originals) {
                    if let Some(content) = content {
                        std::fs::write(dir.join(file), content).expect("write scratch file");
                    }
                }
                (dir, originals)
            })
            .collect();
        Self { dirs }
    }

    /// Runs `f` on the family's directory with one file replaced per `data`'s layout.
    pub fn with_input(&self, data: &[u8], f: impl FnOnce(&Path)) {
        if data.len() < 2 {
            return;
        }
        let selector = data[0] % (FILES.len() as u8 + 1);
        let (dir, originals) = &self.dirs[data[1] as usize % FAMILIES.len()];
        let content = &data[2..];
        let (index, bytes) = if selector == SAFETENSORS_HEADER {
            (1, safetensors_with_header(content, originals[1].as_deref().unwrap_or_default()))
        } else {
            (selector as usize, content.to_vec())
        };
        let path = dir.join(FILES[index]);
        std::fs::write(&path, bytes).expect("write fuzzed file");
        f(dir);
        match &originals[index] {
            Some(original) => std::fs::write(&path, original).expect("restore scratch file"),
            None => std::fs::remove_file(&path).expect("remove fuzzed file"),
        }
    }
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

/// The golden file's tensor data behind a new header.
pub fn safetensors_with_header(header: &[u8], golden: &[u8]) -> Vec<u8> {
    let old_len = golden.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    let data = golden.get(8 + old_len..).unwrap_or_default();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

/// The header JSON of a safetensors file (seeds for `SAFETENSORS_HEADER` inputs).
pub fn safetensors_header(file: &[u8]) -> &[u8] {
    let len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    &file[8..8 + len]
}
