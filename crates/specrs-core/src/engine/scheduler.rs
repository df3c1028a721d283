//! Continuous batching: every step gathers the rows of every running request into ONE target
//! forward (each request's newest token and draft, and chunks of prompts still being read), admits
//! waiting requests while KV memory allows, preempts when it does not, and budgets drafts by load.
//!
//! A step, in order:
//! 1. **Preempt** (recompute, as vLLM does): while the running requests' KV positions plus one row
//!    each (plus the whole draft of pinned requests) exceed the KV budget, the newest running
//!    request gives its target cache back and goes to the front of the queue, keeping its tokens,
//!    sampler and proposer; when readmitted it feeds its context again, chunked like a prompt.
//! 2. **Admit** waiting requests in arrival order (preempted ones first) while fewer than
//!    `max_num_seqs` run and the context of all of them, plus one row each, fits the KV budget:
//!    `max_kv_tokens` positions, or under a paged layout the pool's blocks (`kv_account.rs`, which
//!    counts prefix blocks shared by samples once).
//!    A request that does not fit blocks the ones behind it (first come, first served). Samples
//!    of one prompt (`add_samples`) share its prefill: the first is prefilled; each other one
//!    waits (holding the queue behind it) until the first's cache holds the prompt, starts with
//!    a copy of all its positions but the last, and feeds that last row itself (its first token
//!    is its own sample). Should the first end before that, or read the target's hidden states
//!    (a head, which a copied cache cannot feed), the others are prefilled like any request.
//! 3. **Rows** within `max_num_batched_tokens` (and the KV positions left): one decode row per
//!    decoding request, with the whole draft of pinned requests; then prompt (or recompute)
//!    chunks, oldest request first, at most `prefill_chunk` rows each (vLLM V1's chunked prefill
//!    mixed with decode); then drafts, from what is left, granted by `draft_budget::grant` (or,
//!    with `DraftBudget::Off`, each request's own length in arrival order, as a fixed-k server).
//! 4. **Draft** the draft-model chains of every request together, one draft forward per depth
//!    (`step_together::draft_chains`), and on CUDA the n-gram chains together in one device
//!    lookup and the suffix-tree chains in another (`step_together::draft_lookups`); the other
//!    proposers draft as each request plans.
//! 5. **Forward, verify and commit** (`step_together::launch_step`, `Launched::commit`): one
//!    forward, one verifier call for every request's draft (on the host), then each request's
//!    commit; its tokens, its end or its error come back as a `RequestOutput`.
//!
//! `step` is `launch` (1-4 and the launches of 5) then `finish` (the step's one download and the
//! commits). Between them the caller does what needs no token of this step (the server turns the
//! step before's outputs into client events and adds new requests) while the device runs it;
//! a running request aborted then ends after the step. The next `launch` refuses to come
//! before `finish`: no step plans from tokens the one before has not produced.
//!
//! Invariant (identical outputs): a request's tokens are exactly those it yields stepped alone.
//! Rows are computed bitwise independently of what else is in the forward (model/forward.rs), so
//! batching changes no logits; a recomputed cache equals the one it replaces; and the budget only
//! cuts drafts of requests whose tokens do not depend on their draft lengths (greedy, unseeded,
//! or one-hot drafts verified in coupled form: verify.rs). A request whose tokens would change
//! (seeded sampling with a draft model or head, or any seeded sampling verified on a GPU) is
//! *pinned*: it always gets the draft it would take alone, or sits the step out.
//! A failure in one request's plan or commit ends that request alone; a failure of the shared
//! forward ends every request in it (their caches hold its rows), and the scheduler goes on.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::kv_account::KvAccount;
use super::session::{Generation, PlanLimits, Session, StepPlan, TokenLogprobs};
use super::step_together::{draft_chains, draft_lookups, launch_step, Launched};
use super::{Engine, FinishReason, Speculation};
use crate::config::SamplingParams;
use crate::costs::CostSource;
use crate::draft_budget::{grant, BatchCost, DraftWish};
use crate::error::{guard, Error, Result};
use crate::metrics::RequestMetrics;
use crate::proposer::chains_together::ChainsDrafted;

/// How each step's draft tokens are decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftBudget {
    /// Spend draft rows where they buy the most tokens per second of the batch (`draft_budget.rs`).
    Load,
    /// Every request drafts what it would alone, whatever the load (vLLM's fixed k).
    Off,
}

impl DraftBudget {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "load" => Ok(Self::Load),
            "off" => Ok(Self::Off),
            other => Err(Error::config(format!("draft budget '{other}' is unknown; use 'load' or 'off'"))),
        }
    }

    /// The name `parse` takes for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Load => "load",
            Self::Off => "off",
        }
    }
}

/// Rows of the batched forward measured for the draft budget's cost curve (`Engine::batch_costs`);
/// past them the curve is extended along its last slope.
pub const BUDGET_CURVE_ROWS: usize = 32;

/// KV positions a newly admitted request reserves beyond its prompt (its cache grows by doubling
/// past them), so memory follows what requests hold rather than what they may one day need.
const RESERVE_SLACK: usize = 64;

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Requests running at once (vLLM's max_num_seqs).
    pub max_num_seqs: usize,
    /// Rows in one forward: decode rows, draft rows and prompt chunks (vLLM's max_num_batched_tokens).
    pub max_num_batched_tokens: usize,
    /// Target KV positions held by all running requests together (None: no bound but the context).
    pub max_kv_tokens: Option<usize>,
    /// Prompt (or recompute) rows per request per step (None: up to the token budget).
    pub prefill_chunk: Option<usize>,
    pub draft_budget: DraftBudget,
    /// `[T(1), ..., T(n)]` seconds pinning the budget's cost curve (None: the engine's measured one).
    pub cost_curve_s: Option<Vec<f64>>,
    /// Draft the requests' draft-model chains in shared forwards (`chains_together.rs`); false:
    /// each request drafts alone, as the side-by-side benchmark's baseline. Tokens are the same.
    pub draft_chains_together: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 16,
            max_num_batched_tokens: 2048,
            max_kv_tokens: None,
            prefill_chunk: Some(256),
            draft_budget: DraftBudget::Load,
            cost_curve_s: None,
            draft_chains_together: true,
        }
    }
}

impl SchedulerConfig {
    fn validate(&self) -> Result<()> {
        if self.max_num_seqs == 0 {
            return Err(Error::config("max_num_seqs must be at least 1"));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(Error::config(format!(
                "max_num_batched_tokens ({}) must be at least max_num_seqs ({}): every running request needs a \
                 row each step",
                self.max_num_batched_tokens, self.max_num_seqs
            )));
        }
        if self.prefill_chunk == Some(0) {
            return Err(Error::config("prefill_chunk must be at least 1 token (or None)"));
        }
        if self.max_kv_tokens == Some(0) {
            return Err(Error::config("max_kv_tokens must be at least 1 position (or None)"));
        }
        Ok(())
    }
}

/// What one step produced for one request.
#[derive(Debug)]
pub struct RequestOutput {
    pub id: u64,
    pub token_ids: Vec<u32>,
    pub text: String,
    /// One per token of `token_ids` when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprobs>,
    /// Set when the request ended this step (finished, aborted, or failed).
    pub finished: Option<Generation>,
    /// Why the request failed, if it did (it is then finished).
    pub error: Option<Error>,
}

/// What one step did (`Scheduler::step`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepReport {
    /// Requests with rows in the forward.
    pub num_sequences: usize,
    pub num_rows: usize,
    /// Prompt or recompute rows.
    pub num_context_rows: usize,
    /// Draft tokens the requests would have drafted alone.
    pub num_draft_tokens_wanted: usize,
    /// Draft tokens the budget allowed.
    pub num_draft_tokens_granted: usize,
    /// Draft tokens proposed and verified (a proposer may find fewer than granted).
    pub num_draft_tokens: usize,
    /// Draft-model chains drafted together with other requests' (`chains_together.rs`), and the
    /// draft forwards they took (alone: one per chain and draft token).
    pub num_chains_drafted_together: usize,
    pub num_shared_draft_forwards: usize,
    /// Verifier calls that decided the step's drafts: one for all requests on the host (one per
    /// request verified on a GPU, where each verifies with the device kernels).
    pub num_verifier_calls: usize,
    pub num_accepted_tokens: usize,
    pub num_admitted: usize,
    /// Prompt positions admitted samples copied from their first sample instead of computing.
    pub num_shared_prompt_tokens: usize,
    pub num_preempted: usize,
    pub num_waiting: usize,
    pub num_running: usize,
    /// The step's timeline on the host, and its forward on the device (`launch` .. `finish`):
    /// seconds in `launch` (scheduling, drafting, planning, the launches), seconds between
    /// `launch`'s return and `finish`'s call (the caller's work while the device ran the step),
    /// seconds in `finish` (the step's downloads, then the commits), of which `wait_s` in the
    /// downloads (where the device still ran the step, the host's work before was hidden under
    /// it), and the forward's seconds (on CUDA from events around its launches; on the CPU,
    /// where the forward runs inside `launch`, its wall time).
    pub launch_s: f64,
    pub overlapped_host_s: f64,
    pub finish_s: f64,
    pub wait_s: f64,
    pub forward_s: f64,
}

/// Sums of every step's report since the scheduler was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SchedulerTotals {
    pub num_steps: usize,
    pub num_rows: usize,
    pub num_draft_tokens_wanted: usize,
    pub num_draft_tokens_granted: usize,
    pub num_draft_tokens: usize,
    pub num_chains_drafted_together: usize,
    pub num_shared_draft_forwards: usize,
    pub num_accepted_tokens: usize,
    pub num_preemptions: usize,
    pub num_shared_prompt_tokens: usize,
    pub forward_s: f64,
}

// One per queued request: the unstarted variant's size (its Speculation) costs nothing per token.
#[allow(clippy::large_enum_variant)]
enum Waiting {
    /// Not started: its session (and KV cache) is made when admitted. `first_sample`: the request
    /// whose prompt cache it copies (`add_samples`).
    New {
        id: u64,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculation: Option<Speculation>,
        first_sample: Option<u64>,
    },
    /// Preempted: keeps everything but its target KV cache.
    Preempted { id: u64, session: Box<Session> },
}

impl Waiting {
    fn id(&self) -> u64 {
        match self {
            Waiting::New { id, .. } | Waiting::Preempted { id, .. } => *id,
        }
    }

    /// Context positions it will hold once readmitted and fed.
    fn num_context_tokens(&self) -> usize {
        match self {
            Waiting::New { prompt_ids, .. } => prompt_ids.len(),
            Waiting::Preempted { session, .. } => session.num_context_tokens(),
        }
    }
}

struct Running {
    id: u64,
    session: Session,
}

pub struct Scheduler {
    engine: Arc<Engine>,
    config: SchedulerConfig,
    cost: BatchCost,
    cost_source: CostSource,
    /// The engine's cost version `cost` was read at: the engine's figures change when a background
    /// measurement lands, and the budget follows them at the next step (it only cuts drafts of
    /// requests whose tokens do not depend on them, so this changes speed, never output).
    cost_version: u64,
    /// Target KV in the unit the engine's layout allocates (positions or blocks).
    kv: KvAccount,
    waiting: VecDeque<Waiting>,
    /// In admission order: the newest is preempted first.
    running: Vec<Running>,
    /// Ends of requests aborted between steps, returned by the next step.
    aborted: Vec<RequestOutput>,
    /// The step launched and not yet finished (`launch` .. `finish`).
    in_flight: Option<InFlight>,
    /// Running requests aborted while a step was in flight: they end once it is finished (the
    /// step's forward holds rows of theirs, and its plans name running requests by index).
    abort_after_step: Vec<u64>,
    totals: SchedulerTotals,
}

/// A step between `Scheduler::launch` and `Scheduler::finish`.
struct InFlight {
    outputs: Vec<RequestOutput>,
    report: StepReport,
    /// Requests (by running index) whose plan failed.
    failed: Vec<(usize, Error)>,
    /// Each running request's accepted tokens before the step.
    accepted_before: Vec<usize>,
    /// None: the step has no forward.
    forward: Option<StepForward>,
    /// When `launch` returned.
    launched_at: Instant,
}

/// An in-flight step's forward.
struct StepForward {
    /// The planned requests (running indices).
    planned: Vec<usize>,
    /// The launched forward, or why it failed.
    launched: Result<Launched>,
    /// The KV account named should it fail: units held before the step, units planned.
    kv_held: usize,
    kv_planned: usize,
}

impl Scheduler {
    /// A scheduler over `engine`'s model. The budget's cost curve is `config.cost_curve_s`, or the
    /// engine's as it is now (up to `BUDGET_CURVE_ROWS` rows; what is missing is measured in the
    /// background, and each step reads it again once it changed). Never measures here.
    pub fn new(engine: Arc<Engine>, config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        let kv = KvAccount::of(&engine, config.max_kv_tokens)?;
        let cost_version = engine.cost_version();
        let (curve, cost_source) = match &config.cost_curve_s {
            Some(curve) => (curve.clone(), CostSource::Config),
            None => engine.batch_costs(BUDGET_CURVE_ROWS),
        };
        let cost = BatchCost::new(&curve).ok_or_else(|| {
            Error::config(format!(
                "the cost curve needs at least one positive, finite time per row count (got {curve:?})"
            ))
        })?;
        Ok(Self {
            engine,
            config,
            cost,
            cost_source,
            cost_version,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            aborted: Vec::new(),
            in_flight: None,
            abort_after_step: Vec::new(),
            totals: SchedulerTotals::default(),
        })
    }

    /// Queues a request under `id` (unique among the scheduler's unfinished requests). Everything
    /// that can be checked before it runs is checked now: sampling parameters, the prompt, the
    /// context, and the KV bound (prompt + max_tokens must fit `max_kv_tokens`, or it could never
    /// finish).
    pub fn add(
        &mut self,
        id: u64,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculation: Option<Speculation>,
    ) -> Result<()> {
        if self.contains(id) {
            return Err(Error::config(format!("request id {id} is already in the scheduler; use a new id")));
        }
        let prompt_ids = self.engine.request_prompt(&prompt_ids, &params).to_vec();
        self.check_new(&prompt_ids, &params)?;
        self.waiting.push_back(Waiting::New { id, prompt_ids, params, speculation, first_sample: None });
        Ok(())
    }

    /// Queues `params.n` samples of one prompt under `ids` (one each, with a speculation each),
    /// as vLLM runs `n`: each is a request of its own with n = 1 and, when `params.seed` is set,
    /// seed + its index; they share the prompt's prefill (see the module header). All are
    /// checked before any is queued.
    pub fn add_samples(
        &mut self,
        ids: &[u64],
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculations: Vec<Option<Speculation>>,
    ) -> Result<()> {
        if ids.len() != params.n || speculations.len() != params.n {
            return Err(Error::config(format!(
                "add_samples needs one id and one speculation per sample: n = {}, got {} ids and {} speculations",
                params.n,
                ids.len(),
                speculations.len()
            )));
        }
        if let Some(id) = ids.iter().enumerate().find(|(i, id)| self.contains(**id) || ids[..*i].contains(id)) {
            return Err(Error::config(format!("request id {} is already in use; give each sample a new id", id.1)));
        }
        params.validate()?;
        let prompt_ids = self.engine.request_prompt(&prompt_ids, &params).to_vec();
        let sample_params =
            |i: usize| SamplingParams { n: 1, seed: params.seed.map(|s| s.wrapping_add(i as u64)), ..params.clone() };
        self.check_new(&prompt_ids, &sample_params(0))?;
        for (i, (&id, speculation)) in ids.iter().zip(speculations).enumerate() {
            let first_sample = (i > 0).then_some(ids[0]);
            let prompt_ids = prompt_ids.clone();
            self.waiting.push_back(Waiting::New {
                id,
                prompt_ids,
                params: sample_params(i),
                speculation,
                first_sample,
            });
        }
        Ok(())
    }

    /// What `add` checks of a new request: its settings, prompt and context (`check_request`),
    /// and that prompt + max_tokens fits the KV budget (or it could never finish).
    fn check_new(&self, prompt_ids: &[u32], params: &SamplingParams) -> Result<()> {
        self.engine.check_request(prompt_ids, params)?;
        self.kv.check_fits_alone(prompt_ids.len(), params.max_tokens)
    }

    fn contains(&self, id: u64) -> bool {
        self.running.iter().any(|r| r.id == id) || self.waiting.iter().any(|w| w.id() == id)
    }

    /// Stops request `id` (a cancelled client): its caches are freed now (a running request's
    /// once the step in flight, if any, is finished) and the next step returns its end with
    /// `FinishReason::Abort`. False if no unfinished request has that id, or it is already aborted.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            if self.in_flight.is_some() {
                // Its end comes once the step is finished; a second abort meanwhile finds none.
                if self.abort_after_step.contains(&id) {
                    return false;
                }
                self.abort_after_step.push(id);
                return true;
            }
            let Running { id, mut session } = self.running.remove(i);
            self.aborted.push(end_request(id, &mut session, None));
            return true;
        }
        let Some(i) = self.waiting.iter().position(|w| w.id() == id) else { return false };
        let output = match self.waiting.remove(i).expect("the index is in range") {
            Waiting::New { id, prompt_ids, .. } => RequestOutput {
                id,
                token_ids: Vec::new(),
                text: String::new(),
                logprobs: Vec::new(),
                finished: Some(Generation {
                    prompt_token_ids: prompt_ids,
                    token_ids: Vec::new(),
                    text: String::new(),
                    finish_reason: Some(FinishReason::Abort),
                    stop_reason: None,
                    metrics: RequestMetrics::default(),
                    logprobs: None,
                }),
                error: None,
            },
            Waiting::Preempted { id, mut session } => end_request(id, &mut session, None),
        };
        self.aborted.push(output);
        true
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.aborted.is_empty()
    }

    pub fn totals(&self) -> SchedulerTotals {
        self.totals
    }

    /// Re-reads the engine's batch cost curve if a measurement landed since it was read.
    fn follow_engine_costs(&mut self) {
        let version = self.engine.cost_version();
        if self.config.cost_curve_s.is_some() || version == self.cost_version {
            return;
        }
        self.cost_version = version;
        let (curve, source) = self.engine.batch_costs(BUDGET_CURVE_ROWS);
        if let Some(cost) = BatchCost::new(&curve) {
            (self.cost, self.cost_source) = (cost, source);
        }
    }

    /// The budget's cost curve: `[T(1), ..., T(n)]` seconds as measured (extended past n), and
    /// where it came from.
    pub fn cost_curve(&self) -> (Vec<f64>, CostSource) {
        ((1..=self.cost.num_measured()).map(|r| self.cost.time_s(r)).collect(), self.cost_source)
    }

    /// One step of every running request in one forward (see the module header). Returns each
    /// request's tokens, ends and errors, and what the step did.
    pub fn step(&mut self) -> Result<(Vec<RequestOutput>, StepReport)> {
        self.launch()?;
        self.finish()
    }

    /// The first half of `step`: preempts, admits, plans and drafts, then launches the step's
    /// forward (and on a GPU its verification) without waiting for it. Until `finish`, the
    /// caller may add and abort requests (a running request's abort takes effect after the
    /// step) and do its own work while the device runs the step; the next `launch` comes only
    /// after `finish`, so no step plans from tokens the one before has not produced. Returns
    /// whether the step has a forward (false: nothing to run; `finish` returns its outputs).
    pub fn launch(&mut self) -> Result<bool> {
        if self.in_flight.is_some() {
            return Err(Error::Internal(
                "a step is in flight: finish it before launching the next (its tokens plan the next)".into(),
            ));
        }
        let started = Instant::now();
        self.follow_engine_costs();
        let mut outputs = std::mem::take(&mut self.aborted);
        let mut report = StepReport::default();
        self.preempt_to_fit(&mut report);
        self.admit(&mut report, &mut outputs);

        let limits = self.assign_rows(&mut report);
        let chains = match self.config.draft_chains_together {
            true => draft_chains(
                self.running.iter_mut().zip(&limits).filter_map(|(r, limits)| Some((&mut r.session, (*limits)?))),
            ),
            false => ChainsDrafted::default(),
        };
        draft_lookups(
            self.running.iter_mut().zip(&limits).filter_map(|(r, limits)| Some((&mut r.session, (*limits)?))),
        );
        report.num_chains_drafted_together = chains.num_chains;
        report.num_shared_draft_forwards = chains.num_forwards;
        let mut plans: Vec<(usize, StepPlan)> = Vec::new();
        let mut failed: Vec<(usize, Error)> = Vec::new();
        for (i, limits) in limits.into_iter().enumerate() {
            let Some(limits) = limits else { continue };
            let session = &mut self.running[i].session;
            match guard(|| session.plan_with(limits)) {
                Ok(Some(plan)) => plans.push((i, plan)),
                Ok(None) => {}
                Err(error) => failed.push((i, error)),
            }
        }
        report.num_sequences = plans.len();
        report.num_rows = plans.iter().map(|(_, p)| p.rows.tokens.len()).sum();
        report.num_draft_tokens = plans.iter().map(|(_, p)| p.num_draft_tokens()).sum();
        let accepted_before: Vec<usize> = self.running.iter().map(|r| r.session.num_accepted_tokens()).collect();

        let forward = (!plans.is_empty()).then(|| {
            let planned: Vec<usize> = plans.iter().map(|(i, _)| *i).collect();
            // The KV account of the step, named should the forward fail for want of KV room.
            let lens: Vec<usize> = self.running.iter().map(|r| r.session.kv_lens().0).collect();
            let kv_held = self.kv.held(lens.iter().copied());
            let kv_planned: usize = plans.iter().map(|(i, p)| self.kv.growth(lens[*i], p.rows.tokens.len())).sum();
            let mut sessions: Vec<&mut Session> = self.running.iter_mut().map(|r| &mut r.session).collect();
            StepForward { planned, launched: guard(|| launch_step(&mut sessions, plans)), kv_held, kv_planned }
        });
        let has_forward = forward.is_some();
        report.launch_s = started.elapsed().as_secs_f64();
        self.in_flight =
            Some(InFlight { outputs, report, failed, accepted_before, forward, launched_at: Instant::now() });
        Ok(has_forward)
    }

    /// The second half of `step`: waits for the launched step (its one download), commits each
    /// request's verdict, ends the finished and failed ones, then the running requests aborted
    /// meanwhile (their ends come with the next step, as any abort's). Returns the step's outputs
    /// and report.
    pub fn finish(&mut self) -> Result<(Vec<RequestOutput>, StepReport)> {
        let Some(in_flight) = self.in_flight.take() else {
            return Err(Error::Internal("no step was launched: call launch before finish".into()));
        };
        let started = Instant::now();
        let InFlight { mut outputs, mut report, mut failed, accepted_before, forward, launched_at } = in_flight;
        report.overlapped_host_s = started.duration_since(launched_at).as_secs_f64();
        let mut ended: Vec<usize> = Vec::new();
        if let Some(StepForward { planned, launched, kv_held, kv_planned }) = forward {
            let mut sessions: Vec<&mut Session> = self.running.iter_mut().map(|r| &mut r.session).collect();
            match launched.and_then(|launched| guard(|| launched.commit(&mut sessions))) {
                Ok(committed) => {
                    self.totals.forward_s += committed.forward_s;
                    report.forward_s = committed.forward_s;
                    report.wait_s = committed.wait_s;
                    report.num_verifier_calls = committed.num_verifier_calls;
                    for (i, outcome) in committed.outcomes {
                        let running = &self.running[i];
                        match outcome {
                            Ok(step) => {
                                let done = running.session.is_finished();
                                outputs.push(RequestOutput {
                                    id: running.id,
                                    token_ids: step.token_ids,
                                    text: step.text,
                                    logprobs: step.logprobs,
                                    finished: done.then(|| running.session.result()),
                                    error: None,
                                });
                                if done {
                                    ended.push(i);
                                }
                            }
                            Err(error) => failed.push((i, error)),
                        }
                    }
                }
                // The shared forward failed: every request in it has rows of it in its cache.
                Err(error) => {
                    for i in planned {
                        failed.push((
                            i,
                            Error::Internal(format!(
                                "the batched forward failed: {error} (KV before the step: {kv_held} of {} units \
                                 held, {kv_planned} planned)",
                                self.kv.budget()
                            )),
                        ));
                    }
                }
            }
        }
        report.num_accepted_tokens =
            self.running.iter().zip(&accepted_before).map(|(r, before)| r.session.num_accepted_tokens() - before).sum();
        for (i, error) in failed {
            let running = &mut self.running[i];
            outputs.push(end_request(running.id, &mut running.session, Some(error)));
            ended.push(i);
        }
        ended.sort_unstable();
        ended.dedup();
        for i in ended.into_iter().rev() {
            self.running.remove(i);
        }
        for id in std::mem::take(&mut self.abort_after_step) {
            self.abort(id); // false for a request that ended in the step
        }
        report.num_running = self.running.len();
        report.num_waiting = self.waiting.len();
        report.finish_s = started.elapsed().as_secs_f64();
        self.count(&report);
        Ok((outputs, report))
    }

    /// Step 1: preempt the newest running requests until the rest fit the KV budget for a step.
    fn preempt_to_fit(&mut self, report: &mut StepReport) {
        loop {
            let held = self.kv.held(self.running.iter().map(|r| r.session.kv_lens().0));
            let growth: usize = self.running.iter().map(|r| self.kv_growth_next_step(&r.session)).sum();
            if held + growth <= self.kv.budget() || self.running.len() <= 1 {
                return;
            }
            let Running { id, mut session } = self.running.pop().expect("more than one request runs");
            session.preempt();
            report.num_preempted += 1;
            self.waiting.push_front(Waiting::Preempted { id, session: Box::new(session) });
        }
    }

    /// Step 2: admit waiting requests, first come first served, while they fit.
    fn admit(&mut self, report: &mut StepReport, outputs: &mut Vec<RequestOutput>) {
        while self.running.len() < self.config.max_num_seqs {
            let Some(front) = self.waiting.front() else { return };
            // What the running requests hold once their whole context is fed, plus one row each.
            let held = self.kv.held(self.running.iter().map(|r| r.session.kv_lens().0));
            let to_hold: usize = self
                .running
                .iter()
                .map(|r| {
                    let len = r.session.kv_lens().0;
                    self.kv.growth(len, (r.session.num_context_tokens() + 1).saturating_sub(len))
                })
                .sum();
            let shares_with = match front {
                Waiting::New { first_sample: Some(first), prompt_ids, speculation, .. } => {
                    match self.prompt_share(*first, prompt_ids, speculation.as_ref()) {
                        PromptShare::Later => return,
                        PromptShare::Now(index) => Some(index),
                        PromptShare::Never => None,
                    }
                }
                _ => None,
            };
            // A sample sharing its first's prompt takes its positions but the last by reference.
            let shared_len = shares_with.map_or(0, |_| front.num_context_tokens() - 1);
            let front_cost = self.kv.new_sequence_cost(front.num_context_tokens() + 1, shared_len);
            if held + to_hold + front_cost > self.kv.budget() {
                return;
            }
            match self.waiting.pop_front().expect("the queue has a front") {
                Waiting::Preempted { id, session } => self.running.push(Running { id, session: *session }),
                Waiting::New { id, prompt_ids, params, speculation, .. } => {
                    let reserve = prompt_ids.len() + RESERVE_SLACK;
                    let engine = &self.engine;
                    let running = &self.running;
                    let started = guard(|| {
                        let mut session = engine.start_reserving(prompt_ids, params, speculation, reserve)?;
                        let shared = match shares_with {
                            Some(index) => session.share_prompt_from(&running[index].session)?,
                            None => 0,
                        };
                        Ok((session, shared))
                    });
                    match started {
                        Ok((session, shared)) => {
                            report.num_shared_prompt_tokens += shared;
                            self.running.push(Running { id, session })
                        }
                        Err(error) => outputs.push(RequestOutput {
                            id,
                            token_ids: Vec::new(),
                            text: String::new(),
                            logprobs: Vec::new(),
                            finished: None,
                            error: Some(error),
                        }),
                    }
                }
            }
            report.num_admitted += 1;
        }
    }

    /// Whether a sample may start now with a copy of its first sample's prompt cache (the index
    /// of that running request), must wait for it, or will be prefilled on its own (the first
    /// ended, or the proposer reads hidden states a copied cache cannot give it).
    fn prompt_share(&self, first: u64, prompt_ids: &[u32], speculation: Option<&Speculation>) -> PromptShare {
        if prompt_ids.len() < 2 || speculation.is_some_and(|s| !s.proposer.taps().is_empty()) {
            return PromptShare::Never;
        }
        if let Some(index) = self.running.iter().position(|r| r.id == first) {
            let fed = self.running[index].session.kv_lens().0;
            return if fed + 1 >= prompt_ids.len() { PromptShare::Now(index) } else { PromptShare::Later };
        }
        if self.waiting.iter().any(|w| w.id() == first) {
            PromptShare::Later
        } else {
            PromptShare::Never
        }
    }

    /// Step 3: each running request's caps for this step (None: it sits the step out).
    fn assign_rows(&mut self, report: &mut StepReport) -> Vec<Option<PlanLimits>> {
        let lens: Vec<usize> = self.running.iter().map(|r| r.session.kv_lens().0).collect();
        let mut token_left = self.config.max_num_batched_tokens;
        let mut kv_left = self.kv.budget().saturating_sub(self.kv.held(lens.iter().copied()));
        let mut limits: Vec<Option<PlanLimits>> = vec![None; self.running.len()];
        let no_draft = |rows: usize| PlanLimits { max_context_rows: Some(rows), max_draft_tokens: Some(0) };

        // Decode rows, with the whole draft of pinned requests.
        let mut budgeted: Vec<(usize, DraftWish)> = Vec::new();
        for (i, running) in self.running.iter().enumerate() {
            let Some(wish) = running.session.draft_wish() else { continue };
            report.num_draft_tokens_wanted += wish.max_tokens;
            let rows = 1 + if wish.pinned { wish.max_tokens } else { 0 };
            let kv_rows = self.kv.growth(lens[i], rows);
            if rows > token_left || kv_rows > kv_left {
                continue;
            }
            token_left -= rows;
            kv_left -= kv_rows;
            if wish.pinned {
                limits[i] = Some(PlanLimits { max_context_rows: None, max_draft_tokens: Some(wish.max_tokens) });
                report.num_draft_tokens_granted += wish.max_tokens;
            } else {
                limits[i] = Some(no_draft(1));
                budgeted.push((i, wish));
            }
        }
        // Prompt and recompute chunks, oldest request first.
        for (i, running) in self.running.iter().enumerate() {
            let to_feed = running.session.num_context_rows_to_feed();
            if limits[i].is_some() || to_feed == 0 {
                continue;
            }
            let chunk = to_feed
                .min(self.config.prefill_chunk.unwrap_or(usize::MAX))
                .min(token_left)
                .min(self.kv.rows_within(lens[i], kv_left));
            if chunk == 0 {
                continue;
            }
            token_left -= chunk;
            kv_left -= self.kv.growth(lens[i], chunk);
            report.num_context_rows += chunk;
            limits[i] = Some(no_draft(chunk));
        }
        // Drafts from what is left: at most the rows the KV left could take were they all one
        // request's (exact for positions); each grant is then cut to the units still left.
        let max_draft_rows =
            token_left.min(budgeted.iter().map(|&(i, _)| self.kv.rows_within(lens[i] + 1, kv_left)).max().unwrap_or(0));
        let num_scheduled = limits.iter().filter(|l| l.is_some()).count();
        let wishes: Vec<DraftWish> = budgeted.iter().map(|(_, w)| *w).collect();
        let grants: Vec<usize> = match self.config.draft_budget {
            // Alone, a request drafts what it would alone ("at batch 1 it drafts as today").
            DraftBudget::Load if num_scheduled > 1 => {
                let fixed_rows = self.config.max_num_batched_tokens - token_left;
                grant(&wishes, fixed_rows, max_draft_rows, &self.cost)
            }
            _ => {
                let mut left = max_draft_rows;
                wishes
                    .iter()
                    .map(|w| {
                        let granted = w.max_tokens.min(left);
                        left -= granted;
                        granted
                    })
                    .collect()
            }
        };
        for ((i, _), granted) in budgeted.iter().zip(grants) {
            let granted = granted.min(self.kv.rows_within(lens[*i] + 1, kv_left));
            kv_left -= self.kv.growth(lens[*i] + 1, granted);
            report.num_draft_tokens_granted += granted;
            limits[*i] = Some(PlanLimits { max_context_rows: None, max_draft_tokens: Some(granted) });
        }
        limits
    }

    /// KV units a running request takes beyond what it holds for its next step: one row and the
    /// whole draft of a pinned request (which is never cut).
    fn kv_growth_next_step(&self, session: &Session) -> usize {
        let pinned_draft = session.draft_wish().filter(|w| w.pinned).map_or(0, |w| w.max_tokens);
        self.kv.growth(session.kv_lens().0, 1 + pinned_draft)
    }

    fn count(&mut self, report: &StepReport) {
        let t = &mut self.totals;
        t.num_steps += 1;
        t.num_rows += report.num_rows;
        t.num_draft_tokens_wanted += report.num_draft_tokens_wanted;
        t.num_draft_tokens_granted += report.num_draft_tokens_granted;
        t.num_draft_tokens += report.num_draft_tokens;
        t.num_chains_drafted_together += report.num_chains_drafted_together;
        t.num_shared_draft_forwards += report.num_shared_draft_forwards;
        t.num_accepted_tokens += report.num_accepted_tokens;
        t.num_preemptions += report.num_preempted;
        t.num_shared_prompt_tokens += report.num_shared_prompt_tokens;
    }
}

/// What a waiting sample does about its first sample's prompt cache (`Scheduler::prompt_share`).
enum PromptShare {
    /// Copy it from the running request at this index.
    Now(usize),
    /// Wait: the first sample is queued or still reading its prompt.
    Later,
    /// Be prefilled like any request.
    Never,
}

/// Ends a request that was aborted (`error` None) or failed: its caches are freed (a panic there
/// becomes its error, unless it already failed) and its result is returned.
fn end_request(id: u64, session: &mut Session, error: Option<Error>) -> RequestOutput {
    let aborted = guard(|| {
        session.abort();
        Ok(())
    });
    let error = error.or(aborted.err());
    RequestOutput {
        id,
        token_ids: Vec::new(),
        text: String::new(),
        logprobs: Vec::new(),
        finished: Some(session.result()),
        error,
    }
}
