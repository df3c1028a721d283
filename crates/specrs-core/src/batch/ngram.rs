//! Batched n-gram lookup: for every sequence, the prompt-lookup draft of `proposer::ngram`, from
//! histories that stay on the device between steps.
//!
//! The rule is `NgramProposer`'s (see its module docs): for n from max_n down to min_n, find the
//! most recent earlier occurrence of the history's last n tokens and propose up to k tokens that
//! followed it. The per-request proposer keeps an incremental index; this is the stateless scan a
//! device kernel does in parallel over positions (`cuda/ngram.cu`).
//!
//! A step is ONE packed upload (`NgramStep`): per sequence, its row of the history pool
//! (`[rows, max_len]`, device-resident), how many of the row's tokens it keeps, the tokens it
//! appends after them (a step appends what the last step accepted; a new or rewritten history
//! appends all of itself) and its own k, min_n and max_n; ONE launch appends and looks up; ONE
//! download brings back `[B, 1 + max_k]`: each draft's length, then the draft (0-padded).
//!
//! Invariant: for every sequence, the draft equals `NgramProposer::propose(history, k)` on the
//! history its row holds after the step's appends.

use crate::error::{Error, Result};

/// Words of `NgramStep`'s header (num_seqs, max_k) and of each sequence's entry (pool row,
/// tokens kept, tokens appended, where they start among the appended tokens, k, min_n, max_n);
/// `cuda/ngram.cu` reads them with the same numbers.
const HEADER_WORDS: usize = 2;
const SEQ_WORDS: usize = 7;

/// One step's lookups over a history pool; see the module docs for the layout.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NgramStep {
    max_k: usize,
    seqs: Vec<u32>,
    appended: Vec<u32>,
}

impl NgramStep {
    pub fn num_seqs(&self) -> usize {
        self.seqs.len() / SEQ_WORDS
    }

    /// A sequence whose history is `pool` row `row`: its first `keep` tokens stay, `appended`
    /// follows them; up to `k` draft tokens from n-grams of `min_n..=max_n` tokens (1 <= min_n <=
    /// max_n).
    pub fn push(
        &mut self,
        row: usize,
        keep: usize,
        appended: &[u32],
        k: usize,
        [min_n, max_n]: [usize; 2],
    ) -> Result<()> {
        if min_n == 0 || min_n > max_n {
            return Err(Error::Internal(format!("n-gram step: 1 <= min_n ({min_n}) <= max_n ({max_n}) is required")));
        }
        let entry = [row, keep, appended.len(), self.appended.len(), k, min_n, max_n];
        self.seqs.extend(entry.map(|x| x as u32));
        self.appended.extend_from_slice(appended);
        self.max_k = self.max_k.max(k);
        Ok(())
    }

    /// The descriptor: header, sequences, appended tokens.
    pub fn words(&self) -> Vec<u32> {
        let header = [self.num_seqs() as u32, self.max_k as u32];
        [&header[..], &self.seqs, &self.appended].concat()
    }

    /// The output's words: `[B, 1 + max_k]`.
    pub fn output_words(&self) -> usize {
        self.num_seqs() * (1 + self.max_k)
    }

    /// Refuses a pool `[rows, max_len]` a sequence's row or history does not fit, and two
    /// sequences on one row (their appends would race).
    pub fn check_pool(&self, rows: usize, max_len: usize) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for entry in self.seqs.chunks(SEQ_WORDS) {
            let (row, len) = (entry[0] as usize, entry[1] as usize + entry[2] as usize);
            if row >= rows || len > max_len || !seen.insert(row) {
                return Err(Error::Internal(format!(
                    "n-gram step: row {row} (a history of {len} tokens) does not fit a pool of {rows} x {max_len}, \
                     or two sequences share it"
                )));
            }
        }
        Ok(())
    }

    /// Each sequence's draft from the output words.
    pub fn drafts(&self, out: &[u32]) -> Vec<Vec<u32>> {
        out.chunks(1 + self.max_k).map(|seq| seq[1..1 + seq[0] as usize].to_vec()).collect()
    }
}

/// The CPU reference of `cuda/ngram.cu`: `words` (`NgramStep::words`) applied to `pool` `[rows,
/// max_len]` (checked by `NgramStep::check_pool`): each sequence's tokens appended to its row,
/// then its lookup. Returns the output words `[B, 1 + max_k]`.
pub fn ngram_step(pool: &mut [u32], max_len: usize, words: &[u32]) -> Vec<u32> {
    let (num_seqs, max_k) = (words[0] as usize, words[1] as usize);
    let seqs = &words[HEADER_WORDS..HEADER_WORDS + SEQ_WORDS * num_seqs];
    let appended = &words[HEADER_WORDS + seqs.len()..];
    let mut out = vec![0u32; num_seqs * (1 + max_k)];
    for (entry, out) in seqs.chunks(SEQ_WORDS).zip(out.chunks_mut(1 + max_k)) {
        let [row, keep, num_new, start, k, min_n, max_n] =
            <[u32; SEQ_WORDS]>::try_from(entry).expect("seven words per sequence").map(|x| x as usize);
        let history = &mut pool[row * max_len..(row + 1) * max_len];
        history[keep..keep + num_new].copy_from_slice(&appended[start..start + num_new]);
        let draft = lookup_one(&history[..keep + num_new], min_n, max_n, k);
        out[0] = draft.len() as u32;
        out[1..1 + draft.len()].copy_from_slice(draft);
    }
    out
}

/// One batch of whole histories to look up drafts for (no pool kept: the Python binding and the
/// device check's form).
pub struct NgramInput<'a> {
    /// `[b, max_len]`; sequence s uses its first `lengths[s]` tokens.
    pub histories: &'a [u32],
    pub max_len: usize,
    /// `[b]`, each <= max_len.
    pub lengths: &'a [u32],
    pub min_n: usize,
    pub max_n: usize,
    /// Most draft tokens per sequence.
    pub k: usize,
}

impl NgramInput<'_> {
    /// The step of a fresh pool of one row per sequence, each appending its whole history.
    pub fn step(&self) -> Result<NgramStep> {
        let (batch, max_len) = (self.lengths.len(), self.max_len);
        if self.histories.len() != batch * max_len || self.lengths.iter().any(|&l| l as usize > max_len) {
            return Err(Error::Internal(format!(
                "batched n-gram lookup: histories has {} values for {batch} x {max_len}, and lengths must be \
                 <= {max_len}",
                self.histories.len()
            )));
        }
        let mut step = NgramStep::default();
        for (s, &len) in self.lengths.iter().enumerate() {
            let history = &self.histories[s * max_len..s * max_len + len as usize];
            step.push(s, 0, history, self.k, [self.min_n, self.max_n])?;
        }
        Ok(step)
    }

    /// `drafts` (the step's, `NgramStep::drafts`) as `[b, k]` (0-padded) and their lengths `[b]`.
    pub fn padded(&self, drafts: Vec<Vec<u32>>) -> (Vec<u32>, Vec<u32>) {
        let mut padded = vec![0u32; self.lengths.len() * self.k];
        for (s, draft) in drafts.iter().enumerate() {
            padded[s * self.k..s * self.k + draft.len()].copy_from_slice(draft);
        }
        (padded, drafts.iter().map(|draft| draft.len() as u32).collect())
    }
}

/// The drafts `[b, k]` (padded with 0) and their lengths `[b]`: `ngram_step` on a fresh pool.
pub fn ngram_lookup(input: &NgramInput) -> Result<(Vec<u32>, Vec<u32>)> {
    let step = input.step()?;
    let mut pool = vec![0u32; input.lengths.len() * input.max_len];
    Ok(input.padded(step.drafts(&ngram_step(&mut pool, input.max_len, &step.words()))))
}

fn lookup_one(history: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    let len = history.len();
    for n in (min_n..=max_n).rev().filter(|&n| n < len) {
        let suffix = &history[len - n..];
        // An occurrence ending at `end` < len (it may overlap the suffix), most recent first.
        if let Some(end) = (n..len).rev().find(|&end| &history[end - n..end] == suffix) {
            return &history[end..len.min(end + k)];
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proposer::ngram::NgramProposer;
    use crate::proposer::Proposer;

    #[test]
    fn equals_the_per_request_proposer_on_random_histories() {
        let (batch, max_len, k) = (40, 120, 5);
        let mut state = 12345u64;
        let mut histories = Vec::new();
        let mut lengths = Vec::new();
        for s in 0..batch {
            // Small alphabets make repeats, and so matches of every length, common.
            let alphabet = 2 + s as u64 % 6;
            let len = 1 + (s * 7) % max_len;
            for i in 0..max_len {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                histories.push(if i < len { ((state >> 33) % alphabet) as u32 } else { 99 });
            }
            lengths.push(len as u32);
        }
        for (min_n, max_n) in [(1, 1), (2, 4), (1, 5), (3, 3)] {
            let input = NgramInput { histories: &histories, max_len, lengths: &lengths, min_n, max_n, k };
            let (drafts, draft_lengths) = ngram_lookup(&input).unwrap();
            let mut non_empty = 0;
            for s in 0..batch {
                let history = &histories[s * max_len..s * max_len + lengths[s] as usize];
                let expected = NgramProposer::new(min_n, max_n).propose(history, k).unwrap().token_ids;
                let got = &drafts[s * k..s * k + draft_lengths[s] as usize];
                assert_eq!(got, &expected[..], "sequence {s}, n in {min_n}..={max_n}");
                non_empty += usize::from(!expected.is_empty());
            }
            assert!(non_empty > 0 && non_empty < batch, "both outcomes must occur ({non_empty}/{batch})");
        }
    }

    /// A pool kept across steps: each step appends only what a history gained (or all of a
    /// rewritten one), and every draft equals the proposer's on the whole history.
    #[test]
    fn a_pool_kept_between_steps_drafts_what_the_proposer_drafts() {
        let (rows, max_len) = (4, 64);
        let mut pool = vec![7u32; rows * max_len];
        let mut histories: Vec<Vec<u32>> = vec![Vec::new(); 3];
        let mut state = 99u64;
        let mut non_empty = 0;
        for step_index in 0..12 {
            let mut step = NgramStep::default();
            let mut held = Vec::new();
            for (s, history) in histories.iter_mut().enumerate() {
                let mut keep = history.len();
                if step_index == 6 && s == 1 {
                    // A rewritten history is appended whole.
                    history.reverse();
                    keep = 0;
                }
                for _ in 0..1 + (step_index + s) % 4 {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    history.push(((state >> 33) % 3) as u32);
                }
                // Sequence s lives in row 3 - s; k and n differ per sequence.
                step.push(3 - s, keep, &history[keep..], 2 + s, [1, 1 + s]).unwrap();
                held.push(history.clone());
            }
            step.check_pool(rows, max_len).unwrap();
            let drafts = step.drafts(&ngram_step(&mut pool, max_len, &step.words()));
            for (s, history) in held.iter().enumerate() {
                assert_eq!(&pool[(3 - s) * max_len..][..history.len()], &history[..], "step {step_index}");
                let expected = NgramProposer::new(1, 1 + s).propose(history, 2 + s).unwrap().token_ids;
                assert_eq!(drafts[s], expected, "step {step_index}, sequence {s}");
                non_empty += usize::from(!expected.is_empty());
            }
        }
        assert!(non_empty > 10, "{non_empty} drafts found");
        // Two sequences on one row, a row past the pool, a history past max_len: refused.
        let mut step = NgramStep::default();
        step.push(0, 0, &[1], 2, [1, 2]).unwrap();
        step.push(0, 0, &[2], 2, [1, 2]).unwrap();
        assert!(step.check_pool(rows, max_len).is_err());
        let mut step = NgramStep::default();
        step.push(4, 0, &[1], 2, [1, 2]).unwrap();
        assert!(step.check_pool(rows, max_len).is_err());
        let mut step = NgramStep::default();
        step.push(0, 60, &[1; 5], 2, [1, 2]).unwrap();
        assert!(step.check_pool(rows, max_len).is_err());
        assert!(NgramStep::default().push(0, 0, &[1], 2, [3, 2]).is_err());
    }

    #[test]
    fn bad_shapes_are_refused() {
        let input = |histories: &'static [u32], lengths: &'static [u32], min_n| NgramInput {
            histories,
            max_len: 2,
            lengths,
            min_n,
            max_n: 2,
            k: 3,
        };
        assert!(ngram_lookup(&input(&[1, 2, 3], &[2, 2], 1)).is_err());
        assert!(ngram_lookup(&input(&[1, 2, 3, 4], &[3, 2], 1)).is_err());
        assert!(ngram_lookup(&input(&[1, 2, 3, 4], &[2, 2], 0)).is_err());
    }
}
