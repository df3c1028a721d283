//! Steps of several sessions in one target forward: their draft models' chains are drafted
//! together (`draft_chains`), each session plans its rows (`Session::plan`), the rows of all of
//! them become one `ForwardBatch` over their caches, and each session commits its own logits and
//! hidden rows (`Session::commit`).
//!
//! Invariant: because a row's logits do not depend on what else is in the forward (model/forward.rs;
//! bitwise on the CPU backend), a session stepped here yields exactly the tokens it yields stepped
//! alone. A failure of the shared forward fails the step of every session in it (their caches may
//! hold rows of that forward; `Session::commit` was not reached, so they take no further step);
//! a failure in one session's plan or commit is that session's alone.

use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;

use super::session::{PlanLimits, Session, StepOutput, StepPlan};
use crate::error::{guard, Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{ForwardBatch, SeqRows, Tap};
use crate::proposer::chains_together::{draft_chains_together, ChainsDrafted};

/// One step of every session in `sessions` (finished ones yield nothing), their forwards run as
/// one. All sessions must run on one model. Returns each session's step result, in order.
pub fn step_together(sessions: &mut [&mut Session]) -> Result<Vec<Result<StepOutput>>> {
    if let Some(first) = sessions.first() {
        let model = first.model().clone();
        if sessions.iter().any(|s| !Arc::ptr_eq(s.model(), &model)) {
            return Err(Error::config("step_together gathers sessions of one engine; step the others separately"));
        }
    }
    let mut results: Vec<Option<Result<StepOutput>>> = (0..sessions.len()).map(|_| None).collect();
    draft_chains(sessions.iter_mut().map(|s| (&mut **s, PlanLimits::default())));
    let mut plans: Vec<(usize, StepPlan)> = Vec::new();
    for (i, session) in sessions.iter_mut().enumerate() {
        match session.plan() {
            Ok(Some(plan)) => plans.push((i, plan)),
            Ok(None) => results[i] = Some(Ok(StepOutput::default())),
            Err(error) => results[i] = Some(Err(error)),
        }
    }
    if !plans.is_empty() {
        for (i, outcome) in forward_and_commit(sessions, plans)?.0 {
            results[i] = Some(outcome);
        }
    }
    Ok(results.into_iter().map(|r| r.expect("every session has a result")).collect())
}

/// Drafts together the draft-model chains the sessions' next plans (within their limits) will
/// draft (`chains_together.rs`), so each draft model runs one forward per depth for all of them.
pub(super) fn draft_chains<'a>(sessions: impl IntoIterator<Item = (&'a mut Session, PlanLimits)>) -> ChainsDrafted {
    draft_chains_together(sessions.into_iter().filter_map(|(session, limits)| session.chain_job(limits)).collect())
}

/// Each planned session's step (by its index in `sessions`), and the forward's seconds.
pub(super) type Committed = (Vec<(usize, Result<StepOutput>)>, f64);

/// The shared forward over `plans` (session index, plan), then each session's commit (a panic in
/// one commit is that session's error alone).
pub(super) fn forward_and_commit(sessions: &mut [&mut Session], plans: Vec<(usize, StepPlan)>) -> Result<Committed> {
    let session_taps: Vec<Vec<Tap>> = plans.iter().map(|(i, _)| sessions[*i].taps()).collect();
    let mut taps: Vec<Tap> = Vec::new();
    for tap in session_taps.iter().flatten() {
        if !taps.contains(tap) {
            taps.push(*tap);
        }
    }
    let rows: Vec<SeqRows> = plans.iter().map(|(_, plan)| plan.rows.clone()).collect();
    let planned: Vec<usize> = plans.iter().map(|(i, _)| *i).collect();
    let model = sessions[planned[0]].model().clone();
    let mut caches: Vec<&mut KvCache> = sessions
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| planned.contains(i))
        .map(|(_, session)| session.cache_mut())
        .collect();
    let lens: Vec<usize> = caches.iter().map(|cache| cache.len()).collect();
    let batch = ForwardBatch::new(&rows, &lens, taps.clone())?;
    let t0 = Instant::now();
    let out = model.forward_batch(&batch, &mut caches)?;
    out.logits.device().synchronize()?;
    let forward_s = t0.elapsed().as_secs_f64();

    let mut logit_start = 0;
    let mut committed = Vec::with_capacity(plans.len());
    for (s, ((i, plan), own_taps)) in plans.into_iter().zip(session_taps).enumerate() {
        let num_logits = plan.rows.logit_rows.len();
        let logits = out.logits.narrow(0, logit_start, num_logits)?;
        logit_start += num_logits;
        let range = batch.seq_range(s);
        let hidden = own_taps
            .iter()
            .map(|tap| {
                let at = taps.iter().position(|t| t == tap).expect("the batch has every session's taps");
                Ok((*tap, out.hidden[at].narrow(0, range.start, range.len())?))
            })
            .collect::<Result<Vec<(Tap, Tensor)>>>();
        let session = &mut *sessions[i];
        let outcome = hidden.and_then(|hidden| guard(|| session.commit(plan, &logits, &hidden, forward_s)));
        committed.push((i, outcome));
    }
    Ok((committed, forward_s))
}
