//! Steps of several sessions in one target forward: their draft models' chains are drafted
//! together (`draft_chains`), each session plans its rows (`Session::plan`), the rows of all of
//! them become one `ForwardBatch` over their caches, every session's draft is verified in one
//! call on the host (`verify_once_and_commit`) or, on a GPU, one device call for every session
//! whose verdict needs its logits alone and one host call for the rest
//! (`verify_on_device_and_commit`; the device call's parts are prepared before the forward, so
//! its descriptor rides the forward's one upload: `DeviceVerify`), and each session commits its
//! verdict and hidden rows. The forward and the device's verification are launched first
//! (`launch_step`), and nothing is downloaded until `Launched::commit`: the scheduler's caller
//! works in between while the device runs the step.
//!
//! Invariant: because a row's logits do not depend on what else is in the forward (model/forward.rs;
//! bitwise on the CPU backend), a session stepped here yields exactly the tokens it yields stepped
//! alone. A failure of the shared forward fails the step of every session in it (their caches may
//! hold rows of that forward; no commit was reached, so they take no further step);
//! a failure in one session's plan or commit is that session's alone.

use std::sync::Arc;
use std::time::Instant;

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::Tensor;

use super::session::{ForwardTiming, LookupJob, PlanLimits, Session, StepOutput, StepPlan};
use crate::batch::tree_accept::PackedTrees;
use crate::error::{guard, Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{CarriedWords, ForwardBatch, ForwardOutput, SeqRows, Tap};
use crate::proposer::chains_together::{draft_chains_together, ChainsDrafted};
use crate::proposer::ngram_together::{draft_ngrams_together, MIN_TOGETHER};
use crate::proposer::suffix_together::draft_suffixes_together;
use crate::verify::batch::VerifyBatchBuilder;
use crate::verify::device::LaunchedVerdicts;
use crate::verify::host::verify_batch;

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
    draft_lookups(sessions.iter_mut().map(|s| (&mut **s, PlanLimits::default())));
    let mut plans: Vec<(usize, StepPlan)> = Vec::new();
    for (i, session) in sessions.iter_mut().enumerate() {
        match session.plan() {
            Ok(Some(plan)) => plans.push((i, plan)),
            Ok(None) => results[i] = Some(Ok(StepOutput::default())),
            Err(error) => results[i] = Some(Err(error)),
        }
    }
    if !plans.is_empty() {
        for (i, outcome) in forward_and_commit(sessions, plans)?.outcomes {
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

/// Looks up together, where the target runs, the n-gram chains and the suffix-tree chains the
/// sessions' next plans (within their limits) will draft (`ngram_together.rs`,
/// `suffix_together.rs`): on CUDA, each kind when at least `MIN_TOGETHER` draft by it. Returns how
/// many were looked up.
pub(super) fn draft_lookups<'a>(sessions: impl IntoIterator<Item = (&'a mut Session, PlanLimits)>) -> usize {
    let mut sessions = sessions.into_iter().peekable();
    let Some((first, _)) = sessions.peek() else { return 0 };
    let device = first.model().device().clone();
    // On the CPU (outside the GPU path's tests) no job is gathered: each request drafts alone.
    if !device.is_cuda() && !takes_the_device_path() {
        return 0;
    }
    let (mut ngrams, mut suffixes) = (Vec::new(), Vec::new());
    for (session, limits) in sessions {
        match session.lookup_job(limits) {
            Some(LookupJob::Ngram(job)) => ngrams.push(job),
            Some(LookupJob::Suffix(job)) => suffixes.push(job),
            None => {}
        }
    }
    let together = |jobs: usize| jobs >= MIN_TOGETHER || takes_the_device_path();
    let ngrams = if together(ngrams.len()) { draft_ngrams_together(&device, ngrams) } else { 0 };
    ngrams + if together(suffixes.len()) { draft_suffixes_together(&device, suffixes) } else { 0 }
}

/// What `forward_and_commit` did: each planned session's step (by its index in `sessions`, in plan
/// order), the forward's seconds, and how many verifier calls decided the step's drafts.
pub(super) struct Committed {
    pub outcomes: Vec<(usize, Result<StepOutput>)>,
    pub forward_s: f64,
    pub num_verifier_calls: usize,
    /// Seconds the host spent in the step's downloads (the verdicts, the host's logit rows):
    /// waiting for the device, where it still ran the step, and the copies themselves.
    pub wait_s: f64,
}

/// The shared forward over `plans` (session index, plan), then the step's verification and each
/// session's commit (a panic in one commit is that session's error alone): `launch_step`, then
/// `Launched::commit`. On the host, every session's draft is verified in ONE call
/// (`verify::host::verify_batch` over the step's logits as the forward returned them); on a GPU,
/// one device call for the sessions that need their logits alone and one host call for the rest
/// (`verify_on_device_and_commit`).
pub(super) fn forward_and_commit(sessions: &mut [&mut Session], plans: Vec<(usize, StepPlan)>) -> Result<Committed> {
    launch_step(sessions, plans)?.commit(sessions)
}

/// A step launched and not yet committed (`launch_step` .. `Launched::commit`): its forward, and
/// on a GPU the device verification behind it, enqueued on the device; nothing downloaded yet.
/// It holds no borrow of the sessions, so the caller may do other work (the step before's
/// outputs, new requests) while the device runs it; the sessions in it must not step or change
/// until it is committed (the scheduler defers their aborts).
pub(super) struct Launched {
    plans: Vec<(usize, StepPlan)>,
    /// Each plan's taps over its own rows.
    hidden: Vec<Result<Vec<(Tap, Tensor)>>>,
    out: ForwardOutput,
    forward: ForwardClock,
    /// On a GPU: the prepared verification, the host's logit rows as the upload carried them,
    /// and the device's verdicts launched (None: no sequence is the device's).
    device: Option<(DeviceVerify, Option<Tensor>, Option<Result<LaunchedVerdicts>>)>,
}

/// Launches the shared forward over `plans` (session index, plan) and, on a GPU, the device's
/// verification of the sessions that need their logits alone: no download, no host sync.
pub(super) fn launch_step(sessions: &mut [&mut Session], plans: Vec<(usize, StepPlan)>) -> Result<Launched> {
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
    // On a GPU the device's verification is prepared before the forward, so its descriptor rides
    // the forward's upload.
    let device_verify = (model.device().is_cuda() || takes_the_device_path())
        .then(|| DeviceVerify::prepare(sessions, &plans, model.info().vocab_size));
    let mut caches: Vec<&mut KvCache> = sessions
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| planned.contains(i))
        .map(|(_, session)| session.cache_mut())
        .collect();
    let lens: Vec<usize> = caches.iter().map(|cache| cache.len()).collect();
    let mut batch = ForwardBatch::new(&rows, &lens, taps.clone())?;
    batch.carried = device_verify.as_ref().and_then(DeviceVerify::carried);
    let clock = ForwardClock::start(model.device())?;
    let out = model.forward_batch(&batch, &mut caches)?;
    let forward = clock.stop(batch.num_rows())?;

    // Each session's taps over its own rows.
    let hidden: Vec<Result<Vec<(Tap, Tensor)>>> = session_taps
        .iter()
        .enumerate()
        .map(|(s, own_taps)| {
            let range = batch.seq_range(s);
            own_taps
                .iter()
                .map(|tap| {
                    let at = taps.iter().position(|t| t == tap).expect("the batch has every session's taps");
                    Ok((*tap, out.hidden[at].narrow(0, range.start, range.len())?))
                })
                .collect()
        })
        .collect();
    let device = match device_verify {
        Some(prepared) => {
            let (carried_host_rows, carried_trees) = prepared.sections(&out)?.unzip();
            let verdicts = match &prepared.packed {
                Ok(packed) if packed.num_seqs() > 0 => {
                    Some(crate::verify::device::launch_packed(packed, &out.logits, carried_trees.as_ref()))
                }
                _ => None,
            };
            Some((prepared, carried_host_rows, verdicts))
        }
        None => None,
    };
    Ok(Launched { plans, hidden, out, forward, device })
}

impl Launched {
    /// Waits for the step (the verdicts' download, or the logits' copy to the host), verifies
    /// what the host verifies, and commits each session's verdict.
    pub(super) fn commit(self, sessions: &mut [&mut Session]) -> Result<Committed> {
        let Launched { plans, hidden, out, forward, device } = self;
        match device {
            Some((prepared, host_rows, verdicts)) => verify_on_device_and_commit(
                sessions,
                plans,
                prepared,
                host_rows,
                verdicts,
                &out.logits,
                hidden,
                forward,
            ),
            None => verify_once_and_commit(sessions, plans, &out.logits, hidden, forward),
        }
    }
}

/// A GPU step's device verification, prepared before its forward (a session's part reads its
/// plan and random streams, never the forward's outputs): which verifier takes each plan, and
/// the packed trees of those the device decides.
struct DeviceVerify {
    /// One per plan, in plan order.
    verifiers: Vec<Verifier>,
    /// The forward's logit rows of the sessions the host verifies, in order.
    host_rows: Vec<u32>,
    /// The device's sequences packed (`verify::device::packed`), or why they could not be.
    packed: Result<PackedTrees>,
}

/// Who decides a plan's draft in a GPU step.
enum Verifier {
    /// The host's one verification (`Session::needs_only_its_logits` is false).
    Host,
    /// The device's: sequence s of the packed trees, or why the session's part failed.
    Device(Result<usize>),
    /// Nobody: a prompt chunk's plan yields no token.
    NoVerdict,
}

impl DeviceVerify {
    fn prepare(sessions: &[&mut Session], plans: &[(usize, StepPlan)], vocab_size: usize) -> Self {
        let mut builder = VerifyBatchBuilder::new(vocab_size);
        let (mut verifiers, mut root_rows, mut host_rows) = (Vec::with_capacity(plans.len()), Vec::new(), Vec::new());
        let mut logit_start = 0;
        for (i, plan) in plans {
            let root_row = logit_start;
            logit_start += plan.rows.logit_rows.len();
            let session = &*sessions[*i];
            verifiers.push(if !session.needs_only_its_logits(plan) {
                host_rows.extend(root_row as u32..logit_start as u32);
                Verifier::Host
            } else if !plan.yields_a_token() {
                Verifier::NoVerdict
            } else {
                Verifier::Device(guard(|| session.verify_part(plan, &mut builder)).map(|()| {
                    root_rows.push(root_row);
                    root_rows.len() - 1
                }))
            });
        }
        Self { verifiers, host_rows, packed: crate::verify::device::packed(&builder.batch(), &root_rows) }
    }

    /// What the forward's upload carries: the host's logit rows, then the packed trees and the
    /// kernel's room (`verify::device::carried`); `sections` reads them back.
    fn carried(&self) -> Option<CarriedWords> {
        let packed = self.packed.as_ref().ok().filter(|packed| packed.num_seqs() > 0);
        let trees = packed.map(crate::verify::device::carried).unwrap_or_default();
        if self.host_rows.is_empty() && trees.words.is_empty() {
            return None;
        }
        Some(CarriedWords { words: [&self.host_rows[..], &trees.words].concat(), room: trees.room })
    }

    /// Where `out`'s upload put what `carried` laid out: the host's logit rows `[host rows]` and
    /// the trees' buffer `[words + room]`; None where the forward carried nothing.
    fn sections(&self, out: &ForwardOutput) -> Result<Option<(Tensor, Tensor)>> {
        let Some(carried) = &out.carried else { return Ok(None) };
        let (num_host_rows, len) = (self.host_rows.len(), carried.words.dim(0)?);
        let host_rows = carried.words.narrow(0, 0, num_host_rows)?;
        Ok(Some((host_rows, carried.words.narrow(0, num_host_rows, len - num_host_rows)?)))
    }
}

/// The CUDA path of `forward_and_commit`: every session whose verdict needs its logits alone
/// (`Session::needs_only_its_logits`: greedy or temperature-only, one-hot drafts, no logprobs) in ONE
/// device verification where the logits are (`verify::device`: one kernel launch over the
/// logits in place, its descriptor carried by the forward's upload, the verdicts back in one
/// download); the others (processed logits, logprobs, top-k/top-p/min-p, draft probabilities) in
/// ONE host verification of their rows, gathered on the device and copied once
/// (`verify_once_and_commit`). Each implementation of the contract runs at most once per step.
#[allow(clippy::too_many_arguments)] // the launched step's parts (`Launched`), taken apart
fn verify_on_device_and_commit(
    sessions: &mut [&mut Session],
    plans: Vec<(usize, StepPlan)>,
    prepared: DeviceVerify,
    carried_host_rows: Option<Tensor>,
    launched: Option<Result<LaunchedVerdicts>>,
    logits: &Tensor,
    hidden: Vec<Result<Vec<(Tap, Tensor)>>>,
    forward: ForwardClock,
) -> Result<Committed> {
    let verify_started = Instant::now();
    // The sessions the host verifies.
    let (mut host_plans, mut host_hidden) = (Vec::new(), Vec::new());
    let mut outcomes: Vec<(usize, Result<StepOutput>)> = Vec::with_capacity(plans.len());
    // (session index, plan, its taps, its sequence among the packed trees) of the sessions
    // verified on the device.
    let mut together = Vec::new();
    for (((i, plan), hidden), verifier) in plans.into_iter().zip(hidden).zip(prepared.verifiers) {
        if let Verifier::Host = verifier {
            host_plans.push((i, plan));
            host_hidden.push(hidden);
            continue;
        }
        let session = &mut *sessions[i];
        let context =
            hidden.and_then(|hidden| guard(|| session.commit_context(&plan, &hidden)).map(|done| (done, hidden)));
        match (context, verifier) {
            (Ok((false, hidden)), Verifier::Device(Ok(s))) => together.push((i, plan, hidden, s)),
            (Ok((false, _)), Verifier::Device(Err(error))) => outcomes.push((i, Err(error))),
            (Ok(_), _) => outcomes.push((i, Ok(StepOutput::default()))),
            (Err(error), _) => outcomes.push((i, Err(error))),
        }
    }
    let (mut num_verifier_calls, mut wait_s) = (0, 0.0);
    if !together.is_empty() {
        num_verifier_calls += 1;
        let download_started = Instant::now();
        // The verdicts' download waits for the forward: its time is known from here on.
        let launched = launched.unwrap_or_else(|| Err(Error::Internal("no device verification was launched".into())));
        let verified = prepared.packed.and(launched).and_then(LaunchedVerdicts::download).and_then(|verdicts| {
            let timing = forward.timing()?;
            Ok((verdicts, timing, forward.seconds_after(timing, verify_started)))
        });
        wait_s += download_started.elapsed().as_secs_f64();
        match verified {
            Ok((verdicts, forward, verify_s)) => {
                for (i, plan, hidden, s) in together {
                    let (accepted, next_token) = (verdicts.accepted(s), verdicts.next_tokens[s]);
                    // No host logits: these sessions neither process them nor report logprobs.
                    let outcome = guard(|| {
                        sessions[i].commit_verdict(plan, accepted, next_token, 0, &[], &hidden, forward, verify_s)
                    });
                    outcomes.push((i, outcome));
                }
            }
            Err(error) => {
                for (i, ..) in together {
                    outcomes.push((i, Err(Error::Internal(format!("the step's verification failed: {error}")))));
                }
            }
        }
    }
    if !host_plans.is_empty() {
        let host_logits = if prepared.host_rows.is_empty() {
            logits.narrow(0, 0, 0)? // prompt chunks only: nothing to verify
        } else {
            let rows = match carried_host_rows {
                Some(rows) => rows,
                None => crate::model::candle::upload(&prepared.host_rows, logits.device())?,
            };
            logits.index_select(&rows, 0)?
        };
        let host = verify_once_and_commit(sessions, host_plans, &host_logits, host_hidden, forward.clone())?;
        outcomes.extend(host.outcomes);
        num_verifier_calls += host.num_verifier_calls;
        wait_s += host.wait_s;
    }
    Ok(Committed { outcomes, forward_s: forward.timing()?.seconds, num_verifier_calls, wait_s })
}

/// Whether this thread's CPU steps take the GPU's path (`cfg(test)` only: the tests of that path
/// run it on the CPU, where `verify::device` runs the tree kernel's reference and the n-gram
/// lookups run together through theirs, whatever their number).
fn takes_the_device_path() -> bool {
    #[cfg(test)]
    return tests::DEVICE_PATH.get();
    #[cfg(not(test))]
    return false;
}

/// The host path of `forward_and_commit`: each session's part of the one verification
/// (`Session::verify_part`: its draft, rule and random inputs), ONE `verify_batch` over the
/// forward's logits as they are (copied only when some session processes its rows: grammar,
/// penalties, bias), then each session's commit of its verdict.
fn verify_once_and_commit(
    sessions: &mut [&mut Session],
    plans: Vec<(usize, StepPlan)>,
    logits: &Tensor,
    hidden: Vec<Result<Vec<(Tap, Tensor)>>>,
    forward: ForwardClock,
) -> Result<Committed> {
    let verify_started = Instant::now();
    let vocab = logits.dim(1)?;
    let mut outcomes: Vec<Option<(usize, Result<StepOutput>)>> = (0..plans.len()).map(|_| None).collect();
    // (plan index, session index, plan, its logit values among the forward's, its taps)
    let mut verifying = Vec::with_capacity(plans.len());
    let mut next_row = 0;
    for (p, ((i, plan), hidden)) in plans.into_iter().zip(hidden).enumerate() {
        let values = next_row * vocab..(next_row + plan.rows.logit_rows.len()) * vocab;
        next_row += plan.rows.logit_rows.len();
        let session = &mut *sessions[i];
        let outcome =
            hidden.and_then(|hidden| guard(|| session.commit_context(&plan, &hidden)).map(|done| (done, hidden)));
        match outcome {
            Ok((false, hidden)) => verifying.push((p, i, plan, values, hidden)),
            Ok((true, _)) => outcomes[p] = Some((i, Ok(StepOutput::default()))),
            Err(error) => outcomes[p] = Some((i, Err(error))),
        }
    }
    // The forward's logits `[R, vocab]` in place (CPU storage), or this thread's copy of them
    // where some session processes its rows.
    let logits = logits.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let (storage, layout) = logits.storage_and_layout();
    let download_started = Instant::now();
    let on_host: Vec<f32>;
    let forward_logits: &[f32] = match &*storage {
        candle_core::Storage::Cpu(cpu) => {
            let start = layout.start_offset();
            &cpu.as_slice::<f32>()?[start..start + layout.shape().elem_count()]
        }
        _ => {
            on_host = logits.flatten_all()?.to_vec1()?;
            &on_host
        }
    };
    let wait_s = download_started.elapsed().as_secs_f64();
    // The copy above waited for the forward: its time is known from here on.
    let clock = forward;
    let forward = clock.timing()?;
    let processing = verifying.iter().any(|(_, i, ..)| sessions[*i].processes_logits());
    let mut processed = HOST_LOGITS.with_borrow_mut(std::mem::take);
    if processing {
        processed.clear();
        processed.extend_from_slice(forward_logits);
    }
    let mut builder = VerifyBatchBuilder::new(vocab);
    verifying.retain(|(p, i, plan, values, _)| {
        let session = &mut *sessions[*i];
        let part = guard(|| {
            if processing {
                session.process_logits(plan, &mut processed[values.clone()])?;
            }
            session.verify_part(plan, &mut builder)
        });
        if let Err(error) = part {
            outcomes[*p] = Some((*i, Err(error)));
        }
        outcomes[*p].is_none()
    });
    let host: &[f32] = if processing { &processed } else { forward_logits };
    let num_verifier_calls = usize::from(!verifying.is_empty());
    if !verifying.is_empty() {
        // The verified sessions' logit rows in order: the forward's own, unless a session left.
        let num_values: usize = verifying.iter().map(|(_, _, _, values, _)| values.len()).sum();
        let compacted: Vec<f32>;
        let batch_logits = if num_values == host.len() {
            host
        } else {
            compacted =
                verifying.iter().flat_map(|(_, _, _, values, _)| host[values.clone()].iter().copied()).collect();
            compacted.as_slice()
        };
        match verify_batch(&builder.batch(), batch_logits) {
            Ok(verdicts) => {
                let verify_s = clock.seconds_after(forward, verify_started);
                for (s, (p, i, plan, values, hidden)) in verifying.into_iter().enumerate() {
                    let session = &mut *sessions[i];
                    let (accepted, next_token) = (verdicts.accepted(s), verdicts.next_tokens[s]);
                    let uniforms_used = verdicts.uniforms_used[s] as usize;
                    let outcome = guard(|| {
                        session.commit_verdict(
                            plan,
                            accepted,
                            next_token,
                            uniforms_used,
                            &host[values],
                            &hidden,
                            forward,
                            verify_s,
                        )
                    });
                    outcomes[p] = Some((i, outcome));
                }
            }
            Err(error) => {
                for (p, i, ..) in verifying {
                    outcomes[p] = Some((i, Err(Error::Internal(format!("the step's verification failed: {error}")))));
                }
            }
        }
    }
    HOST_LOGITS.with_borrow_mut(|buffer| *buffer = processed);
    let outcomes = outcomes.into_iter().map(|o| o.expect("every plan has an outcome")).collect();
    Ok(Committed { outcomes, forward_s: forward.seconds, num_verifier_calls, wait_s })
}

/// How long a step's forward ran, without a wait of its own: on CUDA two events around its
/// launches on candle's stream, read once the step has waited for the device anyway (the
/// verdicts' download, the logits' copy); on the CPU the forward returns done and the wall clock
/// says it.
#[derive(Clone)]
pub(super) struct ForwardClock {
    /// When the forward's launches began.
    started: Instant,
    rows: usize,
    /// On the CPU: the forward's seconds, known when it returned.
    seconds: f64,
    /// On CUDA: the events recorded before and after the forward's launches.
    #[cfg(feature = "cuda")]
    events: Option<Arc<(CudaEvent, CudaEvent)>>,
}

/// A forward's clock, running (`ForwardClock::start` .. `stop`).
pub(super) struct RunningClock {
    started: Instant,
    #[cfg(feature = "cuda")]
    start_event: Option<(Arc<CudaStream>, CudaEvent)>,
}

/// A timing event recorded on `stream` (cudarc's default flags disable timing).
#[cfg(feature = "cuda")]
fn timing_event(stream: &CudaStream) -> Result<CudaEvent> {
    let flags = Some(candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    stream.record_event(flags).map_err(|e| crate::nvrtc::device_error("recording a timing event", e))
}

impl ForwardClock {
    /// Starts timing the forward about to be launched on `device`.
    fn start(device: &candle_core::Device) -> Result<RunningClock> {
        #[cfg(feature = "cuda")]
        let start_event = match device {
            candle_core::Device::Cuda(cuda) => {
                let stream = cuda.cuda_stream();
                let event = timing_event(&stream)?;
                Some((stream, event))
            }
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Ok(RunningClock {
            started: Instant::now(),
            #[cfg(feature = "cuda")]
            start_event,
        })
    }

    /// The forward's timing: on CUDA, once the step has waited for the forward (reading the
    /// events waits for them otherwise).
    fn timing(&self) -> Result<ForwardTiming> {
        #[cfg(feature = "cuda")]
        if let Some(events) = &self.events {
            let ms = events
                .0
                .elapsed_ms(&events.1)
                .map_err(|e| crate::nvrtc::device_error("reading the forward's events", e))?;
            return Ok(ForwardTiming { seconds: f64::from(ms) / 1e3, rows: self.rows });
        }
        Ok(ForwardTiming { seconds: self.seconds, rows: self.rows })
    }

    /// The seconds since `since` that came after the forward ended: a verification started
    /// while the device still ran the forward is not charged for waiting on it (on the CPU the
    /// forward ended before any verification began: all of them).
    fn seconds_after(&self, forward: ForwardTiming, since: Instant) -> f64 {
        let after = self.started.elapsed().as_secs_f64() - forward.seconds;
        since.elapsed().as_secs_f64().min(after).max(0.0)
    }
}

impl RunningClock {
    /// Stops the clock after the launches of a forward over `rows` rows.
    fn stop(self, rows: usize) -> Result<ForwardClock> {
        Ok(ForwardClock {
            started: self.started,
            rows,
            seconds: self.started.elapsed().as_secs_f64(),
            #[cfg(feature = "cuda")]
            events: match self.start_event {
                Some((stream, start)) => Some(Arc::new((start, timing_event(&stream)?))),
                None => None,
            },
        })
    }
}

thread_local! {
    /// The processed copy of a step's logits, kept between steps: a batch's logits run to tens of
    /// MB (16 sequences x 5 rows x Gemma 3's 262,144 tokens: 84 MB), past the allocator's reuse,
    /// so a fresh buffer per step came back from the kernel zeroed, page by page (Gemma 3 at 16
    /// requests decoded 0.82x of verifying session by session with a fresh copy each step).
    static HOST_LOGITS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
pub(super) mod tests {
    use std::cell::Cell;
    use std::path::PathBuf;

    use super::*;
    use crate::config::SamplingParams;
    use crate::kv_cache::KvLayout;
    use crate::model::candle::UPLOADS;
    use crate::model::{EagerReason, GraphMode, GraphStatus};
    use crate::proposer::{Draft, Proposer, TreeLimits};
    use crate::spec_config::SpeculativeConfig;
    use crate::Engine;

    thread_local! {
        /// `takes_the_device_path` on this thread.
        pub(in crate::engine) static DEVICE_PATH: Cell<bool> = const { Cell::new(false) };
    }

    const PROMPT: [u32; 6] = [7, 12, 19, 7, 12, 3];
    const MAX_TOKENS: usize = 20;

    /// Drafts the request's own plain output (a chain, or a tree whose right branch sits beside a
    /// wrong sibling), wrong at depth 2 every third draft.
    struct Replay {
        expected: Vec<u32>,
        step: usize,
    }

    impl Replay {
        fn right(&mut self, context: &[u32], depth: usize) -> Vec<u32> {
            self.step += 1;
            let start = (context.len() - PROMPT.len()).min(self.expected.len());
            let mut right: Vec<u32> = self.expected[start..].iter().take(depth).copied().collect();
            if self.step % 3 == 0 && right.len() > 2 {
                right[2] ^= 1;
            }
            right
        }
    }

    impl Proposer for Replay {
        fn propose(&mut self, context: &[u32], max_tokens: usize) -> Result<Draft> {
            Ok(Draft::tokens(self.right(context, max_tokens)))
        }

        fn propose_tree(&mut self, context: &[u32], max_depth: usize, limits: TreeLimits) -> Result<Draft> {
            let right = self.right(context, max_depth.min(limits.max_nodes.saturating_sub(1)));
            let Some(&first) = right.first() else { return Ok(Draft::default()) };
            // The wrong sibling first on odd steps, second on even ones.
            let (tokens, parents): (Vec<u32>, Vec<i32>) = if self.step % 2 == 1 {
                let chain = right.iter().enumerate().map(|(d, &t)| (t, if d == 0 { -1 } else { d as i32 }));
                std::iter::once((first ^ 1, -1)).chain(chain).unzip()
            } else {
                let chain = right.iter().enumerate().map(|(d, &t)| (t, d as i32 - 1));
                chain.chain(std::iter::once((first ^ 1, -1))).unzip()
            };
            Ok(Draft::tree(tokens, parents))
        }
    }

    /// Requests of every kind the GPU step splits: greedy and seeded coupled chains and trees and
    /// plain decoding (its device verification), top-k and logprobs ones (its host verification),
    /// each drafting its own plain output (`expected`, None: plain), stepped together to the end.
    /// Returns each request's tokens and drafts.
    fn run(device_path: bool, expected: Option<&[Vec<u32>]>) -> Vec<(Vec<u32>, usize)> {
        run_counting_uploads(device_path, expected, false, GraphMode::Off).0
    }

    /// `run`, on a paged pool (the candle decoder's device pool, on the CPU) when `paged`, its
    /// steps captured in `graphs` mode; per step `(uploads, whether a request the host verifies
    /// took part)`, and where the captured steps stood at the end.
    fn run_counting_uploads(
        device_path: bool,
        expected: Option<&[Vec<u32>]>,
        paged: bool,
        graphs: GraphMode,
    ) -> (Vec<(Vec<u32>, usize)>, Vec<(usize, bool)>, Option<GraphStatus>) {
        DEVICE_PATH.set(device_path);
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/hf/llama");
        let mut engine = Engine::load(dir, "cpu").unwrap();
        if paged {
            engine = engine.with_kv_layout(KvLayout::Paged { block_size: 16, num_blocks: 64 }).unwrap();
        }
        engine.model().capture_steps(graphs, usize::MAX);
        let seeded = |seed| SamplingParams { temperature: 0.8, seed: Some(seed), ..SamplingParams::greedy(MAX_TOKENS) };
        let requests = [
            (SamplingParams::greedy(MAX_TOKENS), false),
            (seeded(1), true),
            (seeded(2), false),
            (SamplingParams { top_k: 5, ..seeded(3) }, false),
            (SamplingParams { logprobs: Some(2), ..SamplingParams::greedy(MAX_TOKENS) }, true),
            (seeded(4), false),
        ];
        let mut sessions: Vec<Session> = requests
            .into_iter()
            .enumerate()
            .map(|(i, (params, tree))| {
                let shape = if tree { r#", "tree": true, "tree_top_k": 2"# } else { "" };
                let json = format!(
                    r#"{{"method": "custom", "num_speculative_tokens": 4, "adaptive_draft_length": false{shape}}}"#
                );
                // The last request decodes plainly: only its prompt is cut into chunks.
                let speculation = expected.filter(|_| i < 5).map(|expected| {
                    let replay = Replay { expected: expected[i].clone(), step: 0 };
                    engine.speculation(&SpeculativeConfig::from_json(&json).unwrap(), Some(Box::new(replay))).unwrap()
                });
                engine.start(PROMPT.to_vec(), SamplingParams { ignore_eos: true, ..params }, speculation).unwrap()
            })
            .collect();
        sessions[5].set_prefill_chunk(Some(4)).unwrap();
        let mut steps = Vec::new();
        while sessions.iter().any(|s| !s.is_finished()) {
            // Requests 3 (top-k) and 4 (logprobs) are the host's.
            let host_verified = !sessions[3].is_finished() || !sessions[4].is_finished();
            let uploads = UPLOADS.with(Cell::get);
            let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
            for result in step_together(&mut refs).unwrap() {
                result.unwrap();
            }
            steps.push((UPLOADS.with(Cell::get) - uploads, host_verified));
        }
        DEVICE_PATH.set(false);
        let outputs = sessions.iter().map(|s| (s.generated_ids().to_vec(), s.metrics().spec.num_drafts)).collect();
        (outputs, steps, engine.step_graph_status())
    }

    /// N-gram requests stepped together on the GPU path look their chains up together (on the CPU
    /// through the kernel's reference over the shared histories): every request emits the host
    /// path's tokens with the same drafts, and each step uploads its lookup beside its
    /// verification.
    #[test]
    fn ngram_chains_looked_up_together_draft_what_each_request_drafts_alone() {
        let json = r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "adaptive_draft_length": false}"#;
        lookups_together_draft_what_each_request_drafts_alone(json, 0);
    }

    /// The same for suffix decoding, after two requests whose responses the global tree holds.
    #[test]
    fn suffix_chains_looked_up_together_draft_what_each_request_drafts_alone() {
        let json = r#"{"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": false}"#;
        lookups_together_draft_what_each_request_drafts_alone(json, 2);
    }

    /// Four greedy requests of `json`'s lookup method (after `finished_before` requests run to
    /// their end on the same engine), stepped together on the host path and on the device path
    /// (each step's lookups together through the kernel's reference): the same tokens and
    /// drafts, and one lookup upload per decoding step beside the verification's.
    fn lookups_together_draft_what_each_request_drafts_alone(json: &str, finished_before: u32) {
        let run = |device_path: bool| {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/hf/llama");
            let engine = Engine::load(dir, "cpu").unwrap();
            let config = SpeculativeConfig::from_json(json).unwrap();
            let prompt = |i: u32| -> Vec<u32> { (0..12).map(|t| 3 + (t * (i + 1)) % 5).collect() };
            // Long enough for the random model's greedy output to fall into loops.
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(96) };
            for i in 0..finished_before {
                let mut session =
                    engine.start(prompt(i), params.clone(), Some(engine.speculation(&config, None).unwrap())).unwrap();
                while !session.is_finished() {
                    session.step().unwrap();
                }
            }
            DEVICE_PATH.set(device_path);
            let mut sessions: Vec<Session> = (0..4u32)
                .map(|i| {
                    engine.start(prompt(i), params.clone(), Some(engine.speculation(&config, None).unwrap())).unwrap()
                })
                .collect();
            let (uploads, mut steps) = (UPLOADS.with(Cell::get), 0);
            while sessions.iter().any(|s| !s.is_finished()) {
                let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
                for result in step_together(&mut refs).unwrap() {
                    result.unwrap();
                }
                steps += 1;
            }
            DEVICE_PATH.set(false);
            let outputs: Vec<_> = sessions
                .iter()
                .map(|s| {
                    let spec = &s.metrics().spec;
                    (s.generated_ids().to_vec(), spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
                })
                .collect();
            (outputs, UPLOADS.with(Cell::get) - uploads, steps)
        };
        let (host, host_uploads, host_steps) = run(false);
        let (together, uploads, steps) = run(true);
        assert_eq!((together, steps), (host.clone(), host_steps));
        // Beside the forwards' (the same on both paths): one verification and one lookup per
        // decoding step (the prompt's step looks nothing up).
        let extra = uploads - host_uploads;
        assert!(extra >= 2 * (steps - 1), "{extra} more uploads in {steps} steps");
        assert!(host.iter().all(|(_, drafts, ..)| *drafts > 3), "{host:?}");
        assert!(host.iter().map(|(.., accepted)| accepted).sum::<usize>() > 0, "{host:?}");
    }

    /// On a paged pool a GPU step uploads once: the forward's descriptor carries the device
    /// verification's packed trees (and room for its scratch and output) and the logit rows the
    /// host's verification gathers. Every request emits the host path's tokens with the same
    /// drafts; on contiguous caches the forward carries nothing and each verification uploads
    /// its own.
    #[test]
    fn a_paged_gpu_step_carries_its_verification_in_its_one_upload() {
        let plain: Vec<Vec<u32>> = run(false, None).into_iter().map(|(ids, _)| ids).collect();
        let host = run(false, Some(&plain));
        let (paged, steps, _) = run_counting_uploads(true, Some(&plain), true, GraphMode::Off);
        assert_eq!(paged, host);
        assert!(steps.iter().any(|&(_, host_verified)| host_verified), "steps with the host's requests");
        assert!(steps.iter().any(|&(_, host_verified)| !host_verified), "steps without them");
        for (step, &(uploads, _)) in steps.iter().enumerate() {
            assert_eq!(uploads, 1, "step {step}");
        }
        let (contiguous, steps, _) = run_counting_uploads(true, Some(&plain), false, GraphMode::Off);
        assert_eq!(contiguous, host);
        // The forward's tokens, positions and logit rows, the device's trees, the host's rows.
        assert_eq!(steps[1].0, 5, "{steps:?}");
    }

    /// The same steps captured and replayed (`step_graphs.rs`, emulated on the CPU: each replay
    /// runs the capture's launches again over its entry's buffer, rewritten): every request emits
    /// the host path's tokens with the same drafts, each step still uploads once (its carried
    /// verification read from the entry's buffer), and most steps replay a captured one.
    #[test]
    fn a_replayed_gpu_step_emits_the_eager_steps_tokens() {
        let plain: Vec<Vec<u32>> = run(false, None).into_iter().map(|(ids, _)| ids).collect();
        let host = run(false, Some(&plain));
        let (replayed, steps, status) = run_counting_uploads(true, Some(&plain), true, GraphMode::Emulated);
        assert_eq!(replayed, host);
        for (step, &(uploads, _)) in steps.iter().enumerate() {
            assert_eq!(uploads, 1, "step {step}");
        }
        let status = status.expect("the candle decoder captures steps");
        let eager: u64 = status.num_eager.values().sum();
        assert!(status.num_captures >= 2 && status.num_replays > eager, "{status:?} over {} steps", steps.len());
        assert_eq!(status.num_eager[&EagerReason::Busy], 0, "each step's carried words are read before the next");
        assert_eq!(status.num_captures + status.num_replays + eager, steps.len() as u64, "{status:?}");
    }

    /// The GPU step's split verification (one device batch, one host batch of the rest), run on
    /// the CPU through the tree kernel's reference: every request, drafting or not, emits its
    /// plain output and drafts as on the host path.
    #[test]
    fn the_gpu_steps_split_verification_emits_the_host_paths_tokens() {
        let plain: Vec<Vec<u32>> = run(false, None).into_iter().map(|(ids, _)| ids).collect();
        let host = run(false, Some(&plain));
        let split = run(true, Some(&plain));
        assert_eq!(split, host);
        for (i, (ids, drafts)) in split.iter().enumerate() {
            assert_eq!(ids, &plain[i], "request {i}: speculative output is plain output");
            assert!(i == 5 || *drafts > 3, "request {i} drafted {drafts} times");
        }
    }
}
