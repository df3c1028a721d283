//! `Engine::save_suffix_cache` / `Engine::load_suffix_cache`: the engine-wide suffix caches to and
//! from a file (`specrs serve --suffix-cache PATH`), in the format of `proposer/suffix_store.rs`.
//!
//! Invariant: a load either installs every cache of a file that passed all of suffix_store's checks
//! against this engine's model, or changes nothing; a save replaces the file whole or not at all.
//! A loaded cache whose config the engine already has is swapped into that cache's place, so
//! requests in flight with that config finish into (and draft from) the loaded cache, never an
//! orphan.

use std::path::Path;
use std::sync::{Arc, Mutex};

use super::{lock, Engine};
use crate::error::{Error, Result};
use crate::proposer::suffix::SuffixProposer;
use crate::proposer::suffix_store::{decode, read_file, write_atomically, Encoder, Fnv1a, ModelIdentity};

impl Engine {
    /// Writes every engine-wide suffix cache to `path` atomically (a temporary file beside it,
    /// synced, then renamed over it; missing directories are created). Returns how many cached
    /// responses it holds. Each cache is locked only while it is copied, so requests keep drafting
    /// meanwhile; the file holds each cache as it was at that moment.
    pub fn save_suffix_cache(&self, path: impl AsRef<Path>) -> Result<usize> {
        let path = path.as_ref();
        let caches = lock(&self.suffix_caches)?.clone();
        let mut encoder = Encoder::new(&self.suffix_cache_model());
        for (key, cache) in &caches {
            encoder
                .add(key, &SuffixProposer::lock_global(cache))
                .map_err(|e| Error::config(format!("cannot save the suffix caches to {}: {e}", path.display())))?;
        }
        let num_responses = encoder.num_responses();
        write_atomically(path, &encoder.finish())?;
        Ok(num_responses)
    }

    /// Replaces the engine-wide suffix caches with those saved in `path` by an engine of the same
    /// model; returns how many responses were loaded. A missing, unreadable, corrupt or truncated
    /// file, or one from another model, is an `Error::Config` naming the path, and leaves the
    /// caches as they were.
    pub fn load_suffix_cache(&self, path: impl AsRef<Path>) -> Result<usize> {
        let path = path.as_ref();
        let loaded = decode(&read_file(path)?, path, &self.suffix_cache_model())?;
        let num_responses = loaded.iter().map(|(_, cache)| cache.num_cached_requests()).sum();
        let mut caches = lock(&self.suffix_caches)?;
        let installed: Vec<_> = loaded
            .into_iter()
            .map(|(key, cache)| match caches.iter().find(|(k, _)| *k == key) {
                Some((_, shared)) => {
                    SuffixProposer::lock_global(shared).replace_with(cache);
                    (key, shared.clone())
                }
                None => (key, Arc::new(Mutex::new(cache))),
            })
            .collect();
        // Replaced whole (see `lock`): caches the file lacks are dropped, and a config's cache is
        // created empty again at its next request.
        *caches = installed;
        Ok(num_responses)
    }

    /// What a suffix cache file must match: the token ids' range, the tokenizer (every token's
    /// text, a few milliseconds for a 256k vocabulary) and the model's shape.
    fn suffix_cache_model(&self) -> ModelIdentity {
        let info = self.model.info();
        let mut fingerprint = Fnv1a::default();
        let vocab = self.tokenizer.vocab_size();
        fingerprint.update(&(vocab as u64).to_le_bytes());
        for id in 0..vocab as u32 {
            match self.tokenizer.token_text(id) {
                // Length-prefixed, so token boundaries count ("ab","c" differs from "a","bc").
                Some(text) => {
                    fingerprint.update(&(text.len() as u64).to_le_bytes());
                    fingerprint.update(text.as_bytes());
                }
                None => fingerprint.update(&u64::MAX.to_le_bytes()),
            }
        }
        ModelIdentity {
            vocab_size: info.vocab_size as u64,
            tokenizer_fingerprint: fingerprint.finish(),
            description: format!(
                "{} with {} layers, hidden size {}, {} token ids",
                info.architecture, info.num_layers, info.hidden_size, info.vocab_size
            ),
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::model::llama_config::LlamaConfig;
    use crate::proposer::Proposer;
    use crate::spec_config::SpeculativeConfig;

    /// A one-layer random Llama with `vocab_size` token ids (suffix_sharing.rs's tests use it too).
    pub(in crate::engine) fn engine(vocab_size: usize) -> Engine {
        let config = LlamaConfig::from_json(&format!(
            r#"{{"vocab_size": {vocab_size}, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}}"#
        ))
        .unwrap();
        Engine::random_llama(config, 0, "f32", "cpu").unwrap()
    }

    fn configs() -> [SpeculativeConfig; 3] {
        [
            r#"{"method": "suffix", "num_speculative_tokens": 4}"#,
            r#"{"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 8,
                "suffix_decoding_max_cached_requests": 5}"#,
            // "auto" keeps its suffix lookup's cache under its own config.
            r#"{"method": "auto", "num_speculative_tokens": 6}"#,
        ]
        .map(|json| SpeculativeConfig::from_json(json).unwrap())
    }

    /// Token ids below 40 from a fixed pattern with variation, so drafts find matches.
    pub(in crate::engine) fn response(i: usize, len: usize) -> Vec<u32> {
        (0..len).map(|j| ((j * 7 + i * (j % 3)) % 40) as u32).collect()
    }

    /// Drafts a fresh request of `config` gets on `engine` over a growing context.
    fn drafts(engine: &Engine, config: &SpeculativeConfig) -> Vec<Vec<u32>> {
        let mut proposer = engine.proposer(config, None).unwrap();
        drafts_of(proposer.as_mut())
    }

    fn drafts_of(proposer: &mut dyn Proposer) -> Vec<Vec<u32>> {
        let mut context = response(99, 3);
        let mut out = Vec::new();
        for step in 0..60 {
            let draft = proposer.propose(&context, 6).unwrap().token_ids;
            context.extend_from_slice(&draft[..draft.len() / 2]);
            context.push((step * 5 % 40) as u32);
            out.push(draft);
        }
        out
    }

    fn fill(engine: &Engine) {
        for (c, config) in configs().iter().enumerate() {
            for i in 0..8 {
                engine.proposer(config, None).unwrap().finish(&response(i + c, 30 + i));
            }
        }
    }

    fn temp_file(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("specrs-suffix-persistence-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn a_fresh_engine_drafts_as_the_saved_one_did() {
        let saved = engine(97);
        fill(&saved);
        let path = temp_file("round_trip.bin");
        // 8 responses of the default config, 5 of the second (its limit), 8 of auto's.
        assert_eq!(saved.save_suffix_cache(&path).unwrap(), 21);

        let fresh = engine(97);
        // A request in flight before the load keeps its cache, which the load fills in place; it
        // already holds match nodes in the old tree, which the load must invalidate.
        fresh.proposer(&configs()[0], None).unwrap().finish(&response(99, 10));
        let mut in_flight = fresh.proposer(&configs()[0], None).unwrap();
        in_flight.propose(&response(99, 3)[..2], 6).unwrap();
        assert_eq!(fresh.load_suffix_cache(&path).unwrap(), 21);
        assert_eq!(fresh.memory().unwrap().num_suffix_caches, 3);
        for config in &configs() {
            let expected = drafts(&saved, config);
            assert!(expected.iter().filter(|d| !d.is_empty()).count() > 10, "the cache must draft");
            assert_eq!(drafts(&fresh, config), expected);
        }
        assert_eq!(drafts_of(in_flight.as_mut()), drafts(&saved, &configs()[0]));
        // Saving the loaded engine writes the same file.
        let again = temp_file("round_trip_again.bin");
        fresh.save_suffix_cache(&again).unwrap();
        assert_eq!(std::fs::read(&again).unwrap(), std::fs::read(&path).unwrap());
        for file in [path, again] {
            std::fs::remove_file(file).unwrap();
        }
    }

    #[test]
    fn another_model_or_a_damaged_file_changes_nothing() {
        let saved = engine(97);
        fill(&saved);
        let path = temp_file("other_model.bin");
        saved.save_suffix_cache(&path).unwrap();

        let other = engine(101);
        other.proposer(&configs()[0], None).unwrap().finish(&response(1, 20));
        let before = drafts(&other, &configs()[0]);
        let message = other.load_suffix_cache(&path).unwrap_err().to_string();
        assert!(message.contains("another model") && message.contains("97 token ids"), "{message}");
        assert!(message.contains("101 token ids") && message.contains("other_model.bin"), "{message}");

        let mut bytes = std::fs::read(&path).unwrap();
        bytes.truncate(bytes.len() - 3);
        let truncated = temp_file("truncated.bin");
        std::fs::write(&truncated, &bytes).unwrap();
        let error = saved.load_suffix_cache(&truncated).unwrap_err();
        assert!(matches!(error, Error::Config(_)) && error.to_string().contains("truncated.bin"), "{error}");
        assert_eq!(drafts(&other, &configs()[0]), before);
        assert_eq!(other.memory().unwrap().num_suffix_caches, 1);
        for file in [path, truncated] {
            std::fs::remove_file(file).unwrap();
        }
    }
}
