//! N-gram (prompt lookup) proposer: guesses that the text will continue the way it did the last time
//! its current ending appeared.
//!
//! Rule: for n from `prompt_lookup_max` down to `prompt_lookup_min`, take the context's last n tokens
//! and look for an earlier occurrence of them (one that ends before the context does; it may overlap
//! the final n tokens). At the first (longest) n that has one, propose the up-to-`max_tokens` tokens
//! that followed its MOST RECENT earlier occurrence, cut short by the end of the context if the
//! occurrence is that close to it (always at least one token). No occurrence for any n: empty draft.
//!
//! vLLM (`vllm/v1/spec_decode/ngram_proposer.py`) picks the same n (the longest suffix of at most
//! `prompt_lookup_max` tokens that occurs earlier) but continues from its EARLIEST occurrence. We
//! deliberately differ: the most recent occurrence reflects what the model is doing now (the latest
//! edit of a repeated code block, the current loop of a list), and it is what a per-n "latest
//! position" index gives for free. (vLLM also caps the draft at `max_model_len - len`; here the
//! caller bounds `max_tokens`.)
//!
//! Cost: the context only grows by appending between calls (the `Proposer` contract), so rather than
//! rescanning it, each call indexes just the tokens appended since the previous call:
//! O((max - min + 1) * new tokens) hash-map inserts, plus one lookup per n.
//!
//! Invariant: in the table for each n, `latest_end` maps the hash of every n-gram ending at some
//! `end < indexed_end` to the largest such `end`, and `previous_end` chains each end to the next older
//! end with the same hash. `indexed_end` is the length of the context last seen, so the context's own
//! final n-gram is never in the index when it is looked up (it cannot match itself), and every
//! indexed n-gram has at least one token after it to propose.
//!
//! Tree (`propose_tree`): several earlier continuations of the matched n-gram, merged into a trie
//! (`tree::ContinuationTrie`) and read out best first within the tree limits. The occurrences are
//! the same chain walk as the chain's, continued: every n from the longest down, within one n most
//! recent first, each position once (under its longest n, which subsumes the shorter ones), at most
//! `MAX_TREE_OCCURRENCES` in all so the cost per call stays bounded. Each occurrence contributes
//! the up-to-`max_depth` tokens that followed it, with weight
//! `LENGTH_GAIN^(n - longest n) * RECENCY_DECAY^(its rank among the occurrences of its n)`:
//! a match on more context tokens is stronger evidence that the text repeats, and recent text
//! says more about what the model does now, but old occurrences still add up, so a continuation
//! seen several times can outrank one seen once more recently. The chain's occurrence (the most
//! recent one of the longest n) instead weighs more than all the others together, so every node on
//! its path outweighs every node off it: the tree's rank-0 path starts with the chain `propose`
//! returns (cut to `max_nodes`), so the tree never verifies less than the chain along it. It goes
//! on past the chain only where the chain stopped short of `max_depth` at the end of the context
//! (an occurrence just before it) and older occurrences say how the text went on from there. The
//! other weights only order the alternatives branching off that path.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

use super::tree::{ContinuationTrie, TreeLimits};
use super::{Draft, IndexedTail, Proposer};
use crate::error::Result;

/// Chain terminator in `NgramTable::previous_end`. Positions are stored as u32 to halve the index's
/// memory; no context comes near 4G tokens.
const NO_END: u32 = u32::MAX;

/// Most earlier occurrences one tree merges: enough alternatives for any tree worth verifying,
/// and a bound on the chain walk and trie size (occurrences times `max_depth` tokens) per call.
const MAX_TREE_OCCURRENCES: usize = 32;
/// Weight factor per context token an occurrence matches (relative to the longest match).
const LENGTH_GAIN: f64 = 2.0;
/// Weight factor per more recent occurrence of the same n: after four, an occurrence still
/// weighs 0.41 of the most recent, so repetition counts as well as recency.
const RECENCY_DECAY: f64 = 0.8;

/// Prompt-lookup proposer for one request; see the module docs for the matching rule.
pub struct NgramProposer {
    /// One table per n in `prompt_lookup_min..=prompt_lookup_max`, in increasing n.
    tables: Vec<NgramTable>,
    /// Polynomial rolling-hash base (odd, random per proposer so no fixed input can force
    /// many collisions; proposals never depend on it because every candidate is verified).
    base: u64,
    /// `base_pow[i] = base^i` for i up to the largest n.
    base_pow: Vec<u64>,
    /// `prefix_hash[i]` = hash of `context[..i]`; holds `len + 1` entries for the context last seen,
    /// so the hash of any n-gram, including the final one, is two lookups away.
    prefix_hash: Vec<u64>,
    /// The n-grams ending at every position `< indexed_end` are in `tables`.
    indexed_end: usize,
    /// The newest indexed tokens, to notice a context that took back tokens it showed.
    tail: IndexedTail,
    /// Its rows in the device histories (`ngram_together.rs`).
    id: u64,
    /// The chain looked up ahead for `propose(context, max_tokens)`: (context length, max_tokens,
    /// the chain), taken by the next `propose`, which uses it only if it is for that call.
    pub(super) ahead: Option<(usize, usize, Vec<u32>)>,
}

/// The index for one n-gram length.
struct NgramTable {
    n: usize,
    /// n-gram hash -> end (exclusive) of its most recent indexed occurrence.
    latest_end: HashMap<u64, u32, BuildHasherDefault<MixHasher>>,
    /// `previous_end[end]` = the next older end whose n-gram has the same hash, or `NO_END`. Two
    /// different n-grams can share a hash; walking this chain past them keeps lookups exact.
    previous_end: Vec<u32>,
}

impl NgramProposer {
    /// A proposer matching n-grams of `prompt_lookup_min..=prompt_lookup_max` tokens
    /// (1 <= min <= max, validated by the config layer).
    pub fn new(prompt_lookup_min: usize, prompt_lookup_max: usize) -> Self {
        let base = RandomState::new().hash_one(0x6e67_7261_6d5f_7365_u64) | 1;
        Self::with_hash_base(prompt_lookup_min, prompt_lookup_max, base)
    }

    /// `new` with a chosen hash base; tests use degenerate bases to force hash collisions.
    fn with_hash_base(prompt_lookup_min: usize, prompt_lookup_max: usize, base: u64) -> Self {
        debug_assert!(1 <= prompt_lookup_min && prompt_lookup_min <= prompt_lookup_max);
        // A 0-gram would match everywhere; clamp rather than propose garbage if validation is skipped.
        let min_n = prompt_lookup_min.max(1);
        let tables = (min_n..=prompt_lookup_max)
            .map(|n| NgramTable { n, latest_end: HashMap::default(), previous_end: Vec::new() })
            .collect();
        let mut base_pow = vec![1u64];
        for _ in 0..prompt_lookup_max {
            base_pow.push(base_pow[base_pow.len() - 1].wrapping_mul(base));
        }
        Self {
            tables,
            base,
            base_pow,
            prefix_hash: vec![0],
            indexed_end: 0,
            tail: IndexedTail::default(),
            id: super::ngram_together::next_id(),
            ahead: None,
        }
    }

    /// Its id in the device histories (`ngram_together.rs`).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// `[prompt_lookup_min, prompt_lookup_max]`.
    pub fn lookup_lengths(&self) -> [usize; 2] {
        [self.tables[0].n, self.tables[self.tables.len() - 1].n]
    }

    /// Keeps `chain`, looked up elsewhere by this proposer's rule (`ngram_together.rs`), for the
    /// next `propose(context, max_tokens)`.
    pub fn begin_chain(&mut self, context: &[u32], max_tokens: usize, chain: Vec<u32>) {
        self.ahead = Some((context.len(), max_tokens, chain));
    }

    /// Brings the index up to date with `context`: hashes its new tokens and indexes the n-grams
    /// ending at every position before its end.
    fn index(&mut self, context: &[u32]) {
        if context.len() + 1 < self.prefix_hash.len() || !self.tail.agrees(context) {
            // The context shrank, which the `Proposer` contract rules out. Rebuild rather than keep
            // positions past its end; lookups verify tokens, so even a context rewritten in place
            // yields only genuine earlier occurrences, never a panic.
            self.reset();
        }
        debug_assert!(context.len() < NO_END as usize, "positions are stored as u32");
        let hashed = self.prefix_hash.len() - 1;
        for &token in &context[hashed..] {
            let last = self.prefix_hash[self.prefix_hash.len() - 1];
            self.prefix_hash.push(last.wrapping_mul(self.base).wrapping_add(u64::from(token)));
        }
        // Ends stop short of `context.len()`: the final n-gram is what we look up, and indexing it
        // now would let it match itself. It gets indexed next call, once a token follows it.
        for end in self.indexed_end..context.len() {
            for table in &mut self.tables {
                let previous = if end >= table.n {
                    let hash = ngram_hash(&self.prefix_hash, &self.base_pow, end - table.n, end);
                    table.latest_end.insert(hash, end as u32).unwrap_or(NO_END)
                } else {
                    NO_END
                };
                table.previous_end.push(previous);
            }
        }
        self.indexed_end = context.len();
        self.tail.record(context);
    }

    fn reset(&mut self) {
        for table in &mut self.tables {
            table.latest_end.clear();
            table.previous_end.clear();
        }
        self.prefix_hash.truncate(1);
        self.indexed_end = 0;
    }

    /// Where the continuation starts: the end of the most recent earlier occurrence of the longest
    /// matching suffix. Requires `index(context)` first.
    fn find_continuation(&self, context: &[u32]) -> Option<usize> {
        self.occurrences(context).next().map(|occurrence| occurrence.end)
    }

    /// Every earlier occurrence of the context's suffixes, longest n first and, within one n, most
    /// recent first. Requires `index(context)` first.
    fn occurrences<'a>(&'a self, context: &'a [u32]) -> Occurrences<'a> {
        Occurrences { proposer: self, context, tables_left: self.tables.len(), candidate: NO_END }
    }

    /// The trie of what followed up to `MAX_TREE_OCCURRENCES` earlier occurrences, each cut to
    /// `max_depth` tokens and weighted as the module docs say. Requires `index(context)` first.
    fn continuation_trie(&self, context: &[u32], max_depth: usize) -> ContinuationTrie {
        // (end, n, weight) per kept occurrence, in the order found.
        let mut found: Vec<(usize, usize, f64)> = Vec::with_capacity(MAX_TREE_OCCURRENCES);
        let mut rank_within_n = 0;
        for Occurrence { end, n } in self.occurrences(context) {
            // A position matched by a longer n is already in, with more weight.
            if found.iter().any(|&(kept_end, _, _)| kept_end == end) {
                continue;
            }
            let longest_n = found.first().map_or(n, |&(_, first_n, _)| first_n);
            rank_within_n = if found.last().is_some_and(|&(_, last_n, _)| last_n == n) { rank_within_n + 1 } else { 0 };
            let weight = LENGTH_GAIN.powi(-((longest_n - n) as i32)) * RECENCY_DECAY.powi(rank_within_n);
            found.push((end, n, weight));
            if found.len() == MAX_TREE_OCCURRENCES {
                break;
            }
        }
        let mut trie = ContinuationTrie::new();
        if found.is_empty() {
            return trie;
        }
        // The chain's occurrence outweighs all the others together (module docs); they weigh at
        // most 1 each, so the sum is small and adding 1 keeps the inequality strict.
        found[0].2 = 1.0 + found[1..].iter().map(|&(_, _, weight)| weight).sum::<f64>();
        for &(end, _, weight) in &found {
            trie.insert(&context[end..context.len().min(end + max_depth)], weight);
        }
        trie
    }
}

/// One earlier occurrence of the context's last `n` tokens, ending (exclusive) at `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Occurrence {
    end: usize,
    n: usize,
}

/// Walks the `previous_end` chains of the context's final n-gram, from the longest n down,
/// verifying each candidate's tokens (hashes may collide).
struct Occurrences<'a> {
    proposer: &'a NgramProposer,
    context: &'a [u32],
    /// Tables not yet started; the one being walked is `tables[tables_left]`.
    tables_left: usize,
    /// The next end to check in the table being walked, or `NO_END` to start the next table.
    candidate: u32,
}

impl Iterator for Occurrences<'_> {
    type Item = Occurrence;

    fn next(&mut self) -> Option<Occurrence> {
        let (proposer, context, len) = (self.proposer, self.context, self.context.len());
        loop {
            if self.candidate == NO_END {
                if self.tables_left == 0 {
                    return None;
                }
                self.tables_left -= 1;
                let table = &proposer.tables[self.tables_left];
                // An earlier occurrence ends at some `end` with n <= end < len.
                if table.n < len {
                    let hash = ngram_hash(&proposer.prefix_hash, &proposer.base_pow, len - table.n, len);
                    self.candidate = table.latest_end.get(&hash).copied().unwrap_or(NO_END);
                }
                continue;
            }
            let table = &proposer.tables[self.tables_left];
            let (end, n) = (self.candidate as usize, table.n);
            self.candidate = table.previous_end[end];
            if context[end - n..end] == context[len - n..] {
                return Some(Occurrence { end, n });
            }
        }
    }
}

impl Drop for NgramProposer {
    fn drop(&mut self) {
        super::ngram_together::release(self.id);
    }
}

impl Proposer for NgramProposer {
    fn drafts_after_unverified_tokens(&self) -> bool {
        true
    }

    fn ngram_chain(&mut self) -> Option<&mut NgramProposer> {
        Some(self)
    }

    fn finish(&mut self, _generated: &[u32]) {
        self.ahead = None;
        super::ngram_together::release(self.id);
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        if let Some((len, max, chain)) = self.ahead.take() {
            if (len, max) == (context.len(), max_tokens) {
                // The index catches up with these tokens at the next call that reads it.
                return Ok(Draft::tokens(chain));
            }
        }
        // Index even when no tokens are wanted, so the next call still only pays for its new tokens.
        self.index(context);
        if max_tokens == 0 {
            return Ok(Draft::tokens(Vec::new()));
        }
        let token_ids = match self.find_continuation(context) {
            Some(start) => context[start..context.len().min(start + max_tokens)].to_vec(),
            None => Vec::new(),
        };
        Ok(Draft::tokens(token_ids))
    }

    /// Several earlier continuations of the matched n-gram as a tree whose rank-0 path starts
    /// with the chain `propose` returns (module docs).
    fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
        self.ahead = None;
        self.index(context);
        if max_depth == 0 || limits.max_nodes == 0 || limits.max_children == 0 {
            return Ok(Draft::tokens(Vec::new()));
        }
        let (token_ids, parents) = self.continuation_trie(context, max_depth).best_first(max_depth, limits);
        Ok(Draft::tree(token_ids, parents))
    }
}

/// Hash of `tokens[start..end]` from the prefix hashes of the tokens.
fn ngram_hash(prefix_hash: &[u64], base_pow: &[u64], start: usize, end: usize) -> u64 {
    prefix_hash[end].wrapping_sub(prefix_hash[start].wrapping_mul(base_pow[end - start]))
}

/// Hasher for keys that already are 64-bit hashes. The polynomial hash's low bits depend only on the
/// tokens' low bits, and `HashMap` picks buckets by low bits, so we still mix (the splitmix64
/// finalizer: two multiplies, far cheaper than the default `SipHash`).
#[derive(Default)]
struct MixHasher(u64);

impl Hasher for MixHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u64 keys, which this module never uses; kept correct anyway.
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }

    fn finish(&self) -> u64 {
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tree::{first_path, path_tokens};
    use super::*;

    #[test]
    fn a_context_that_takes_back_shown_tokens_is_indexed_again() {
        // The session showed [.., 7, 8] (a forced run), the target kept 9 instead of 7.
        let base: Vec<u32> = [1, 2, 3, 9, 4, 1, 2, 3, 7, 5, 1, 2, 3].to_vec();
        let shown = [base.as_slice(), &[7, 8]].concat();
        let kept = [base.as_slice(), &[9, 4]].concat();
        let mut proposer = NgramProposer::new(1, 3);
        proposer.propose(&shown, 3).unwrap();
        let after = proposer.propose(&kept, 3).unwrap();
        assert_eq!(after.token_ids, NgramProposer::new(1, 3).propose(&kept, 3).unwrap().token_ids);
        assert_eq!(after.token_ids, rescan_reference(&kept, 1, 3, 3));
    }

    /// The matching rule, written as directly as possible: rescan the whole context.
    fn rescan_reference(context: &[u32], min_n: usize, max_n: usize, max_tokens: usize) -> Vec<u32> {
        let len = context.len();
        for n in (min_n..=max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            for end in (n..len).rev() {
                if &context[end - n..end] == suffix {
                    return context[end..len.min(end + max_tokens)].to_vec();
                }
            }
        }
        Vec::new()
    }

    fn propose(proposer: &mut NgramProposer, context: &[u32], max_tokens: usize) -> Vec<u32> {
        let draft = proposer.propose(context, max_tokens).unwrap();
        assert!(draft.probs.is_none());
        draft.token_ids
    }

    /// xorshift64*: deterministic, dependency-free randomness for the tests.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, bound: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % bound
        }
    }

    /// Grows random contexts by random amounts (0 included: repeated calls on the same context) and
    /// checks every proposal against the rescan, for proposers built by `make`.
    fn check_against_rescan(make: impl Fn(usize, usize) -> NgramProposer) {
        let configs = [(1, 1, 1), (1, 3, 4), (2, 4, 8), (3, 3, 5), (1, 6, 3), (4, 8, 10), (2, 2, 16)];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for &(min_n, max_n, max_tokens) in &configs {
            for alphabet in [2u64, 3, 5, 20] {
                for _ in 0..15 {
                    let mut proposer = make(min_n, max_n);
                    let mut context = Vec::new();
                    while context.len() < 400 {
                        for _ in 0..rng.below(8) {
                            context.push(rng.below(alphabet) as u32);
                        }
                        let expected = rescan_reference(&context, min_n, max_n, max_tokens);
                        assert_eq!(
                            propose(&mut proposer, &context, max_tokens),
                            expected,
                            "min {min_n} max {max_n} k {max_tokens} context {context:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn incremental_matches_rescan_on_random_sequences() {
        check_against_rescan(NgramProposer::new);
    }

    #[test]
    fn hash_collisions_are_ruled_out_by_verification() {
        // Base 0 hashes an n-gram to its last token, base 1 to its token sum: nearly every lookup
        // meets colliding n-grams first, and must walk past them to the real occurrence.
        check_against_rescan(|min_n, max_n| NgramProposer::with_hash_base(min_n, max_n, 0));
        check_against_rescan(|min_n, max_n| NgramProposer::with_hash_base(min_n, max_n, 1));
    }

    #[test]
    fn no_match_gives_empty_draft() {
        let mut proposer = NgramProposer::new(1, 3);
        assert!(propose(&mut proposer, &[], 4).is_empty());
        assert!(propose(&mut proposer, &[7], 4).is_empty());
        assert!(propose(&mut proposer, &[7, 8, 9, 10], 4).is_empty());
        // Shorter than the smallest n.
        assert!(propose(&mut NgramProposer::new(3, 4), &[5, 5], 4).is_empty());
    }

    #[test]
    fn final_ngram_does_not_match_itself() {
        // [1, 2] occurs once, at the very end: nothing earlier to continue from.
        let mut proposer = NgramProposer::new(2, 2);
        assert!(propose(&mut proposer, &[3, 4, 1, 2], 4).is_empty());
        // Called again with the same context, the index must not have picked the final n-gram up.
        assert!(propose(&mut proposer, &[3, 4, 1, 2], 4).is_empty());
    }

    #[test]
    fn max_tokens_is_respected() {
        let context = [1, 2, 3, 4, 5, 6, 1, 2];
        assert_eq!(propose(&mut NgramProposer::new(2, 2), &context, 3), [3, 4, 5]);
        assert_eq!(propose(&mut NgramProposer::new(2, 2), &context, 1), [3]);
        assert!(propose(&mut NgramProposer::new(2, 2), &context, 0).is_empty());
        // More than follows the match: cut at the end of the context.
        assert_eq!(propose(&mut NgramProposer::new(2, 2), &context, 10), [3, 4, 5, 6, 1, 2]);
    }

    #[test]
    fn longest_ngram_wins_over_shorter_more_recent_one() {
        // [7, 8, 9] occurred once (followed by 1); [8, 9] more recently (followed by 2).
        let context = [7, 8, 9, 1, 5, 8, 9, 2, 6, 7, 8, 9];
        assert_eq!(propose(&mut NgramProposer::new(2, 3), &context, 2), [1, 5]);
        assert_eq!(propose(&mut NgramProposer::new(2, 2), &context, 2), [2, 6]);
    }

    #[test]
    fn most_recent_occurrence_wins() {
        // vLLM would continue from the first [1, 2] and propose [3].
        assert_eq!(propose(&mut NgramProposer::new(1, 2), &[1, 2, 3, 1, 2, 4, 1, 2], 1), [4]);
    }

    #[test]
    fn overlapping_repeat_returns_what_is_available() {
        // The most recent earlier [1, 2] (or [1, 2, 1, 2]) ends two tokens before the context does.
        let context = [1, 2, 1, 2, 1, 2];
        assert_eq!(propose(&mut NgramProposer::new(2, 2), &context, 5), [1, 2]);
        assert_eq!(propose(&mut NgramProposer::new(4, 4), &context, 5), [1, 2]);
        // A run of one token: [7, 7] last ended one token before the end.
        assert_eq!(propose(&mut NgramProposer::new(2, 2), &[7, 7, 7], 4), [7]);
    }

    /// The tokens on a tree's rank-0 path.
    fn first_path_tokens(draft: &Draft) -> Vec<u32> {
        first_path(&draft.parents()).iter().map(|&node| draft.token_ids[node]).collect()
    }

    /// The tokens from the root to each node.
    fn paths(draft: &Draft) -> Vec<Vec<u32>> {
        let parents = draft.parents();
        (0..parents.len()).map(|node| path_tokens(&draft.token_ids, &parents, node)).collect()
    }

    fn tree(
        proposer: &mut NgramProposer,
        context: &[u32],
        max_depth: usize,
        max_nodes: usize,
        max_children: usize,
    ) -> Draft {
        let limits = TreeLimits { max_nodes, max_children };
        let draft = proposer.propose_tree(context, max_depth, limits).unwrap();
        draft.validate(max_depth, Some(limits), 1 << 20, "ngram").unwrap();
        assert!(draft.probs.is_none());
        draft
    }

    /// Random growing contexts, random limits: every tree is valid, its rank-0 path starts with
    /// the chain and goes past it only where the chain ran into the end of the context, and every
    /// path is what followed some earlier occurrence of the context's last `min_n` tokens (the
    /// shortest match any occurrence has). Returns how many drafts branched.
    fn check_trees(make: impl Fn(usize, usize) -> NgramProposer) -> usize {
        let configs = [(1, 1, 1), (1, 3, 4), (2, 4, 8), (3, 3, 5), (1, 6, 3), (2, 2, 16)];
        let shapes = [(1, 1), (1, 4), (4, 1), (4, 2), (8, 3), (16, 4), (3, 8), (64, 64)];
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut num_trees = 0;
        for &(min_n, max_n, max_depth) in &configs {
            for alphabet in [2u64, 3, 5, 20] {
                for _ in 0..6 {
                    let mut chain_proposer = make(min_n, max_n);
                    let mut tree_proposer = make(min_n, max_n);
                    let mut context = Vec::new();
                    while context.len() < 300 {
                        for _ in 0..rng.below(8) {
                            context.push(rng.below(alphabet) as u32);
                        }
                        let (max_nodes, max_children) = shapes[rng.below(shapes.len() as u64) as usize];
                        let draft = tree(&mut tree_proposer, &context, max_depth, max_nodes, max_children);
                        let chain = propose(&mut chain_proposer, &context, max_depth.min(max_nodes));
                        let what = format!("min {min_n} max {max_n} depth {max_depth} nodes {max_nodes} children {max_children} context {context:?}");
                        let first = first_path_tokens(&draft);
                        assert!(first.starts_with(&chain), "rank-0 path {first:?}, chain {chain:?}; {what}");
                        if first.len() > chain.len() {
                            let cut_by_the_context = chain.len() < max_depth.min(max_nodes)
                                && (min_n..context.len()).rev().any(|end| context[end..] == chain[..]);
                            assert!(cut_by_the_context, "rank-0 path {first:?} outgrew chain {chain:?}; {what}");
                        }
                        let len = context.len();
                        for path in paths(&draft) {
                            let followed = (min_n..len).any(|end| {
                                context[end - min_n..end] == context[len - min_n..] && context[end..].starts_with(&path)
                            });
                            assert!(followed, "path {path:?} never followed a match; {what}");
                        }
                        num_trees += usize::from(draft.is_tree());
                    }
                }
            }
        }
        num_trees
    }

    #[test]
    fn tree_is_valid_starts_with_the_chain_and_follows_matches() {
        assert!(check_trees(NgramProposer::new) > 1000);
        // Colliding hashes: the occurrence walk must verify tokens for every n, not just the first.
        assert!(check_trees(|min_n, max_n| NgramProposer::with_hash_base(min_n, max_n, 1)) > 1000);
    }

    #[test]
    fn two_continuations_give_the_root_two_children() {
        // [1, 2] was followed by [4, 8, 1, 2] most recently and by [3, 9, 1, 2] before.
        let context = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2];
        let draft = tree(&mut NgramProposer::new(2, 2), &context, 4, 8, 4);
        assert_eq!(draft.token_ids, [4, 8, 1, 2, 3, 9, 1, 2]);
        assert_eq!(draft.parents, Some(vec![-1, 0, 1, 2, -1, 4, 5, 6]));
        // Out of nodes, the chain comes first.
        let draft = tree(&mut NgramProposer::new(2, 2), &context, 4, 5, 4);
        assert_eq!((draft.token_ids, draft.parents), (vec![4, 8, 1, 2, 3], Some(vec![-1, 0, 1, 2, -1])));
    }

    #[test]
    fn alternatives_rank_by_match_length_repetition_and_recency() {
        // Recency: [1, 2] was followed by 4 (the chain), then further back by 3, then by 6.
        let context = [1, 2, 6, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2];
        assert_eq!(tree(&mut NgramProposer::new(2, 2), &context, 1, 8, 8).token_ids, [4, 3, 6]);
        // [7, 1, 2] matched once (followed by 5): the chain, though older than every [1, 2]. Of
        // the [1, 2]-only matches, 6 followed twice (0.5 * 0.8 + 0.5 * 0.64) and outranks 3, which
        // followed once but most recently (0.5).
        let context = [7, 1, 2, 5, 0, 1, 2, 6, 0, 1, 2, 6, 0, 1, 2, 3, 0, 7, 1, 2];
        assert_eq!(propose(&mut NgramProposer::new(2, 3), &context, 1), [5]);
        assert_eq!(tree(&mut NgramProposer::new(2, 3), &context, 1, 8, 8).token_ids, [5, 6, 3]);
    }

    #[test]
    fn limits_of_one_degrade_to_a_chain() {
        let context = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2];
        // One child per node: the chain, stored as one.
        let draft = tree(&mut NgramProposer::new(2, 2), &context, 4, 8, 1);
        assert_eq!((draft.token_ids, draft.parents), (vec![4, 8, 1, 2], None));
        // One node: the chain's first token.
        let draft = tree(&mut NgramProposer::new(2, 2), &context, 4, 1, 4);
        assert_eq!((draft.token_ids, draft.parents), (vec![4], None));
        // Depth 1: the chain's first token first, then the other first tokens beside it.
        let draft = tree(&mut NgramProposer::new(2, 2), &context, 1, 8, 4);
        assert_eq!((draft.depth(), draft.token_ids), (1, vec![4, 3]));
        assert!(tree(&mut NgramProposer::new(2, 2), &context, 0, 8, 4).token_ids.is_empty());
        assert!(tree(&mut NgramProposer::new(2, 2), &[1, 2, 3], 4, 8, 4).token_ids.is_empty());
    }

    #[test]
    fn tree_merges_at_most_the_capped_number_of_occurrences() {
        // [1] was followed by 100 different tokens, the most recent last.
        let mut context: Vec<u32> = (0..100).flat_map(|i| [1, 100 + i]).collect();
        context.push(1);
        let draft = tree(&mut NgramProposer::new(1, 1), &context, 1, 64, 64);
        let expected: Vec<u32> = (0..MAX_TREE_OCCURRENCES as u32).map(|i| 199 - i).collect();
        assert_eq!(draft.token_ids, expected);
    }

    #[test]
    fn shrunken_context_rebuilds_the_index() {
        // Outside the contract, but must neither panic nor propose from stale positions.
        let mut proposer = NgramProposer::new(1, 2);
        assert_eq!(propose(&mut proposer, &[1, 2, 3, 4, 5, 1], 2), [2, 3]);
        assert!(propose(&mut proposer, &[9, 8], 2).is_empty());
        assert_eq!(propose(&mut proposer, &[9, 8, 9], 2), [8, 9]);
    }
}
