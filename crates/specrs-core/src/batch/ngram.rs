//! Batched n-gram lookup: for every sequence, the prompt-lookup draft of `proposer::ngram`.
//!
//! The rule is `NgramProposer`'s (see its module docs): for n from max_n down to min_n, find the
//! most recent earlier occurrence of the history's last n tokens and propose up to k tokens that
//! followed it. The per-request proposer keeps an incremental index; this is the stateless scan a
//! device kernel does in parallel over positions (`cuda/ngram.cu`).
//!
//! Invariant: for every sequence, the draft equals `NgramProposer::propose(history, k)`.

use crate::error::{Error, Result};

/// One batch of histories to look up drafts for.
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
    /// The input contract shared with the device kernel.
    pub fn check(&self) -> Result<()> {
        let (batch, max_len, min_n, max_n) = (self.lengths.len(), self.max_len, self.min_n, self.max_n);
        if self.histories.len() != batch * max_len
            || self.lengths.iter().any(|&l| l as usize > max_len)
            || min_n == 0
            || min_n > max_n
        {
            return Err(Error::Internal(format!(
                "batched n-gram lookup: histories has {} values for {batch} x {max_len}, lengths must be <= \
                 {max_len}, and 1 <= min_n ({min_n}) <= max_n ({max_n})",
                self.histories.len()
            )));
        }
        Ok(())
    }
}

/// The CPU reference of `cuda/ngram.cu`: the drafts `[b, k]` (padded with 0) and their lengths `[b]`.
pub fn ngram_lookup(input: &NgramInput) -> Result<(Vec<u32>, Vec<u32>)> {
    input.check()?;
    let (batch, max_len, k) = (input.lengths.len(), input.max_len, input.k);
    let mut drafts = vec![0u32; batch * k];
    let mut draft_lengths = vec![0u32; batch];
    for s in 0..batch {
        let history = &input.histories[s * max_len..s * max_len + input.lengths[s] as usize];
        let draft = lookup_one(history, input.min_n, input.max_n, k);
        drafts[s * k..s * k + draft.len()].copy_from_slice(draft);
        draft_lengths[s] = draft.len() as u32;
    }
    Ok((drafts, draft_lengths))
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
