//! `GrammarCache`: an engine's compiled grammars, so that a grammar asked for again (the server's
//! check before it answers, then the request's start; the same schema on every request of a
//! client; the samples of one request) is compiled by llguidance once, not every time (a compile
//! takes from milliseconds to seconds).
//!
//! An entry is a `Constraint` at the start of the output, exactly as `ConstraintCompiler::compile`
//! returned it; nothing ever runs on it. Every caller gets its own deep copy
//! (`Constraint::copy_at_start`: llguidance's `Matcher::deep_clone`, which copies the parser, its
//! lexer caches and its cancellation state), so no request's tokens, masks or cancellation reach
//! the entry or another request.
//!
//! Invariants:
//! - The key is the whole spec as `GrammarSpec::to_json` writes it (its kind, and the full text of
//!   its schema, regex, grammar or choices, in order). Lookups compare the full key, not a hash
//!   of it, and not `GrammarSpec`'s `==` (which takes two schemas whose properties come in another
//!   order for equal, while llguidance writes the properties in the order given).
//! - Only successful compiles are kept: a failing spec is compiled again each time it is asked
//!   for, and fails with the very error a first compile gives.
//! - One cache serves one compiler (one tokenizer): its entries are only valid for that
//!   vocabulary. The engine, which owns both, keeps that so.
//! - At most `MAX_ENTRIES` entries and `MAX_KEY_BYTES` bytes of keys; past either, the least
//!   recently used entries go. A spec whose key alone is over `MAX_KEY_BYTES` is never kept.
//! - A compile runs outside the cache's lock, so a slow compile never holds up other requests'
//!   lookups; two requests missing on the same spec at once may both compile it (the second
//!   entry replaces the first, which is the same grammar).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use super::{Constraint, GrammarSpec};
use crate::error::Result;

/// Grammars kept at most. A deployment's distinct response formats and tool sets in use at once
/// are usually a handful to a few dozen; 64 keeps them all while bounding what clients that send
/// a new schema on every request can make the engine hold (each entry is at most a grammar within
/// `limits`, and `MAX_KEY_BYTES` bounds them together).
pub const MAX_ENTRIES: usize = 64;

/// Bytes of keys (the specs' text) kept at most. A compiled grammar grows with the text it was
/// compiled from (rules and lexemes per schema node, rule or alternative; `limits` bounds what one
/// text may expand to), so this bounds the memory of the entries as well as that of the keys;
/// typical schemas are a few KB, so it only binds for many near the limits.
pub const MAX_KEY_BYTES: usize = 16 << 20;

/// Where `GrammarCache::get_or_compile`'s constraint came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarSource {
    /// A copy of a kept entry: nothing was compiled.
    Cache,
    /// Compiled now (and kept, unless over `MAX_KEY_BYTES`).
    Compiled,
}

/// See the module doc.
pub struct GrammarCache {
    entries: Mutex<Entries>,
    max_entries: usize,
    max_key_bytes: usize,
}

#[derive(Default)]
struct Entries {
    by_key: HashMap<String, Entry>,
    /// Sum of the lengths of `by_key`'s keys.
    key_bytes: usize,
    /// Ticks once per use; an entry's `last_used` orders eviction.
    clock: u64,
}

struct Entry {
    /// At the start of the output; never run (copies are).
    constraint: Constraint,
    last_used: u64,
}

// The engine shares one cache between the threads that start requests.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<GrammarCache>();
};

impl Default for GrammarCache {
    fn default() -> Self {
        Self::with_bounds(MAX_ENTRIES, MAX_KEY_BYTES)
    }
}

impl GrammarCache {
    /// A cache of at most `max_entries` grammars and `max_key_bytes` bytes of keys (the engine's
    /// is `default()`: `MAX_ENTRIES`, `MAX_KEY_BYTES`).
    pub fn with_bounds(max_entries: usize, max_key_bytes: usize) -> Self {
        Self { entries: Mutex::default(), max_entries, max_key_bytes }
    }

    /// `spec`'s constraint at the start of the output, the caller's own: a copy of the kept one,
    /// or `compile(spec)` when none is kept (then kept). `compile`'s error is returned as it is,
    /// and nothing is kept for it; a copy of a kept entry never fails.
    pub fn get_or_compile(
        &self,
        spec: &GrammarSpec,
        compile: impl FnOnce(&GrammarSpec) -> Result<Constraint>,
    ) -> Result<(Constraint, GrammarSource)> {
        let key = spec.to_json().to_string();
        if let Some(copy) = self.copy_of(&key) {
            return Ok((copy, GrammarSource::Cache));
        }
        let compiled = compile(spec)?;
        let copy = compiled.copy_at_start();
        self.keep(key, compiled);
        Ok((copy, GrammarSource::Compiled))
    }

    /// Number of grammars kept.
    pub fn len(&self) -> usize {
        self.lock().by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the entry under exactly `key`, now the most recently used.
    fn copy_of(&self, key: &str) -> Option<Constraint> {
        let mut entries = self.lock();
        entries.clock += 1;
        let now = entries.clock;
        // HashMap compares the whole key on a hash match: a collision never finds another spec.
        let entry = entries.by_key.get_mut(key)?;
        entry.last_used = now;
        Some(entry.constraint.copy_at_start())
    }

    /// Keeps `constraint` under `key`, evicting the least recently used entries past the bounds.
    fn keep(&self, key: String, constraint: Constraint) {
        if key.len() > self.max_key_bytes || self.max_entries == 0 {
            return;
        }
        let mut entries = self.lock();
        if entries.by_key.remove(&key).is_some() {
            entries.key_bytes -= key.len();
        }
        while entries.by_key.len() >= self.max_entries || entries.key_bytes + key.len() > self.max_key_bytes {
            let oldest = entries.by_key.iter().min_by_key(|(_, entry)| entry.last_used).map(|(k, _)| k.clone());
            let Some(oldest) = oldest else { break };
            entries.by_key.remove(&oldest);
            entries.key_bytes -= oldest.len();
        }
        entries.clock += 1;
        let last_used = entries.clock;
        entries.key_bytes += key.len();
        entries.by_key.insert(key, Entry { constraint, last_used });
    }

    /// The entries. A panic while they were held (copying a matcher) may have left the byte count
    /// off by an entry, so a poisoned cache is emptied: entries only save compiles.
    fn lock(&self) -> MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|poisoned| {
            let mut entries = poisoned.into_inner();
            *entries = Entries::default();
            self.entries.clear_poison();
            entries
        })
    }
}
