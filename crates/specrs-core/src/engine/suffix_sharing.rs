//! `Engine::add_suffix_responses` / `Engine::suffix_cache_responses`: the engine-wide suffix caches
//! fed from, and read out for, other engines (`specrs serve --ray` shares finished responses
//! between replicas, python/specrs/serve/ray/suffix_share.py).
//!
//! Invariant: adding a response here changes the cache exactly as a request of that config
//! finishing with it on this engine would (same eviction, same tree), so a replica fed its peers'
//! responses drafts as if it had served them; bad input (a non-suffix config, a token id past the
//! vocabulary) is an `Error::Config` that changes nothing.

use super::Engine;
use crate::error::{Error, Result};
use crate::proposer::suffix::SuffixProposer;
use crate::spec_config::SpeculativeConfig;

impl Engine {
    /// Caches `responses` (each a finished request's generated token ids, oldest first) in the
    /// engine-wide suffix cache of `config`, creating it if needed. Returns how many were added
    /// (none when the config caches no responses: `suffix_decoding_max_cached_requests` 0).
    pub fn add_suffix_responses(&self, config: &SpeculativeConfig, responses: &[Vec<u32>]) -> Result<usize> {
        if config.suffix_params().is_none() {
            return Err(Error::config(format!(
                "shared suffix responses need a suffix or auto config (\"method\": \"suffix\" or \"auto\"), got \"{}\"",
                config.method_name()
            )));
        }
        let vocab = self.model.info().vocab_size;
        if let Some(bad) = responses.iter().flatten().find(|&&id| id as usize >= vocab) {
            return Err(Error::config(format!(
                "a shared suffix response holds token id {bad}, past this model's {vocab} token ids: \
                 it comes from another model; share responses only between replicas of one model"
            )));
        }
        let cache = self.suffix_cache(config)?;
        let mut cache = SuffixProposer::lock_global(&cache);
        if cache.max_cached_requests() == 0 {
            return Ok(0);
        }
        for response in responses {
            cache.insert_response(response);
        }
        Ok(responses.len())
    }

    /// Every engine-wide suffix cache as (its config's JSON, its responses oldest first): what
    /// `add_suffix_responses` on an empty engine turns into the same caches.
    pub fn suffix_cache_responses(&self) -> Result<Vec<(String, Vec<Vec<u32>>)>> {
        let caches = super::lock(&self.suffix_caches)?.clone();
        Ok(caches
            .iter()
            .map(|(key, cache)| {
                let cache = SuffixProposer::lock_global(cache);
                (key.clone(), cache.responses().map(<[u32]>::to_vec).collect())
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::super::suffix_persistence::tests::{engine, response};
    use super::*;

    fn suffix(json: &str) -> SpeculativeConfig {
        SpeculativeConfig::from_json(json).unwrap()
    }

    /// A fresh request's drafts over a growing context.
    fn drafts(engine: &Engine, config: &SpeculativeConfig) -> Vec<Vec<u32>> {
        let mut proposer = engine.proposer(config, None).unwrap();
        let mut context = response(99, 3);
        (0..40)
            .map(|step| {
                let draft = proposer.propose(&context, 6).unwrap().token_ids;
                context.extend_from_slice(&draft[..draft.len() / 2]);
                context.push((step * 5 % 40) as u32);
                draft
            })
            .collect()
    }

    #[test]
    fn added_responses_draft_as_served_ones_do() {
        let config =
            suffix(r#"{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 5}"#);
        let served = engine(97);
        let responses: Vec<_> = (0..8).map(|i| response(i, 20 + i)).collect();
        for r in &responses {
            served.proposer(&config, None).unwrap().finish(r);
        }
        let fed = engine(97);
        // Eviction as when serving: 8 added, the newest 5 stay.
        assert_eq!(fed.add_suffix_responses(&config, &responses).unwrap(), 8);
        let expected = drafts(&served, &config);
        assert!(expected.iter().filter(|d| !d.is_empty()).count() > 5, "the cache must draft");
        assert_eq!(drafts(&fed, &config), expected);

        // Read out and fed to a third engine: the same caches again.
        let exported = fed.suffix_cache_responses().unwrap();
        assert_eq!(exported.len(), 1);
        assert_eq!(exported[0].0, config.to_json());
        assert_eq!(exported[0].1, responses[3..].to_vec());
        let third = engine(97);
        third.add_suffix_responses(&suffix(&exported[0].0), &exported[0].1).unwrap();
        assert_eq!(drafts(&third, &config), expected);
    }

    #[test]
    fn bad_input_is_refused_and_changes_nothing() {
        let e = engine(97);
        let config = suffix(r#"{"method": "suffix"}"#);
        let message = e.add_suffix_responses(&config, &[vec![1, 2], vec![3, 97]]).unwrap_err().to_string();
        assert!(message.contains("token id 97") && message.contains("97 token ids"), "{message}");
        assert!(e.suffix_cache_responses().unwrap().iter().all(|(_, r)| r.is_empty()));
        let ngram = suffix(r#"{"method": "ngram", "num_speculative_tokens": 4}"#);
        let message = e.add_suffix_responses(&ngram, &[vec![1, 2]]).unwrap_err().to_string();
        assert!(message.contains("\"method\": \"suffix\""), "{message}");
        // A config that caches nothing takes nothing.
        let off = suffix(r#"{"method": "suffix", "suffix_decoding_max_cached_requests": 0}"#);
        assert_eq!(e.add_suffix_responses(&off, &[vec![1, 2]]).unwrap(), 0);
    }
}
