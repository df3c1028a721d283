//! Batched suffix-tree lookup: for every sequence, the chain `proposer::suffix` drafts, walked over
//! the suffix trees' nodes mirrored on the device (`proposer/suffix_together.rs` keeps the mirror).
//!
//! The pool holds nodes of several trees (each tree in a region of its own), `[slots, 3]` u32:
//! count, token, and the slot of the best child (`NONE` at a leaf): what the greedy walk reads.
//! A step is ONE packed upload (`SuffixStep`): the node entries that changed since the last step
//! (every slot of a tree the pool did not hold), then per sequence its chain's limits and the
//! match nodes of its request's tree and of the global tree; ONE launch writes the entries and
//! drafts (`cuda/suffix.cu`; a step writing a tree whole writes its entries in a launch before);
//! ONE download brings back `[B, 1 + max_k]`: each draft's length, then the draft.
//!
//! The rule is `SuffixProposer`'s (its docs): for every match length m >= 1 of each tree, the
//! greedy path from the match node, at most `limits[m]` tokens: to the best child while the
//! running probability (product of count(child) / count(node), in f32) stays at least
//! `min_token_prob`; its score is the sum of the running probabilities. Per tree the best score
//! wins (ties: the longer match); the global tree's draft wins only with a strictly higher score.
//!
//! Invariant: for every sequence, the draft equals `SuffixProposer::propose(context, max_tokens)`
//! on the trees the pool holds after the step's entries (the same f32 operations, in order).

use crate::error::{Error, Result};

/// "No node" (`proposer::suffix`'s NONE).
pub const NONE: u32 = u32::MAX;
/// Words per node of the pool: count, token, best child's slot.
pub const NODE_WORDS: usize = 3;
/// The most match nodes a tree gives one sequence (the kernel walks each with a thread of its
/// own: blocks of 2 x MAX_MATCHES threads); `spec_config`'s deepest tree.
pub const MAX_MATCHES: usize = crate::spec_config::MAX_SUFFIX_TREE_DEPTH;
const _: () = assert!(MAX_MATCHES == 64, "cuda/suffix.cu's MAX_MATCHES");

/// Words of `SuffixStep`'s header (num_seqs, num_entries, max_k), of each node entry (slot,
/// count, token, best child's slot) and of each sequence (max_tokens, min_token_prob's bits,
/// local matches, global matches, where its lists start); `cuda/suffix.cu` reads the same.
const HEADER_WORDS: usize = 3;
const ENTRY_WORDS: usize = 4;
const SEQ_WORDS: usize = 5;

/// One step's node entries and lookups over a node pool; see the module docs for the layout.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SuffixStep {
    max_k: usize,
    entries: Vec<u32>,
    seqs: Vec<u32>,
    /// Per sequence: its limits `[L]`, its local match slots `[L]`, its global ones `[G]`.
    lists: Vec<u32>,
}

impl SuffixStep {
    pub fn num_seqs(&self) -> usize {
        self.seqs.len() / SEQ_WORDS
    }

    /// Node entries the step writes.
    pub fn num_entries(&self) -> usize {
        self.entries.len() / ENTRY_WORDS
    }

    /// Slot `slot` becomes `[count, token, best child's slot or NONE]`.
    pub fn write(&mut self, slot: u32, node: [u32; NODE_WORDS]) {
        self.entries.push(slot);
        self.entries.extend(node);
    }

    /// A sequence drafting at most `max_tokens` tokens: `limits[m]` tokens from the match of
    /// length m, whose node is `local[m]` in its request's tree and `global[m]` in the global
    /// tree (slots of the pool; index 0 the root, which is not walked).
    pub fn push(
        &mut self,
        max_tokens: usize,
        min_token_prob: f32,
        limits: &[u32],
        local: &[u32],
        global: &[u32],
    ) -> Result<()> {
        if limits.len() != local.len() || global.len() > local.len() || local.len() > MAX_MATCHES {
            return Err(Error::Internal(format!(
                "suffix step: {} limits, {} local and {} global matches (limits and local match, global at most \
                 as many, at most {MAX_MATCHES})",
                limits.len(),
                local.len(),
                global.len()
            )));
        }
        let entry = [max_tokens as u32, min_token_prob.to_bits(), local.len() as u32, global.len() as u32];
        self.seqs.extend(entry);
        self.seqs.push(self.lists.len() as u32);
        self.lists.extend_from_slice(limits);
        self.lists.extend_from_slice(local);
        self.lists.extend_from_slice(global);
        self.max_k = self.max_k.max(max_tokens);
        Ok(())
    }

    /// The descriptor: header, entries, sequences, lists.
    pub fn words(&self) -> Vec<u32> {
        let header = [self.num_seqs() as u32, self.num_entries() as u32, self.max_k as u32];
        [&header[..], &self.entries, &self.seqs, &self.lists].concat()
    }

    /// The output's words: `[B, 1 + max_k]`.
    pub fn output_words(&self) -> usize {
        self.num_seqs() * (1 + self.max_k)
    }

    /// Refuses an entry or a match past a pool of `num_slots` nodes, and a limit past its
    /// sequence's `max_tokens` (the kernel and the reference index freely after this).
    pub fn check_pool(&self, num_slots: usize) -> Result<()> {
        let slot_past = |slot: u32| slot as usize >= num_slots;
        let entry_past = self.entries.chunks(ENTRY_WORDS).any(|e| slot_past(e[0]) || (e[3] != NONE && slot_past(e[3])));
        let lists_bad = self.seqs.chunks(SEQ_WORDS).any(|seq| {
            let [max_tokens, _, num_local, num_global, start] = <[u32; SEQ_WORDS]>::try_from(seq).expect("five words");
            let (l, g, start) = (num_local as usize, num_global as usize, start as usize);
            let (limits, matches) = (&self.lists[start..start + l], &self.lists[start + l..start + 2 * l + g]);
            limits.iter().any(|&limit| limit > max_tokens) || matches.iter().any(|&slot| slot_past(slot))
        });
        if entry_past || lists_bad {
            return Err(Error::Internal(format!(
                "suffix step: a node past the pool's {num_slots} slots, or a limit past its sequence's max_tokens"
            )));
        }
        Ok(())
    }

    /// Each sequence's draft from the output words.
    pub fn drafts(&self, out: &[u32]) -> Vec<Vec<u32>> {
        out.chunks(1 + self.max_k).map(|seq| seq[1..1 + seq[0] as usize].to_vec()).collect()
    }
}

/// The CPU reference of `cuda/suffix.cu`: `words` (`SuffixStep::words`) applied to `pool`
/// (`[slots, 3]`, checked by `SuffixStep::check_pool`): the entries written, then each sequence's
/// lookup. Returns the output words `[B, 1 + max_k]`.
pub fn suffix_step(pool: &mut [u32], words: &[u32]) -> Vec<u32> {
    let (num_seqs, num_entries, max_k) = (words[0] as usize, words[1] as usize, words[2] as usize);
    let entries = &words[HEADER_WORDS..HEADER_WORDS + ENTRY_WORDS * num_entries];
    for entry in entries.chunks(ENTRY_WORDS) {
        let slot = entry[0] as usize * NODE_WORDS;
        pool[slot..slot + NODE_WORDS].copy_from_slice(&entry[1..]);
    }
    let seqs_start = HEADER_WORDS + entries.len();
    let lists = &words[seqs_start + SEQ_WORDS * num_seqs..];
    let mut out = vec![0u32; num_seqs * (1 + max_k)];
    for (seq, out) in
        words[seqs_start..seqs_start + SEQ_WORDS * num_seqs].chunks(SEQ_WORDS).zip(out.chunks_mut(1 + max_k))
    {
        let min_token_prob = f32::from_bits(seq[1]);
        let (num_local, num_global, start) = (seq[2] as usize, seq[3] as usize, seq[4] as usize);
        let limits = &lists[start..start + num_local];
        let local = &lists[start + num_local..start + 2 * num_local];
        let global = &lists[start + 2 * num_local..start + 2 * num_local + num_global];
        // Each tree's best (score, match length): ascending lengths, a tie to the longer.
        let best = |matches: &[u32]| {
            (1..matches.len()).fold((0.0f32, 0), |best, m| {
                let (score, _) = walk(pool, matches[m], limits[m], min_token_prob, None);
                if score >= best.0 {
                    (score, m)
                } else {
                    best
                }
            })
        };
        let (local_best, global_best) = (best(local), best(global));
        let (matches, m) = if global_best.0 > local_best.0 { (global, global_best.1) } else { (local, local_best.1) };
        if m > 0 {
            let mut draft = Vec::new();
            walk(pool, matches[m], limits[m], min_token_prob, Some(&mut draft));
            out[0] = draft.len() as u32;
            out[1..1 + draft.len()].copy_from_slice(&draft);
        }
    }
    out
}

/// The greedy path from `start`, at most `limit` tokens (`NodeArena::greedy_path` over the
/// pool's entries): (score, length), its tokens appended to `tokens`.
fn walk(pool: &[u32], start: u32, limit: u32, min_token_prob: f32, mut tokens: Option<&mut Vec<u32>>) -> (f32, u32) {
    let node_of = |slot: u32| &pool[slot as usize * NODE_WORDS..][..NODE_WORDS];
    let (mut prob, mut score, mut len, mut node) = (1.0f32, 0.0f32, 0, start);
    while len < limit {
        let child = node_of(node)[2];
        if child == NONE {
            break;
        }
        prob *= node_of(child)[0] as f32 / node_of(node)[0] as f32;
        if prob < min_token_prob {
            break;
        }
        if let Some(tokens) = tokens.as_mut() {
            tokens.push(node_of(child)[1]);
        }
        score += prob;
        len += 1;
        node = child;
    }
    (score, len)
}
