//! The heads that ship with specrs (in the Python package's `heads/` directory, trained by
//! `specrs train-head`): which target file each was trained on, where it lies under `heads/`, and
//! the settings each head method runs with when the config leaves them out.
//!
//! Invariant: this table is the one place these facts live; Python's `specrs.heads.SHIPPED` and
//! `HEAD_METHODS` are views of it (`_specrs.shipped_heads()`). A target is matched by what
//! identifies its file (`Engine.info()`'s architecture, vocabulary, depth and weight bytes), never
//! by a name the user typed, so a head never runs on a target it was not trained for.

/// A target specrs ships heads for, and those heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShippedTarget {
    /// The target's short name (and its directory under `heads/`).
    pub name: &'static str,
    /// `Engine.info()`'s values that identify the target's file.
    pub architecture: &'static str,
    pub vocab_size: usize,
    pub num_layers: usize,
    pub weight_bytes: u64,
    /// (method, the head's directory relative to `heads/`).
    pub heads: &'static [(&'static str, &'static str)],
}

/// The settings a shipped head of `method` runs with for the keys a config does not set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadDefaults {
    pub method: &'static str,
    /// The draft length the heads were trained for.
    pub num_speculative_tokens: usize,
    /// The heads' weights quantized at load (None: as stored).
    pub quantization: Option<&'static str>,
}

pub const TARGETS: [ShippedTarget; 2] = [
    ShippedTarget {
        name: "smollm2-135m",
        architecture: "llama",
        vocab_size: 49152,
        num_layers: 30,
        weight_bytes: 96_576_768,
        heads: &[("eagle3", "smollm2-135m/eagle3"), ("mlp_speculator", "smollm2-135m/mlp_speculator")],
    },
    ShippedTarget {
        name: "gemma3-270m",
        architecture: "gemma3",
        vocab_size: 262_144,
        num_layers: 18,
        weight_bytes: 246_587_904,
        heads: &[("eagle3", "gemma3-270m/eagle3")],
    },
];

/// Methods whose "model" a shipped head can fill in, and their defaults: the draft length each
/// was trained for (EAGLE-3: 4 training-time-test steps; the MLP speculator: 3 sub-heads), and for
/// EAGLE-3 Q8_0 weights (same acceptance, 0.67x instead of 0.41x plain at k = 2 on a CPU;
/// benches/README.md "heads_bench.py").
pub const HEAD_DEFAULTS: [HeadDefaults; 2] = [
    HeadDefaults { method: "eagle3", num_speculative_tokens: 4, quantization: Some("q8_0") },
    HeadDefaults { method: "mlp_speculator", num_speculative_tokens: 3, quantization: None },
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec_config::{methods, SpeculativeConfig};

    #[test]
    fn every_shipped_head_runs_with_its_defaults() {
        for defaults in HEAD_DEFAULTS {
            let spec = methods::spec(defaults.method);
            assert!(spec.weight_keys.contains(&"model"), "{}", defaults.method);
            let mut config = serde_json::json!({
                "method": defaults.method, "model": "heads/h", "num_speculative_tokens": defaults.num_speculative_tokens,
            });
            if let Some(q) = defaults.quantization {
                config["quantization"] = q.into();
            }
            let parsed = SpeculativeConfig::from_json(&config.to_string()).unwrap();
            assert_eq!(parsed.num_speculative_tokens, defaults.num_speculative_tokens);
        }
        for target in TARGETS {
            for (method, dir) in target.heads {
                assert!(HEAD_DEFAULTS.iter().any(|d| d.method == *method), "{}: {method} has no defaults", target.name);
                assert!(dir.starts_with(&format!("{}/", target.name)), "{dir}");
            }
        }
    }
}
