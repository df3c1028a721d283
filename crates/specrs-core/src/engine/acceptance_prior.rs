//! The acceptance a model-based draft's policy assumes before a request has verified a draft:
//! measured once per engine and draft, from its first requests' drafts.
//!
//! Why: the draft-length policy starts each request at a = 0.5 (`draft_length.rs`), and a draft
//! model's first draft, which reads the whole prompt, is made only if that prior says it pays. For
//! a costly draft that accepts well (Qwen2.5-Coder-0.5B under 1.5B: c = 0.37, a = 0.9) the prior
//! never says so, no request drafts, and nothing is ever learned. So until this engine has seen
//! `DRAFTS_TO_LAND` verified drafts of a draft, its requests try their first draft whatever the
//! prior says (`AcceptancePrior::exploring`); then the per-token acceptance of those drafts lands
//! as the prior of every later request (`AcceptancePrior::measured`), which may say not to draft,
//! with their acceptance at each depth that `MIN_REACHED` of them reached (what a request's
//! reading of its prompt is weighed with: `DraftLengthPolicy::pays_back`).
//!
//! Not for configs with "verification": "rejection": there a seeded request's sampled tokens
//! depend on its draft lengths, so its policy keeps the uninformed prior and its output does not
//! depend on what the engine ran before.
//!
//! Invariant: a request reads its prior once, at its start, and a draft's figure changes at most
//! once per engine (when it lands), as the cost figures do (`cost_model.rs`); it changes which
//! drafts are made, never output (greedy or coupled).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::lock;
use crate::draft_length::AcceptancePrior;
use crate::error::Result;

/// Verified drafts of a draft that make its engine figure.
pub const DRAFTS_TO_LAND: usize = 32;
/// Drafts that must reach a depth for its acceptance to land (past the first such depth, the
/// per-token figure stands for every depth).
pub const MIN_REACHED: usize = 8;

/// Per-token acceptance of each model-based draft (by `Engine::draft_identity`) in this engine.
#[derive(Default)]
pub struct AcceptanceFigures {
    figures: Mutex<HashMap<String, Figure>>,
}

#[derive(Default)]
struct Figure {
    num_drafts: usize,
    /// Per depth d + 1: drafts with a token there whose earlier tokens all passed, and those
    /// whose token there passed too. `passed` sums to the drafts' accepted tokens, `reached` to
    /// those plus the drafts' rejections (a draft reaches a depth it does not pass exactly when
    /// it ends in a rejection).
    reached: Vec<usize>,
    passed: Vec<usize>,
    /// The per-token acceptance and the acceptance by depth, once `DRAFTS_TO_LAND` drafts were
    /// seen.
    landed: Option<(f64, Vec<f64>)>,
}

impl AcceptanceFigures {
    /// The prior a new request of `draft` starts with, and where its drafts go while the figure
    /// is not measured (None once it is).
    pub fn prior(self: &Arc<Self>, draft: &str) -> Result<(AcceptancePrior, Option<AcceptanceRecorder>)> {
        Ok(match lock(&self.figures)?.get(draft).and_then(|f| f.landed.clone()) {
            Some((acceptance, by_depth)) => (AcceptancePrior::measured(acceptance, by_depth), None),
            None => (
                AcceptancePrior::exploring(),
                Some(AcceptanceRecorder { figures: self.clone(), draft: draft.to_string() }),
            ),
        })
    }

    /// The landed per-token acceptance of `draft`, if any.
    pub fn landed(&self, draft: &str) -> Result<Option<f64>> {
        Ok(lock(&self.figures)?.get(draft).and_then(|f| f.landed.as_ref().map(|(a, _)| *a)))
    }

    fn record(&self, draft: &str, num_draft_tokens: usize, num_accepted_tokens: usize) -> Result<()> {
        let mut figures = lock(&self.figures)?;
        let figure = figures.entry(draft.to_string()).or_default();
        if figure.landed.is_some() || num_draft_tokens == 0 {
            return Ok(());
        }
        figure.num_drafts += 1;
        let reached_depths = num_draft_tokens.min(num_accepted_tokens + 1);
        if figure.reached.len() < reached_depths {
            figure.reached.resize(reached_depths, 0);
            figure.passed.resize(reached_depths, 0);
        }
        for depth in 0..reached_depths {
            figure.reached[depth] += 1;
            figure.passed[depth] += usize::from(depth < num_accepted_tokens);
        }
        if figure.num_drafts >= DRAFTS_TO_LAND {
            // The policy's estimator: accepted tokens over accepted tokens plus rejections, that
            // is over every depth a draft reached.
            let (accepted, reached) = (figure.passed.iter().sum::<usize>(), figure.reached.iter().sum::<usize>());
            let by_depth = (figure.reached.iter().zip(&figure.passed))
                .take_while(|(&reached, _)| reached >= MIN_REACHED)
                .map(|(&reached, &passed)| passed as f64 / reached as f64)
                .collect();
            figure.landed = Some((accepted as f64 / reached.max(1) as f64, by_depth));
        }
        Ok(())
    }
}

/// Where a request that started before its draft's figure landed reports its verified drafts.
pub struct AcceptanceRecorder {
    figures: Arc<AcceptanceFigures>,
    draft: String,
}

impl AcceptanceRecorder {
    pub fn record(&self, num_draft_tokens: usize, num_accepted_tokens: usize) -> Result<()> {
        self.figures.record(&self.draft, num_draft_tokens, num_accepted_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draft_explores_until_its_figure_lands_once() {
        let figures = Arc::new(AcceptanceFigures::default());
        let (prior, recorder) = figures.prior("draft_model:a").unwrap();
        assert_eq!(prior, AcceptancePrior::exploring());
        let recorder = recorder.unwrap();
        for i in 0..DRAFTS_TO_LAND - 1 {
            // 3 of 4 accepted, a rejection every time: 3 / (3 + 1) per token.
            recorder.record(4, 3).unwrap();
            recorder.record(0, 0).unwrap(); // no draft: not counted
            assert_eq!(figures.landed("draft_model:a").unwrap(), None, "after {} drafts", i + 1);
        }
        recorder.record(4, 3).unwrap();
        assert_eq!(figures.landed("draft_model:a").unwrap(), Some(0.75));
        // Later drafts of requests that started exploring do not move it.
        recorder.record(4, 0).unwrap();
        let (prior, recorder) = figures.prior("draft_model:a").unwrap();
        // Every draft passed depths 1-3 and failed at 4.
        assert_eq!((prior, recorder.is_none()), (AcceptancePrior::measured(0.75, vec![1.0, 1.0, 1.0, 0.0]), true));
        // Another draft has its own figure.
        assert_eq!(figures.prior("draft_model:b").unwrap().0, AcceptancePrior::exploring());
    }

    /// A depth's acceptance counts the drafts that reached it (their earlier tokens passed) and
    /// lands only as deep as `MIN_REACHED` drafts got.
    #[test]
    fn the_acceptance_by_depth_counts_the_drafts_that_reached_each_depth() {
        let figures = Arc::new(AcceptanceFigures::default());
        let recorder = figures.prior("draft_model:a").unwrap().1.unwrap();
        for i in 0..DRAFTS_TO_LAND {
            // 24 one-token drafts, 18 of them passed; then 8 three-token drafts: 6 pass depth 1
            // (of those, 3 pass depth 2 and 1 of those depth 3).
            let (tokens, accepted) = match i {
                0..18 => (1, 1),
                18..24 => (1, 0),
                24..26 => (3, 0),
                26..29 => (3, 1),
                29..31 => (3, 2),
                _ => (3, 3),
            };
            recorder.record(tokens, accepted).unwrap();
        }
        // Depth 1: 24 of 32 passed; depth 2: 3 of 6 (fewer than MIN_REACHED: not landed).
        let (prior, _) = figures.prior("draft_model:a").unwrap();
        let (accepted, rejections) = (18 + 3 + 4 + 3, 6 + 2 + 3 + 2);
        assert_eq!(prior, AcceptancePrior::measured(accepted as f64 / (accepted + rejections) as f64, vec![0.75]));
    }
}
