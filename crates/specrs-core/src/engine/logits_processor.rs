//! `LogitsProcessor`: one request's changes to the target's logits before sampling: the grammar's
//! token mask, `allowed_token_ids`, `bad_words`, `logit_bias`, `min_tokens`, and presence /
//! frequency / repetition penalties.
//!
//! Invariant (what keeps speculation exact): the row of every verified position is processed
//! with the state plain decoding has at that position: the tokens emitted so far plus the draft
//! tokens on the path to that row. The grammar has consumed them, the penalties count them, and
//! `min_tokens` counts them as generated. Verifying against processed rows therefore emits
//! exactly plain processed decoding's tokens (greedy) or distribution (sampling). A row below a
//! draft token the grammar forbids is never reached (that token's probability is 0 in its
//! parent's processed row, so it is rejected), and is left unprocessed.
//!
//! Order (vLLM's): grammar mask, allowed_token_ids, bad_words, logit_bias, min_tokens, then the
//! penalties; the sampler's temperature / top-k / top-p / min-p come after. A bad word's last
//! token is banned where the output (emitted tokens, then the path) ends with the rest of it.
//! `allowed_token_ids`, `bad_words` and `min_tokens` mask tokens only while some token stays
//! allowed: a grammar that admits nothing else wins over them, rather than leaving no token at all.

use std::collections::{HashMap, HashSet};

use crate::config::SamplingParams;
use crate::constraint::Constraint;
use crate::error::{Error, Result};
use crate::proposer::tree::path_tokens;

pub struct LogitsProcessor {
    constraint: Option<Constraint>,
    /// Some: only these tokens may be generated.
    allowed: Option<HashSet<u32>>,
    /// Token sequences of the bad words (each with and without a leading space).
    bad_words: Vec<Vec<u32>>,
    /// The output emitted so far (kept only when there are bad words to match against it).
    output: Vec<u32>,
    presence_penalty: f32,
    frequency_penalty: f32,
    repetition_penalty: f32,
    logit_bias: Vec<(u32, f32)>,
    min_tokens: usize,
    /// End-of-sequence and stop token ids: what `min_tokens` holds back.
    end_ids: Vec<u32>,
    /// How often each token occurs in the output emitted so far.
    output_counts: HashMap<u32, u32>,
    /// Tokens of the prompt (the repetition penalty counts them as well as the output's).
    prompt_tokens: HashSet<u32>,
    num_generated: usize,
}

impl LogitsProcessor {
    /// The processor of a request with `params`, `prompt` and end-of-sequence ids `eos`;
    /// `constraint` is its compiled grammar (None without one), `bad_words` its bad words'
    /// token sequences (`bad_words_token_ids`). None when nothing changes the logits.
    pub fn new(
        params: &SamplingParams,
        prompt: &[u32],
        eos: &[u32],
        constraint: Option<Constraint>,
        bad_words: Vec<Vec<u32>>,
    ) -> Option<Self> {
        if !params.changes_logits() {
            return None;
        }
        let mut end_ids: Vec<u32> = eos.to_vec();
        end_ids.extend(params.stop_token_ids.iter().filter(|t| !eos.contains(t)));
        let prompt_tokens =
            if params.repetition_penalty != 1.0 { prompt.iter().copied().collect() } else { HashSet::new() };
        Some(Self {
            constraint,
            allowed: params.allowed_token_ids.as_ref().map(|ids| ids.iter().copied().collect()),
            bad_words,
            output: Vec::new(),
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            repetition_penalty: params.repetition_penalty,
            logit_bias: params.logit_bias.clone(),
            min_tokens: params.min_tokens,
            end_ids,
            output_counts: HashMap::new(),
            prompt_tokens,
            num_generated: 0,
        })
    }

    pub fn has_grammar(&self) -> bool {
        self.constraint.is_some()
    }

    /// Processes the verified rows of a draft in place: `logits` `[num_rows, vocab_size]`, row r
    /// for the position after the draft tokens of `paths[r]` (the tokens between the output so
    /// far and that row: `[]` for the first row, a chain's first r tokens, a tree node's path).
    pub fn process_rows(&mut self, logits: &mut [f32], vocab_size: usize, paths: &[Vec<u32>]) -> Result<()> {
        if logits.len() != paths.len() * vocab_size {
            return Err(Error::Internal(format!(
                "logits processor: {} logits for {} rows of {vocab_size}",
                logits.len(),
                paths.len()
            )));
        }
        for (row, path) in logits.chunks_mut(vocab_size).zip(paths) {
            self.process_row(row, path)?;
        }
        Ok(())
    }

    /// One row `[vocab_size]` after the draft tokens `path`.
    fn process_row(&mut self, row: &mut [f32], path: &[u32]) -> Result<()> {
        if let Some(constraint) = self.constraint.as_mut() {
            if constraint.valid_prefix_len(path) < path.len() {
                return Ok(()); // never reached (module header)
            }
            constraint.consume(path)?;
            let masked = constraint.apply_to_logits(row);
            constraint.rollback(path.len())?;
            masked?;
        }
        if let Some(allowed) = &self.allowed {
            mask_unless_nothing_left(row, |token| !allowed.contains(&(token as u32)));
        }
        if !self.bad_words.is_empty() {
            let banned = self.bad_word_ends(path);
            mask_unless_nothing_left(row, |token| banned.contains(&token));
        }
        for &(token, bias) in &self.logit_bias {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit += bias;
            }
        }
        if self.num_generated + path.len() < self.min_tokens {
            let other_allowed = row
                .iter()
                .enumerate()
                .any(|(token, &logit)| logit > f32::NEG_INFINITY && !self.end_ids.contains(&(token as u32)));
            if other_allowed {
                for &token in &self.end_ids {
                    if let Some(logit) = row.get_mut(token as usize) {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
        }
        self.apply_penalties(row, path);
        Ok(())
    }

    /// The tokens a bad word bans after the output so far and `path`: each sequence's last token,
    /// where the output ends with the rest of the sequence (vLLM's `apply_bad_words`).
    fn bad_word_ends(&self, path: &[u32]) -> Vec<usize> {
        let mut banned = Vec::new();
        for word in &self.bad_words {
            let (last, prefix) = word.split_last().expect("bad word sequences are not empty");
            let n = prefix.len();
            if n > self.output.len() + path.len() {
                continue;
            }
            // The last n tokens of output ++ path.
            let from_path = n.min(path.len());
            let from_output = &self.output[self.output.len() - (n - from_path)..];
            let tail = from_output.iter().chain(&path[path.len() - from_path..]);
            if tail.eq(prefix.iter()) {
                banned.push(*last as usize);
            }
        }
        banned
    }

    /// vLLM's penalties: repetition over prompt + output, presence and frequency over the output
    /// (emitted tokens and `path`).
    fn apply_penalties(&self, row: &mut [f32], path: &[u32]) {
        let (presence, frequency, repetition) =
            (self.presence_penalty, self.frequency_penalty, self.repetition_penalty);
        if presence == 0.0 && frequency == 0.0 && repetition == 1.0 {
            return;
        }
        let mut counts = self.output_counts.clone();
        for &token in path {
            *counts.entry(token).or_insert(0) += 1;
        }
        if repetition != 1.0 {
            let seen = self.prompt_tokens.iter().chain(counts.keys());
            for &token in seen.collect::<HashSet<_>>() {
                if let Some(logit) = row.get_mut(token as usize) {
                    *logit = if *logit > 0.0 { *logit / repetition } else { *logit * repetition };
                }
            }
        }
        for (&token, &count) in &counts {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit -= frequency * count as f32 + presence;
            }
        }
    }

    /// How many leading tokens of a chain draft the grammar allows (all without a grammar).
    pub fn valid_draft_len(&mut self, draft: &[u32]) -> usize {
        match self.constraint.as_mut() {
            Some(constraint) => constraint.valid_prefix_len(draft),
            None => draft.len(),
        }
    }

    /// Whether the grammar allows each node of a tree draft (`parents`: -1 = below the newest
    /// token); a node below a forbidden one is forbidden.
    pub fn valid_tree_nodes(&mut self, token_ids: &[u32], parents: &[i32]) -> Vec<bool> {
        let Some(constraint) = self.constraint.as_mut() else { return vec![true; token_ids.len()] };
        let mut valid = Vec::with_capacity(token_ids.len());
        for node in 0..token_ids.len() {
            let parent_ok = parents[node] < 0 || valid[parents[node] as usize];
            let ok = parent_ok && {
                let path = path_tokens(token_ids, parents, node);
                constraint.valid_prefix_len(&path) == path.len()
            };
            valid.push(ok);
        }
        valid
    }

    /// The tokens the grammar forces next (at most `max`), in the tokenizer's canonical
    /// tokenization; empty without a grammar.
    pub fn forced_tokens(&mut self, max: usize) -> Vec<u32> {
        let Some(constraint) = self.constraint.as_mut() else { return Vec::new() };
        let mut forced = constraint.forced_tokens();
        forced.truncate(max);
        forced
    }

    /// Records tokens the output emitted (verified: accepted, recovered, bonus).
    pub fn accept(&mut self, tokens: &[u32]) -> Result<()> {
        if let Some(constraint) = self.constraint.as_mut() {
            constraint.consume(tokens)?;
        }
        for &token in tokens {
            *self.output_counts.entry(token).or_insert(0) += 1;
        }
        if !self.bad_words.is_empty() {
            self.output.extend_from_slice(tokens);
        }
        self.num_generated += tokens.len();
        Ok(())
    }

    /// Whether the grammar is complete (only an end-of-sequence token may follow).
    pub fn grammar_finished(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::is_finished)
    }
}

/// Sets the `banned` tokens of `row` to -inf, unless that would leave no token allowed.
fn mask_unless_nothing_left(row: &mut [f32], banned: impl Fn(usize) -> bool) {
    let left = row.iter().enumerate().any(|(token, &logit)| logit > f32::NEG_INFINITY && !banned(token));
    if left {
        for (token, logit) in row.iter_mut().enumerate() {
            if banned(token) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }
}

/// vLLM's token sequences of `bad_words`: each word (its leading whitespace stripped) tokenized
/// without special tokens, and again after a space when that tokenizes to as many tokens with a
/// different first one (the word inside a text). `encode` tokenizes without special tokens.
pub fn bad_words_token_ids(bad_words: &[String], encode: impl Fn(&str) -> Result<Vec<u32>>) -> Result<Vec<Vec<u32>>> {
    let mut sequences: Vec<Vec<u32>> = Vec::new();
    for word in bad_words {
        let bare = encode(word.trim_start())?;
        let spaced = encode(&format!(" {}", word.trim_start()))?;
        if bare.is_empty() {
            return Err(Error::config(format!("bad_words entry {word:?} tokenizes to no token; remove it")));
        }
        if spaced.len() == bare.len() && spaced[0] != bare[0] {
            sequences.push(bare);
            sequences.push(spaced);
        } else {
            sequences.push(bare);
        }
    }
    Ok(sequences)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processor(params: SamplingParams, prompt: &[u32]) -> LogitsProcessor {
        LogitsProcessor::new(&params, prompt, &[0], None, Vec::new()).expect("params change the logits")
    }

    #[test]
    fn nothing_to_do_is_none() {
        assert!(LogitsProcessor::new(&SamplingParams::default(), &[1], &[0], None, Vec::new()).is_none());
    }

    #[test]
    fn allowed_token_ids_mask_the_rest() {
        let mut p = processor(SamplingParams { allowed_token_ids: Some(vec![1, 3]), ..Default::default() }, &[]);
        let mut row = vec![1.0, 2.0, 3.0, 4.0];
        p.process_row(&mut row, &[]).unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(row, vec![inf, 2.0, inf, 4.0]);
        // A row where the allowed tokens are all ruled out already (a grammar) is left as it is.
        let mut row = vec![1.0, inf, 3.0, inf];
        p.process_row(&mut row, &[]).unwrap();
        assert_eq!(row, vec![1.0, inf, 3.0, inf]);
    }

    #[test]
    fn bad_words_ban_their_last_token_after_the_rest_counting_the_path() {
        let params = SamplingParams { bad_words: vec!["x".into()], ..Default::default() };
        // Sequences: [4] (a one-token word, banned everywhere) and [1, 2, 3].
        let mut p = LogitsProcessor::new(&params, &[], &[0], None, vec![vec![4], vec![1, 2, 3]]).unwrap();
        let inf = f32::NEG_INFINITY;
        let processed = |p: &mut LogitsProcessor, path: &[u32]| {
            let mut row = vec![0.0; 5];
            p.process_row(&mut row, path).unwrap();
            row
        };
        assert_eq!(processed(&mut p, &[]), [0.0, 0.0, 0.0, 0.0, inf]);
        assert_eq!(processed(&mut p, &[1, 2]), [0.0, 0.0, 0.0, inf, inf]);
        p.accept(&[1]).unwrap();
        assert_eq!(processed(&mut p, &[2]), [0.0, 0.0, 0.0, inf, inf], "the output's 1 and the path's 2");
        assert_eq!(processed(&mut p, &[]), [0.0, 0.0, 0.0, 0.0, inf]);
        p.accept(&[2]).unwrap();
        assert_eq!(processed(&mut p, &[]), [0.0, 0.0, 0.0, inf, inf]);
        assert_eq!(processed(&mut p, &[2]), [0.0, 0.0, 0.0, 0.0, inf]);
    }

    #[test]
    fn bad_words_are_tokenized_bare_and_after_a_space() {
        let encode = |text: &str| -> Result<Vec<u32>> {
            Ok(match text {
                "cat" => vec![7],
                " cat" => vec![8],
                "big dog" => vec![1, 2],
                " big dog" => vec![3, 2, 4],
                _ => vec![],
            })
        };
        let words = ["  cat".to_string(), "big dog".to_string()];
        assert_eq!(bad_words_token_ids(&words, encode).unwrap(), vec![vec![7], vec![8], vec![1, 2]]);
        assert!(bad_words_token_ids(&["zzz".to_string()], encode).unwrap_err().to_string().contains("zzz"));
    }

    #[test]
    fn penalties_count_the_path_as_plain_decoding_would() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        let mut p = processor(params.clone(), &[3]);
        p.accept(&[1, 1]).unwrap();
        // Row after the path [2]: output counts {1: 2, 2: 1}, prompt {3}.
        let mut row = vec![1.0, 4.0, -2.0, 6.0, 1.0];
        p.process_row(&mut row, &[2]).unwrap();
        assert_eq!(row, vec![1.0, 4.0 / 2.0 - 0.5 - 0.5, -2.0 * 2.0 - 0.25 - 0.5, 3.0, 1.0]);
        // The same as a processor that emitted [1, 1, 2] and processes the next row with no path.
        let mut q = processor(params, &[3]);
        q.accept(&[1, 1, 2]).unwrap();
        let mut same = vec![1.0, 4.0, -2.0, 6.0, 1.0];
        q.process_row(&mut same, &[]).unwrap();
        assert_eq!(row, same);
    }

    #[test]
    fn min_tokens_holds_back_end_tokens_until_reached() {
        let params =
            SamplingParams { min_tokens: 2, stop_token_ids: vec![4], max_tokens: 8, ..SamplingParams::default() };
        let mut p = processor(params, &[3]);
        let mut rows = [5.0, 1.0, 0.0, 0.0, 9.0].repeat(3);
        p.process_rows(&mut rows, 5, &[vec![], vec![1], vec![1, 2]]).unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(&rows[..5], &[inf, 1.0, 0.0, 0.0, inf]);
        assert_eq!(&rows[5..10], &[inf, 1.0, 0.0, 0.0, inf]);
        assert_eq!(&rows[10..], &[5.0, 1.0, 0.0, 0.0, 9.0]);
        // Only end tokens left: they stay.
        let mut only_end = vec![0.0, inf, inf, inf, 1.0];
        p.process_row(&mut only_end, &[]).unwrap();
        assert_eq!(only_end, vec![0.0, inf, inf, inf, 1.0]);
    }

    #[test]
    fn logit_bias_adds() {
        let mut p = processor(SamplingParams { logit_bias: vec![(2, 100.0), (0, -1.5)], ..Default::default() }, &[]);
        let mut row = vec![1.0, 1.0, 1.0];
        p.process_row(&mut row, &[]).unwrap();
        assert_eq!(row, vec![-0.5, 1.0, 101.0]);
    }
}
