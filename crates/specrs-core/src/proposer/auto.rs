//! `"method": "auto"`: one proposer that picks, at each step, the drafter with the most expected
//! tokens per unit of cost. The drafters are the model-free lookups (suffix decoding, n-gram) and,
//! when the config names one, a model drafter: a draft model or a hidden-state head
//! (`"draft_method"`). Each keeps its own acceptance estimate on this request
//! (`DraftLengthPolicy`) and its own cost: a lookup costs nothing to draft (c = 0), a model
//! drafter c per draft token (in target steps, measured per engine); all share the target's
//! verification curve v(n). Below, "the model" is the model drafter of either kind.
//!
//! A step: every lookup drafts first (microseconds), and its draft's length bounds its best
//! length; the draft model's best length is bounded by k only, and it drafts only if chosen, so a
//! step a lookup wins costs no draft forward. The winner is the drafter whose best length
//! promises the highest expected tokens per unit of cost (`DraftLengthPolicy::plan`); ties go to
//! the earlier drafter, lookups before the model. A lookup with no verified draft yet is judged at
//! its best positive length (trying it is free); the draft model is charged for the context it has
//! not read yet (`Drafter::plan_model`). No drafter with a positive length leaves the step without
//! a draft. E.g. a suffix match of 12 tokens costs nothing and wins; an empty lookup
//! falls back to the draft model; a request whose draft model keeps missing decodes plainly.
//!
//! A grammar's forced run opens auto's drafts as it opens a lookup's: after such unverified
//! tokens a step chooses among the lookups only (`propose_with`), since a model drafter reads
//! verified positions only.
//!
//! A scheduler that drafts model chains together (`chains_together.rs`) asks for the step's choice
//! ahead (`model_chain`); the step's `propose` then takes that choice rather than choosing again,
//! so each step is judged once, as alone.
//!
//! Invariant: one drafter's draft is verified per step, and only that drafter observes the
//! verdict; a drafter left out keeps its state (the draft model's cache catches up on the context
//! it missed at its next draft, `DraftCache::catch_up`; a head keeps the target's hidden rows of
//! every step, which auto hands it whoever drafted, and reads those it missed at its next draft).
//! The choice reads only the context and past verdicts, never the verifier's random stream, so
//! auto is lossless like every proposer.

use crate::config::SamplingParams;
use crate::costs::DraftCost;
use crate::draft_length::{DraftLengthPolicy, Verdict};
use crate::error::Result;
use crate::metrics::DrafterCounts;
use crate::model::Tap;
use crate::proposer::draft_model::DraftModelProposer;
use crate::proposer::{Draft, Feedback, ProposeInput, Proposer};
use candle_core::Tensor;

/// One drafter "auto" chooses among.
struct Drafter {
    proposer: Box<dyn Proposer>,
    /// Its acceptance on this request and its cost c (0 for a lookup).
    policy: DraftLengthPolicy,
    /// A lookup drafts before the choice (it costs nothing); a model only when chosen.
    is_lookup: bool,
    /// The longest draft it makes (k; a parallel head: its sub-heads).
    max_tokens: usize,
    counts: DrafterCounts,
}

/// The model drafter "auto" may pick besides the lookups: a draft model or a hidden-state head.
pub struct ModelDrafter {
    /// Its method's name (`metrics["drafters"]`).
    pub name: &'static str,
    pub proposer: Box<dyn Proposer>,
    /// c: its drafting time over one target step, per token or per draft.
    pub draft_cost: DraftCost,
    /// The longest draft it makes.
    pub max_tokens: usize,
}

impl Drafter {
    /// The draft model's length to draft and the speedup it promises, charged for reading the
    /// context it has not seen (the tokens other drafters' steps added, or the whole prompt before
    /// its first draft) in its first forward: the draft's own cost covers one row of it, each of
    /// the other `unseen - 1` rows adds c times the cost of a row (the verify curve's slope).
    /// On a 2-core CPU a 0.5B draft's prompt costs tens of target steps, so it is read only where
    /// the draft would win that back; where a draft forward is cheap (a GPU) it is read at once.
    /// Before its first verified draft the prior acceptance judges it (no free trial: it is not free).
    /// A recurrent head's cache reads one row per context position as a draft model's does, at
    /// its layer's share of c (`Proposer::context_row_share`: a row skips the LM head); a
    /// parallel head keeps none (`kv_len` None: nothing to read).
    fn plan_model(&self, max_len: usize, context_len: usize) -> Verdict {
        let unseen = context_len.saturating_sub(self.proposer.kv_len().unwrap_or(context_len)).max(1);
        let overhead = self.policy.catch_up_steps(unseen, self.proposer.context_row_share());
        self.policy.plan_with_overhead(max_len.min(self.max_tokens), overhead)
    }
}

pub struct AutoProposer {
    /// Lookups first, then the model drafter (if any).
    drafters: Vec<Drafter>,
    /// The drafter whose draft the last `propose` returned, and that draft's length.
    chosen: Option<(usize, usize)>,
    /// A step's choice made ahead of its `propose` (`model_chain`): context length, max_tokens and
    /// the choice, which that `propose` takes instead of choosing again.
    decided: Option<(usize, usize, Option<Choice>)>,
}

/// A step's drafter: its index, its plan, and a lookup's draft (a model drafts once chosen).
struct Choice {
    drafter: usize,
    plan: Verdict,
    draft: Option<Draft>,
}

impl AutoProposer {
    /// `verify_cost_ratios`: `[k + 1]` v(n) = t(n) / t(1); `lookups`: the model-free drafters by
    /// name; `model`: the model drafter, if any.
    pub fn new(
        verify_cost_ratios: &[f64],
        lookups: Vec<(&'static str, Box<dyn Proposer>)>,
        model: Option<ModelDrafter>,
    ) -> Self {
        let drafter = |name: &'static str, proposer, is_lookup, draft_cost, max_tokens| Drafter {
            proposer,
            policy: DraftLengthPolicy::new(verify_cost_ratios, draft_cost),
            is_lookup,
            max_tokens,
            counts: DrafterCounts { name, ..DrafterCounts::default() },
        };
        let mut drafters: Vec<Drafter> = lookups
            .into_iter()
            .map(|(name, proposer)| drafter(name, proposer, true, DraftCost::FREE, usize::MAX))
            .collect();
        drafters.extend(model.map(|m| drafter(m.name, m.proposer, false, m.draft_cost, m.max_tokens)));
        Self { drafters, chosen: None, decided: None }
    }

    /// The step's drafter (see the module header), among the lookups only with `lookups_only`;
    /// None: no drafter with a positive length.
    fn choose(&mut self, context: &[u32], max_tokens: usize, lookups_only: bool) -> Result<Option<Choice>> {
        let mut best: Option<Choice> = None;
        for (i, drafter) in self.drafters.iter_mut().enumerate().filter(|(_, d)| d.is_lookup || !lookups_only) {
            let (plan, draft) = if drafter.is_lookup {
                let draft = drafter.proposer.propose(context, max_tokens)?;
                if draft.token_ids.is_empty() {
                    continue; // no match: nothing learned about its acceptance
                }
                // c = 0: before its first verified draft, `plan` judges it at its best positive
                // length (trying it is free).
                (drafter.policy.plan(draft.token_ids.len()), Some(draft))
            } else {
                (drafter.plan_model(max_tokens, context.len()), None)
            };
            if plan.length == 0 {
                // Judged not to pay: its evidence ages, so it is tried again after a while.
                drafter.policy.skipped();
                continue;
            }
            if best.as_ref().is_none_or(|b| plan.predicted_speedup > b.plan.predicted_speedup) {
                best = Some(Choice { drafter: i, plan, draft });
            }
        }
        Ok(best)
    }

    /// The draft of the step's `choice`: a lookup's, cut to its planned length, or the model
    /// drafter's, drafted now; the drafter is noted for `observe`.
    fn draft_of(&mut self, choice: Option<Choice>, context: &[u32]) -> Result<Draft> {
        let Some(Choice { drafter: i, plan, draft }) = choice else { return Ok(Draft::default()) };
        let draft = match draft {
            Some(mut draft) => {
                draft.truncate(plan.length, 0); // a lookup's draft has no probability rows
                draft
            }
            None => self.drafters[i].proposer.propose(context, plan.length)?,
        };
        if !draft.token_ids.is_empty() {
            self.chosen = Some((i, draft.token_ids.len()));
        }
        Ok(draft)
    }
}

impl Proposer for AutoProposer {
    fn begin(&mut self, prompt: &[u32], params: &SamplingParams) -> Result<()> {
        self.decided = None;
        self.drafters.iter_mut().try_for_each(|d| d.proposer.begin(prompt, params))
    }

    fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
        self.chosen = None;
        let choice = match self.decided.take() {
            Some((context_len, max, choice)) if context_len == context.len() && max == max_tokens => choice,
            _ => self.choose(context, max_tokens, false)?,
        };
        self.draft_of(choice, context)
    }

    /// The step's choice, made now and kept for its `propose`: the draft model's chain where the
    /// model wins.
    fn model_chain(&mut self, context: &[u32], max_tokens: usize) -> Result<Option<(&mut DraftModelProposer, usize)>> {
        let choice = self.choose(context, max_tokens, false)?;
        let model = choice.as_ref().filter(|c| c.draft.is_none()).map(|c| (c.drafter, c.plan.length));
        self.decided = Some((context.len(), max_tokens, choice));
        match model {
            Some((i, length)) => self.drafters[i].proposer.model_chain(context, length),
            None => Ok(None),
        }
    }

    /// Its lookups draft from their context alone, so the session may open auto's drafts with
    /// the grammar's forced run, as for suffix or n-gram; a step after one chooses among the
    /// lookups only (`propose_with`).
    fn drafts_after_unverified_tokens(&self) -> bool {
        true
    }

    /// `propose`, but after unverified tokens (a forced run) only a lookup may draft: a model
    /// drafter reads verified positions only (a draft model's cache, a head's hidden states).
    fn propose_with(&mut self, input: ProposeInput<'_>) -> Result<Draft> {
        if input.num_unverified == 0 {
            return self.propose(input.context, input.max_tokens);
        }
        self.decided = None;
        self.chosen = None;
        let choice = self.choose(input.context, input.max_tokens, true)?;
        self.draft_of(choice, input.context)
    }

    /// A head's taps (the lookups and a draft model read none).
    fn taps(&self) -> Vec<Tap> {
        self.drafters.iter().flat_map(|d| d.proposer.taps()).collect()
    }

    /// Every step's hidden rows go to the head whichever drafter drafted, so it sees every
    /// context position once (as its invariant asks), reading those it missed at its next draft.
    fn observe_hidden(&mut self, start: usize, hidden: &[Tensor]) -> Result<()> {
        self.drafters
            .iter_mut()
            .filter(|d| !d.proposer.taps().is_empty())
            .try_for_each(|d| d.proposer.observe_hidden(start, hidden))
    }

    fn target_context_dropped(&mut self) {
        self.drafters.iter_mut().for_each(|d| d.proposer.target_context_dropped());
    }

    fn observe(&mut self, feedback: &Feedback<'_>) -> Result<()> {
        let Some((i, num_draft_tokens)) = self.chosen.take() else { return Ok(()) };
        let drafter = &mut self.drafters[i];
        drafter.policy.observe(num_draft_tokens, feedback.num_accepted_tokens);
        drafter.counts.num_drafts += 1;
        drafter.counts.num_draft_tokens += num_draft_tokens;
        drafter.counts.num_accepted_tokens += feedback.num_accepted_tokens;
        drafter.proposer.observe(feedback)
    }

    fn finish(&mut self, generated: &[u32]) {
        for drafter in &mut self.drafters {
            drafter.proposer.finish(generated);
        }
    }

    fn kv_len(&self) -> Option<usize> {
        self.drafters.iter().find_map(|d| d.proposer.kv_len())
    }

    fn drafter_counts(&self) -> Vec<DrafterCounts> {
        self.drafters.iter().map(|d| d.counts.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A drafter that returns `tokens[..max_tokens]` and logs how often it was asked; with
    /// `kv_len`, a draft model whose cache holds that many positions.
    struct Fixed {
        tokens: Vec<u32>,
        calls: Arc<Mutex<Vec<usize>>>,
        kv_len: Option<usize>,
    }

    impl Proposer for Fixed {
        fn propose(&mut self, _context: &[u32], max_tokens: usize) -> Result<Draft> {
            self.calls.lock().unwrap().push(max_tokens);
            Ok(Draft::tokens(self.tokens.iter().copied().take(max_tokens).collect()))
        }

        fn kv_len(&self) -> Option<usize> {
            self.kv_len
        }
    }

    fn fixed(tokens: &[u32]) -> (Box<dyn Proposer>, Arc<Mutex<Vec<usize>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        (Box::new(Fixed { tokens: tokens.to_vec(), calls: calls.clone(), kv_len: None }), calls)
    }

    fn draft_model(proposer: Box<dyn Proposer>, draft_cost: f64) -> Option<ModelDrafter> {
        Some(ModelDrafter {
            name: "draft_model",
            proposer,
            draft_cost: DraftCost::per_token(draft_cost),
            max_tokens: 16,
        })
    }

    /// A head: drafts `tokens` and logs the starts of the hidden rows it is handed.
    struct Head {
        tokens: Vec<u32>,
        calls: Arc<Mutex<Vec<usize>>>,
        hidden_starts: Arc<Mutex<Vec<usize>>>,
        dropped: Arc<Mutex<usize>>,
    }

    impl Proposer for Head {
        fn propose(&mut self, _context: &[u32], max_tokens: usize) -> Result<Draft> {
            self.calls.lock().unwrap().push(max_tokens);
            Ok(Draft::tokens(self.tokens.iter().copied().take(max_tokens).collect()))
        }

        fn taps(&self) -> Vec<Tap> {
            vec![Tap::Residual(2), Tap::FinalNorm]
        }

        fn observe_hidden(&mut self, start: usize, _hidden: &[Tensor]) -> Result<()> {
            self.hidden_starts.lock().unwrap().push(start);
            Ok(())
        }

        fn target_context_dropped(&mut self) {
            *self.dropped.lock().unwrap() += 1;
        }
    }

    #[test]
    fn a_head_sees_every_steps_hidden_rows_and_drafts_at_most_its_sub_heads() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let hidden_starts = Arc::new(Mutex::new(Vec::new()));
        let dropped = Arc::new(Mutex::new(0));
        let head = Head {
            tokens: vec![9; 8],
            calls: calls.clone(),
            hidden_starts: hidden_starts.clone(),
            dropped: dropped.clone(),
        };
        let (lookup, _) = fixed(&[5; 6]);
        let model = ModelDrafter {
            name: "mlp_speculator",
            proposer: Box::new(head),
            draft_cost: DraftCost::per_token(0.01),
            max_tokens: 3,
        };
        let mut auto = AutoProposer::new(&RATIOS, vec![("suffix", lookup)], Some(model));
        assert_eq!(auto.taps(), vec![Tap::Residual(2), Tap::FinalNorm], "the session must tap for the head");
        let rows = Tensor::zeros((1, 4), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        // The lookup wins while accepted whole; the head is handed each step's rows all the same.
        for start in 0..3 {
            auto.observe_hidden(start, &[rows.clone(), rows.clone()]).unwrap();
            let draft = step(&mut auto, 8, 8).token_ids;
            assert!(!draft.is_empty() && draft.iter().all(|&t| t == 5), "{draft:?}");
        }
        assert_eq!(*hidden_starts.lock().unwrap(), vec![0, 1, 2]);
        assert!(calls.lock().unwrap().is_empty(), "the head never drafted");
        // The lookup now rejected and the head accepted: the (nearly free) head takes over, asked
        // for at most its 3 tokens.
        let drafts: Vec<Vec<u32>> = (0..12)
            .map(|_| {
                let draft = auto.propose(&[1, 2, 3], 8).unwrap();
                let n = if draft.token_ids.first() == Some(&9) { draft.token_ids.len() } else { 0 };
                auto.observe(&Feedback::accepted(n, &draft.token_ids[..n], &(0..n).collect::<Vec<_>>())).unwrap();
                draft.token_ids
            })
            .collect();
        assert_eq!(drafts.last(), Some(&vec![9; 3]), "{drafts:?}");
        let lengths = calls.lock().unwrap().clone();
        assert!(lengths.iter().all(|&n| (1..=3).contains(&n)), "{lengths:?}");
        assert_eq!(auto.drafter_counts()[1].name, "mlp_speculator");
        auto.target_context_dropped();
        assert_eq!(*dropped.lock().unwrap(), 1);
    }

    #[test]
    fn a_draft_model_far_behind_the_context_drafts_only_where_reading_it_is_cheap() {
        let model = |kv_len, c| {
            let calls = Arc::new(Mutex::new(Vec::new()));
            let model = Box::new(Fixed { tokens: vec![9; 8], calls: calls.clone(), kv_len: Some(kv_len) });
            let (empty, _) = fixed(&[]);
            (AutoProposer::new(&RATIOS, vec![("suffix", empty)], draft_model(model, c)), calls)
        };
        // The context is [1, 2, 3]; a cache of 2 leaves one token unseen: no catch-up cost.
        let (mut caught_up, _) = model(2, 0.2);
        assert!(!step(&mut caught_up, 8, 0).token_ids.is_empty());
        // A cache of 0 leaves 3 unseen: 2 extra rows at c * 0.25 each would not pay at c = 0.2...
        let (mut behind, calls) = model(0, 0.2);
        assert!(step(&mut behind, 8, 0).token_ids.is_empty());
        assert!(calls.lock().unwrap().is_empty(), "the draft model never ran");
        // ...and pay where a draft forward is nearly free.
        let (mut cheap, _) = model(0, 0.01);
        assert!(!step(&mut cheap, 8, 0).token_ids.is_empty());
    }

    /// A verification curve of a 2-core CPU at a 1.5B model: v(n) = 1 + 0.25 (n - 1).
    const RATIOS: [f64; 9] = [1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0];

    /// Drafts once and reports `accepted` of the draft's tokens accepted.
    fn step(auto: &mut AutoProposer, max_tokens: usize, accepted: usize) -> Draft {
        let draft = auto.propose(&[1, 2, 3], max_tokens).unwrap();
        let n = accepted.min(draft.token_ids.len());
        auto.observe(&Feedback::accepted(n, &draft.token_ids[..n], &(0..n).collect::<Vec<_>>())).unwrap();
        draft
    }

    #[test]
    fn a_free_lookup_match_wins_and_an_empty_lookup_falls_back_to_the_model() {
        let (suffix, suffix_calls) = fixed(&[7; 12]);
        let (model, model_calls) = fixed(&[9; 16]);
        let mut auto = AutoProposer::new(&RATIOS, vec![("suffix", suffix)], draft_model(model, 0.4));
        // The lookup matched: drafted for free (first at the prior's best length, then, accepted,
        // at its whole match), and the model never ran.
        let first = step(&mut auto, 8, 8);
        assert!(!first.token_ids.is_empty() && first.token_ids.iter().all(|&t| t == 7));
        for _ in 0..8 {
            step(&mut auto, 8, 8);
        }
        assert_eq!(step(&mut auto, 8, 8).token_ids, vec![7; 8]);
        assert!(model_calls.lock().unwrap().is_empty());
        assert_eq!(auto.drafter_counts()[0].num_drafts, 10);
        assert_eq!(suffix_calls.lock().unwrap().len(), 10);

        // No match: the model drafts (at c = 0.2 its prior acceptance pays for one token).
        let (empty, _) = fixed(&[]);
        let (model, model_calls) = fixed(&[9; 16]);
        let mut auto = AutoProposer::new(&RATIOS, vec![("suffix", empty)], draft_model(model, 0.2));
        let draft = step(&mut auto, 8, 8);
        assert_eq!(draft.token_ids[0], 9);
        assert_eq!(model_calls.lock().unwrap().len(), 1);
        // Once accepted well, the model drafts longer; the counts say who drafted what.
        for _ in 0..9 {
            step(&mut auto, 8, 8);
        }
        let lengths = model_calls.lock().unwrap().clone();
        assert!(lengths.last() > lengths.first(), "{lengths:?}");
        let counts = auto.drafter_counts();
        assert_eq!((counts[0].name, counts[0].num_drafts), ("suffix", 0));
        assert_eq!((counts[1].name, counts[1].num_drafts), ("draft_model", 10));
        assert_eq!(counts[1].num_accepted_tokens, counts[1].num_draft_tokens);
    }

    #[test]
    fn a_model_that_keeps_missing_stops_drafting_and_a_well_accepted_lookup_beats_a_model() {
        let (empty, _) = fixed(&[]);
        let (model, model_calls) = fixed(&[9; 16]);
        let mut auto = AutoProposer::new(&RATIOS, vec![("ngram", empty)], draft_model(model, 0.4));
        for _ in 0..4 {
            step(&mut auto, 8, 0);
        }
        let tried = model_calls.lock().unwrap().len();
        assert!(tried < 4, "a rejected model was asked {tried} times in 4 steps");
        assert!(step(&mut auto, 8, 0).token_ids.is_empty(), "no drafter pays: plain decoding");

        // A lookup accepted whole beats a model accepted whole: the same tokens cost no drafting.
        let (lookup, _) = fixed(&[5; 4]);
        let (model, model_calls) = fixed(&[9; 16]);
        let mut auto = AutoProposer::new(&RATIOS, vec![("suffix", lookup)], draft_model(model, 0.4));
        let drafts: Vec<Vec<u32>> = (0..6).map(|_| step(&mut auto, 8, 8).token_ids).collect();
        assert!(drafts.iter().all(|d| !d.is_empty() && d.iter().all(|&t| t == 5)), "{drafts:?}");
        assert_eq!(drafts.last(), Some(&vec![5; 4]));
        assert!(model_calls.lock().unwrap().is_empty());
    }

    #[test]
    fn after_unverified_tokens_only_a_lookup_drafts() {
        let (empty, _) = fixed(&[]);
        let (lookup, _) = fixed(&[5; 4]);
        let (model, model_calls) = fixed(&[9; 16]);
        let mut auto = AutoProposer::new(&RATIOS, vec![("ngram", empty), ("suffix", lookup)], draft_model(model, 0.01));
        let mut cache = crate::kv_cache::KvCache::new(1, 4, 8, 8);
        let mut propose = |auto: &mut AutoProposer, num_unverified| {
            let input = ProposeInput {
                context: &[1, 2, 3],
                max_tokens: 8,
                tree: None,
                target_cache: &mut cache,
                num_unverified,
            };
            auto.propose_with(input).unwrap().token_ids
        };
        assert!(auto.drafts_after_unverified_tokens());
        let after_forced = propose(&mut auto, 2);
        assert!(!after_forced.is_empty() && after_forced.iter().all(|&t| t == 5), "{after_forced:?}");
        auto.observe(&Feedback::accepted(0, &[], &[])).unwrap();
        // The lookup rejected, the (nearly free) model wins a step after verified tokens only.
        assert!(model_calls.lock().unwrap().is_empty());
        for _ in 0..4 {
            propose(&mut auto, 2);
            auto.observe(&Feedback::accepted(0, &[], &[])).unwrap();
        }
        assert!(model_calls.lock().unwrap().is_empty(), "the model never drafts after unverified tokens");
        assert_eq!(propose(&mut auto, 0), vec![9; 1], "the prior's best length for the model");
    }

    #[test]
    fn of_two_lookups_the_better_accepted_one_wins() {
        let (good, _) = fixed(&[1; 6]);
        let (bad, _) = fixed(&[2; 6]);
        // "bad" comes first, so it wins the first (tied) step; its rejection hands the lead over.
        let mut auto = AutoProposer::new(&RATIOS, vec![("ngram", bad), ("suffix", good)], None);
        assert_eq!(step(&mut auto, 6, 0).token_ids[0], 2);
        assert_eq!(step(&mut auto, 6, 6).token_ids[0], 1);
        for _ in 0..3 {
            assert_eq!(step(&mut auto, 6, 6).token_ids[0], 1);
        }
        assert_eq!(auto.drafter_counts()[1].num_drafts, 4);
    }
}
