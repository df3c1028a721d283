//! The speculative methods' facts: one row per method a config may name, saying its aliases, the
//! keys only it takes, the weights it loads, its default draft length, whether its drafts can
//! carry probabilities, whether it drafts a whole block in one forward and whether it needs a
//! proposer object from the caller.
//!
//! Invariant: this table is the one place these facts live. The parser (`spec_config.rs`) reads
//! its names, aliases and key owners; Python reads it through `_specrs.method_facts()` (the
//! server's weight and proposer checks) and keeps no copy. Every `Method` has exactly one row
//! (`spec_config.rs` tests parse a config for each row and check the row against what it parses).

/// What one speculative method takes and needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MethodSpec {
    /// The name a config's "method" gives (vLLM's where vLLM has the method).
    pub name: &'static str,
    /// Other names a config may give for it (vLLM's older spellings).
    pub aliases: &'static [&'static str],
    /// The config keys that apply to this method only (or to it and the other methods listing
    /// them): a config of another method that holds one is refused.
    pub keys: &'static [&'static str],
    /// The keys naming weights it loads besides the target's: "model" (a draft's or a head's
    /// file), "quantization" (the target requantized, or a head quantized at load); empty for a
    /// method that loads none. `specrs serve` lets a request use only weights it already holds,
    /// so a method must say what it loads (`SpeculativeConfig::weights`).
    pub weight_keys: &'static [&'static str],
    /// The draft length (k) when the config sets no "num_speculative_tokens" (nor a static tree);
    /// None: the config must set it.
    pub default_k: Option<usize>,
    /// Its chain drafts can carry draft probabilities (sampled drafts, verified by rejection
    /// sampling, cut by draft_confidence_threshold); false: one-hot drafts only.
    pub draft_probs: bool,
    /// It drafts a whole block in ONE forward (PARD, DFlash, DSpark), so a short draft costs what
    /// a long one does and its drafting is charged per draft, not per token (`costs::DraftCost`).
    pub one_forward_per_draft: bool,
    /// It drafts through a proposer object the caller passes (Python `propose(context_ids, k)`),
    /// which a config alone (a server request, say) cannot supply.
    pub needs_proposer_object: bool,
}

/// suffix_decoding_max_tree_depth when the config sets none (vLLM's default); suffix decoding's
/// k defaults to it.
pub const DEFAULT_SUFFIX_MAX_TREE_DEPTH: usize = 24;

/// "auto"'s k when the config sets none: the longest draft any of its drafters may make (a free
/// lookup's long match; the draft model's length stays what its cost allows).
pub const DEFAULT_AUTO_K: usize = 8;

const DRAFT_KEYS: &[&str] = &["model", "max_model_len"];
const HEAD_KEYS: &[&str] = &["model", "quantization"];

/// A hidden-state head (`proposer/heads/`): a head directory or file, quantized at load or not.
const fn head(name: &'static str) -> MethodSpec {
    MethodSpec {
        name,
        aliases: &[],
        keys: HEAD_KEYS,
        weight_keys: HEAD_KEYS,
        default_k: None,
        draft_probs: true,
        one_forward_per_draft: false,
        needs_proposer_object: false,
    }
}

/// Every method, in the order error messages list them.
pub const ALL: [MethodSpec; 15] = [
    MethodSpec {
        name: "ngram",
        aliases: &["[ngram]"],
        keys: &["prompt_lookup_min", "prompt_lookup_max"],
        weight_keys: &[],
        default_k: None,
        draft_probs: false,
        one_forward_per_draft: false,
        needs_proposer_object: false,
    },
    MethodSpec {
        name: "suffix",
        aliases: &[],
        keys: &[
            "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests",
            "suffix_decoding_max_spec_factor",
            "suffix_decoding_min_token_prob",
        ],
        weight_keys: &[],
        default_k: Some(DEFAULT_SUFFIX_MAX_TREE_DEPTH),
        draft_probs: false,
        one_forward_per_draft: false,
        needs_proposer_object: false,
    },
    MethodSpec {
        name: "custom",
        aliases: &[],
        keys: &[],
        weight_keys: &[],
        default_k: None,
        // The proposer may return (token_ids, draft_probs).
        draft_probs: true,
        one_forward_per_draft: false,
        needs_proposer_object: true,
    },
    MethodSpec {
        name: "draft_model",
        aliases: &["draft"],
        keys: DRAFT_KEYS,
        weight_keys: &["model"],
        default_k: None,
        draft_probs: true,
        one_forward_per_draft: false,
        needs_proposer_object: false,
    },
    MethodSpec {
        name: "layer_skip",
        aliases: &[],
        keys: &["exit_layer"],
        weight_keys: &[],
        default_k: None,
        draft_probs: true,
        one_forward_per_draft: false,
        needs_proposer_object: false,
    },
    MethodSpec {
        name: "quantized_self",
        aliases: &[],
        keys: &["max_model_len", "quantization"],
        weight_keys: &["quantization"],
        default_k: None,
        draft_probs: true,
        one_forward_per_draft: false,
        needs_proposer_object: false,
    },
    MethodSpec {
        name: "pard",
        aliases: &[],
        keys: &["model", "max_model_len", "mask_token_id"],
        weight_keys: &["model"],
        default_k: None,
        draft_probs: true,
        one_forward_per_draft: true,
        needs_proposer_object: false,
    },
    MethodSpec {
        name: "auto",
        aliases: &[],
        // Its model drafter's, when one joins the lookups: a draft model's or a head's
        // (`"draft_method"`); `SpeculativeConfig::weights` names the drafter's method.
        keys: &["model", "max_model_len", "quantization", "draft_method"],
        weight_keys: HEAD_KEYS,
        default_k: Some(DEFAULT_AUTO_K),
        draft_probs: true,
        one_forward_per_draft: false,
        needs_proposer_object: false,
    },
    head("eagle"),
    head("eagle3"),
    head("mtp"),
    head("mlp_speculator"),
    head("medusa"),
    MethodSpec { one_forward_per_draft: true, ..head("dflash") },
    MethodSpec { one_forward_per_draft: true, ..head("dspark") },
];

/// Every method's name, in `ALL`'s order.
pub const NAMES: [&str; ALL.len()] = {
    let mut names = [""; ALL.len()];
    let mut i = 0;
    while i < ALL.len() {
        names[i] = ALL[i].name;
        i += 1;
    }
    names
};

/// The method a config's "method" names, by its name or an alias.
pub fn resolve(name: &str) -> Option<&'static MethodSpec> {
    ALL.iter().find(|spec| spec.name == name || spec.aliases.contains(&name))
}

/// The method named `name` (its canonical name, as `Method` gives it).
pub fn spec(name: &str) -> &'static MethodSpec {
    ALL.iter().find(|spec| spec.name == name).unwrap_or_else(|| panic!("method '{name}' has no row in methods::ALL"))
}

/// The methods `key` applies to, in `ALL`'s order; empty for a key every method takes.
pub fn owners(key: &str) -> Vec<&'static str> {
    ALL.iter().filter(|spec| spec.keys.contains(&key)).map(|spec| spec.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_are_unique_and_keys_known() {
        let mut seen: Vec<&str> = Vec::new();
        for spec in &ALL {
            for name in std::iter::once(&spec.name).chain(spec.aliases) {
                assert!(!seen.contains(name), "{name} names two methods");
                seen.push(name);
            }
            for key in spec.keys {
                assert!(super::super::KEYS.contains(key), "{}: unknown key {key}", spec.name);
            }
            // What a method loads is named by keys it takes.
            for key in spec.weight_keys {
                assert!(["model", "quantization"].contains(key) && spec.keys.contains(key), "{}: {key}", spec.name);
            }
            assert_eq!(resolve(spec.name), Some(spec));
        }
        assert_eq!(resolve("draft").map(|s| s.name), Some("draft_model"));
        assert_eq!(resolve("nope"), None);
    }
}
