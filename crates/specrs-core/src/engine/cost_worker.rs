//! The engine's cost figures (`costs.rs`) and the one background thread that measures them.
//!
//! Why in the background: a measurement times tens of forwards (a few seconds on a CPU, far more
//! on a busy machine), and no request may wait for it: not the first one (an engine starts with
//! the figures its disk cache holds, else the prior), nor any later one. A figure nobody measured
//! yet is queued here, and the thread times it while no request is in flight (the engine's target
//! KV caches hold nothing), one forward at a time: a try that a request overlapped is dropped, so
//! measuring never times the engine's own requests and delays a request that arrives meanwhile by
//! at most one forward. Every figure is the fastest of interleaved tries (`costs::estimate`), kept
//! with its spread, and stored on disk for later processes whatever the spread.
//!
//! Invariant (what requests see): a figure changes at most once in an engine's life — from the
//! prior, an extrapolation or a noisy cached figure to this engine's measurement — and a request
//! reads its figures once, at its start, so no figure changes under a running request. Readers
//! that live longer than a request (a scheduler's draft budget) re-read when `version` moves.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use crate::config::SamplingParams;
use crate::costs::{
    enough_rounds, estimate_rounds, CostSource, CostTable, DiskCache, DraftCostUnit, Rounds, Spread, MAX_TRIES,
};
use crate::error::{Error, Result};
use crate::kv_cache::{KvBytes, KvCache};
use crate::model::{CausalLm, ForwardBatch, LogitRows};
use crate::proposer::{Feedback, ProposeInput, Proposer};

/// How often the thread looks whether the engine went idle.
const IDLE_POLL: Duration = Duration::from_millis(10);
/// Polls in a row the engine must be idle before a try, after it was busy: a program running
/// requests back to back leaves gaps of a millisecond between them, and a try started in one
/// would only be spoiled by the next request (and slow it down).
const QUIET_POLLS: usize = 2;
/// Context rows per forward while the thread fills a measurement's cache, so a request arriving
/// meanwhile waits for one such chunk at most.
const CONTEXT_CHUNK: usize = 64;
/// Context tokens a draft cost is measured on.
const DRAFT_CONTEXT_LEN: usize = 128;
/// Rounds one measurement runs at most, spoiled ones included (`MAX_TRIES` whole ones, unless
/// requests keep spoiling them).
const MAX_ROUNDS: usize = 4 * MAX_TRIES;

/// One figure to measure.
pub(crate) enum Job {
    /// The verification curve at `context_len` up to `max_n` tokens; `refresh`: measured whole
    /// again (its stored figure was noisy), kept if quieter.
    Curve { context_len: usize, max_n: usize, refresh: bool },
    /// The draft cost of the draft `key` names, timed as `probe` says with `proposer` (built for
    /// it when queued).
    DraftCost { key: String, probe: DraftProbe, proposer: Box<dyn Proposer> },
}

/// How one draft's cost is timed: drafts of `k` tokens, over t(1) of the curve at
/// `policy_context_len`, per draft token or per draft (`unit`); `reads_target_cache`: the draft
/// reads the target's own cache (layer skip), which the timing fills first.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DraftProbe {
    pub k: usize,
    pub policy_context_len: usize,
    pub reads_target_cache: bool,
    pub unit: DraftCostUnit,
}

impl Job {
    fn key(&self) -> String {
        match self {
            Job::Curve { context_len, .. } => format!("curve:{context_len}"),
            Job::DraftCost { key, .. } => format!("draft:{key}"),
        }
    }

    fn describe(&self) -> String {
        match self {
            Job::Curve { context_len, max_n, refresh } => format!(
                "{}verification cost curve t(1..{max_n}) at {context_len} context tokens",
                if *refresh { "noisy cached " } else { "" }
            ),
            Job::DraftCost { key, .. } => format!("draft cost of {key}"),
        }
    }
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// What the thread measures now: its key, its description, and for a curve how far it goes.
    running: Option<(String, String, usize)>,
    worker_started: bool,
    shutdown: bool,
    /// Noisy figures already queued for their one refresh in this engine.
    refreshed: HashSet<String>,
}

/// What a program can see of the engine's measurements (`Engine::cost_status`).
#[derive(Debug, Clone, PartialEq)]
pub struct CostStatus {
    /// Figures measured in a caller's thread (only `Engine::verify_costs` does, when asked for a
    /// curve nobody measured).
    pub num_foreground: usize,
    /// Figures measured by the background thread.
    pub num_background: usize,
    /// Measurements that failed (the figure stays what it was).
    pub num_failed: usize,
    /// Figures queued or being measured, described.
    pub pending: Vec<String>,
    /// Every figure the engine holds: what it is, its source, its spread.
    pub figures: Vec<(String, &'static str, Option<Spread>)>,
}

/// The cost figures of one engine, and their measurement.
pub(crate) struct CostBook {
    model: Arc<dyn CausalLm>,
    /// The target KV bytes of the engine's requests: zero when none is in flight.
    requests_kv: Arc<KvBytes>,
    table: Mutex<CostTable>,
    disk: Option<DiskCache>,
    /// Bumped whenever a figure changes.
    version: AtomicU64,
    queue: Mutex<Queue>,
    /// Signals a job queued or finished, or the engine gone.
    queue_changed: Condvar,
    /// Held while timing, so two measurements never time forwards against each other.
    measuring: Mutex<()>,
    num_foreground: AtomicUsize,
    num_background: AtomicUsize,
    num_failed: AtomicUsize,
    /// Whether figures nobody measured are queued (`Engine::set_measure_on_demand`).
    pub measure_on_demand: AtomicBool,
    /// Whether the thread writes a line on stderr for each figure it measures.
    pub log: AtomicBool,
    /// Set when a try was spoiled or a job starts: the next try waits for `QUIET_POLLS`.
    unsettled: AtomicBool,
}

/// Whether a measurement times its forwards in the caller's thread (no waiting) or in the
/// background thread (each try waits until no request is in flight, and is dropped if one started).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gate {
    Foreground,
    Background,
}

/// Locks a state of the book, recovering it if a panic poisoned it (see `engine::lock`: every
/// figure is inserted whole).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl CostBook {
    pub fn new(model: Arc<dyn CausalLm>, requests_kv: Arc<KvBytes>, disk: Option<DiskCache>) -> Self {
        let table = disk.as_ref().map(DiskCache::load).unwrap_or_default();
        Self {
            model,
            requests_kv,
            table: Mutex::new(table),
            disk,
            version: AtomicU64::new(0),
            queue: Mutex::default(),
            queue_changed: Condvar::new(),
            measuring: Mutex::new(()),
            num_foreground: AtomicUsize::new(0),
            num_background: AtomicUsize::new(0),
            num_failed: AtomicUsize::new(0),
            measure_on_demand: AtomicBool::new(true),
            log: AtomicBool::new(false),
            unsettled: AtomicBool::new(true),
        }
    }

    /// The figures as they are now (a copy: a request reads it once).
    pub fn table(&self) -> CostTable {
        lock(&self.table).clone()
    }

    /// Moves whenever a figure changes.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Queues the curve at `context_len` up to `max_n` if it is shorter, or once per engine if
    /// the disk cache's figure is noisy. Nothing when measuring on demand is off.
    pub fn want_curve(self: &Arc<Self>, context_len: usize, max_n: usize) {
        if !self.measure_on_demand.load(Ordering::Relaxed) {
            return;
        }
        let (have, noisy) = match lock(&self.table).curves.get(&context_len) {
            Some(curve) => (curve.value.len(), curve.source == CostSource::Cached && curve.is_noisy()),
            None => (0, false),
        };
        let key = format!("curve:{context_len}");
        let mut queue = lock(&self.queue);
        let refresh = noisy && queue.refreshed.insert(key.clone());
        let running_covers = queue.running.as_ref().is_some_and(|(k, _, n)| *k == key && *n >= max_n);
        if (have >= max_n || running_covers) && !refresh {
            return;
        }
        let max_n = max_n.max(have);
        // One queued job per curve: a later wish widens it (a running one is followed by another,
        // which measures only what the first left).
        for job in &mut queue.jobs {
            if let Job::Curve { context_len: len, max_n: queued_n, refresh: queued_refresh } = job {
                if *len == context_len {
                    *queued_n = (*queued_n).max(max_n);
                    *queued_refresh |= refresh;
                    return;
                }
            }
        }
        self.push(queue, Job::Curve { context_len, max_n, refresh });
    }

    /// Queues the draft cost `key` (with the proposer `make_proposer` builds) if nobody measured
    /// it, or once per engine if its stored figure is noisy.
    pub fn want_draft_cost(
        self: &Arc<Self>,
        key: &str,
        probe: DraftProbe,
        make_proposer: impl FnOnce() -> Result<Box<dyn Proposer>>,
    ) -> Result<()> {
        if !self.measure_on_demand.load(Ordering::Relaxed) {
            return Ok(());
        }
        let known = lock(&self.table).draft_costs.get(key).map(|c| c.source == CostSource::Cached && c.is_noisy());
        let job_key = format!("draft:{key}");
        {
            let mut queue = lock(&self.queue);
            let queued = queue.jobs.iter().any(|job| job.key() == job_key)
                || queue.running.as_ref().is_some_and(|(k, ..)| *k == job_key);
            let wanted = match known {
                None => !queued,
                Some(noisy) => noisy && !queued && queue.refreshed.insert(job_key),
            };
            if !wanted {
                return Ok(());
            }
        }
        let proposer = make_proposer()?;
        let job = Job::DraftCost { key: key.to_string(), probe, proposer };
        self.push(lock(&self.queue), job);
        Ok(())
    }

    fn push(self: &Arc<Self>, mut queue: MutexGuard<'_, Queue>, job: Job) {
        if queue.shutdown {
            return;
        }
        queue.jobs.push_back(job);
        if !queue.worker_started {
            queue.worker_started = true;
            let book = self.clone();
            let spawned = std::thread::Builder::new().name("specrs-costs".into()).spawn(move || book.work());
            if spawned.is_err() {
                // No thread (the process is out of them): nothing is measured; figures stay priors.
                queue.worker_started = false;
                queue.jobs.clear();
            }
        }
        self.queue_changed.notify_all();
    }

    /// Stops the thread (the engine is gone); a measurement under way ends at its next try.
    pub fn shutdown(&self) {
        lock(&self.queue).shutdown = true;
        self.queue_changed.notify_all();
    }

    /// Waits until nothing is queued or being measured, or `timeout` passed; returns whether
    /// everything was measured.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut queue = lock(&self.queue);
        while !queue.jobs.is_empty() || queue.running.is_some() {
            let left = match deadline {
                Some(deadline) => match deadline.checked_duration_since(Instant::now()) {
                    Some(left) => left,
                    None => return false,
                },
                None => Duration::from_secs(3600),
            };
            queue = self.queue_changed.wait_timeout(queue, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    pub fn status(&self) -> CostStatus {
        let pending = {
            let queue = lock(&self.queue);
            queue.running.iter().map(|(_, what, _)| what.clone()).chain(queue.jobs.iter().map(Job::describe)).collect()
        };
        let table = lock(&self.table);
        let curves = table.curves.iter().map(|(len, c)| {
            (format!("verification cost curve t(1..{}) at {len} context tokens", c.value.len()), c.source, c.spread)
        });
        let drafts = table.draft_costs.iter().map(|(key, c)| (format!("draft cost of {key}"), c.source, c.spread));
        CostStatus {
            num_foreground: self.num_foreground.load(Ordering::Relaxed),
            num_background: self.num_background.load(Ordering::Relaxed),
            num_failed: self.num_failed.load(Ordering::Relaxed),
            pending,
            figures: curves.chain(drafts).map(|(what, source, spread)| (what, source.as_str(), spread)).collect(),
        }
    }

    /// The background thread: one job at a time, in the order they were queued.
    fn work(self: Arc<Self>) {
        loop {
            let job = {
                let mut queue = lock(&self.queue);
                loop {
                    if queue.shutdown {
                        queue.jobs.clear();
                        queue.running = None;
                        self.queue_changed.notify_all();
                        return;
                    }
                    if let Some(job) = queue.jobs.pop_front() {
                        let reach = match job {
                            Job::Curve { max_n, .. } => max_n,
                            Job::DraftCost { .. } => 0,
                        };
                        queue.running = Some((job.key(), job.describe(), reach));
                        break job;
                    }
                    queue = self.queue_changed.wait(queue).unwrap_or_else(|e| e.into_inner());
                }
            };
            let what = job.describe();
            self.unsettled.store(true, Ordering::Relaxed);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run(job)));
            match outcome {
                Ok(Ok(Some(line))) => {
                    self.num_background.fetch_add(1, Ordering::Relaxed);
                    self.say(&line);
                }
                Ok(Ok(None)) => {}
                Ok(Err(e)) => self.failed(&format!("measuring the {what} failed: {e}")),
                Err(_) => self.failed(&format!("measuring the {what} panicked")),
            }
            lock(&self.queue).running = None;
            self.queue_changed.notify_all();
        }
    }

    fn failed(&self, line: &str) {
        self.num_failed.fetch_add(1, Ordering::Relaxed);
        self.say(&format!("{line}; the figure stays as it was"));
    }

    fn say(&self, line: &str) {
        if self.log.load(Ordering::Relaxed) {
            eprintln!("specrs: {line}");
        }
    }

    /// Measures one job and installs its figure; Some(what it measured), None when there was
    /// nothing left to measure or the engine went away.
    fn run(&self, job: Job) -> Result<Option<String>> {
        match job {
            Job::Curve { context_len, max_n, refresh } => self.run_curve(context_len, max_n, refresh),
            Job::DraftCost { key, probe, mut proposer } => {
                let Some((cost, spread)) = self.measure_draft(proposer.as_mut(), probe, Gate::Background)? else {
                    return Ok(None);
                };
                if !lock(&self.table).set_draft_cost(&key, cost, spread) {
                    return Ok(None);
                }
                self.changed();
                Ok(Some(format!(
                    "measured the draft cost of {key} in the background: c = {cost:.3} of a target step per {} \
                     (spread {:.2} over {} tries)",
                    probe.unit.as_str(),
                    spread.ratio,
                    spread.tries
                )))
            }
        }
    }

    fn run_curve(&self, context_len: usize, max_n: usize, refresh: bool) -> Result<Option<String>> {
        let have = lock(&self.table).curves.get(&context_len).map_or(0, |c| c.value.len());
        let first_n = if refresh { 1 } else { have + 1 };
        let last_n = self.measurable(context_len, max_n);
        if first_n > last_n {
            return Ok(None);
        }
        let Some((costs, spread)) = self.measure_curve(context_len, first_n, last_n, Gate::Background)? else {
            return Ok(None);
        };
        let changed = {
            let mut table = lock(&self.table);
            (refresh && table.refresh_curve(context_len, &costs, spread))
                || table.extend_curve(context_len, first_n, &costs, spread)
        };
        if !changed {
            return Ok(None);
        }
        self.changed();
        let curve = lock(&self.table).curves[&context_len].value.clone();
        let v_last = curve[curve.len() - 1] / curve[0];
        Ok(Some(format!(
            "measured the verification cost curve t({first_n}..{last_n}) at {context_len} context tokens in the \
             background: v({}) = {v_last:.2} (spread {:.2} over {} tries)",
            curve.len(),
            spread.ratio,
            spread.tries
        )))
    }

    /// The largest n a curve at `context_len` can measure (the model's context holds both).
    pub fn measurable(&self, context_len: usize, max_n: usize) -> usize {
        max_n.min(self.model.info().context_length.saturating_sub(context_len)).max(1)
    }

    /// Measures the points of the curve at `context_len` a foreground caller needs (up to
    /// `max_n`) now, in its own thread. Returns whether it measured anything.
    pub fn measure_curve_now(&self, context_len: usize, max_n: usize) -> Result<bool> {
        let last_n = self.measurable(context_len, max_n);
        let _measuring = lock(&self.measuring);
        let have = lock(&self.table).curves.get(&context_len).map_or(0, |c| c.value.len());
        if have >= last_n {
            return Ok(false);
        }
        let Some((costs, spread)) = self.measure_curve(context_len, have + 1, last_n, Gate::Foreground)? else {
            return Ok(false);
        };
        let grew = lock(&self.table).extend_curve(context_len, have + 1, &costs, spread);
        if grew {
            self.num_foreground.fetch_add(1, Ordering::Relaxed);
            self.changed();
        }
        Ok(grew)
    }

    /// A figure changed: readers re-read, and the disk cache gets it.
    fn changed(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
        if let Some(disk) = &self.disk {
            disk.store(&lock(&self.table));
        }
    }

    /// `[t(first_n), ..., t(last_n)]` seconds of one forward over n new tokens on a
    /// `context_len`-token cache, with their spread; None if the engine went away. t(1) is timed in
    /// every round and each t(n) is its median ratio to it (`costs::estimate_rounds`) times the
    /// curve's own t(1) (this measurement's, for a curve measured from its first point), so points
    /// appended later share the scale of the ones before. Any tokens do: a forward's cost does not
    /// depend on which it reads.
    fn measure_curve(
        &self,
        context_len: usize,
        first_n: usize,
        last_n: usize,
        gate: Gate,
    ) -> Result<Option<(Vec<f64>, Spread)>> {
        let probe = probe_tokens(self.model.info().vocab_size, context_len, last_n);
        let ns: Vec<usize> = std::iter::once(1).chain(first_n.max(2)..=last_n).collect();
        let Some(mut cache) = self.filled_cache(context_len, last_n, gate)? else { return Ok(None) };
        let rounds = self.run_rounds(
            ns.len(),
            |slot| {
                let n = ns[slot];
                Ok(self
                    .timed(gate, || {
                        cache.truncate(context_len);
                        self.model.forward(&probe[..n], &mut cache)
                    })?
                    .per(|_| 1.0))
            },
            |rounds| enough_rounds(rounds, ns.len()),
        )?;
        let Some(rounds) = rounds else { return Ok(None) };
        let (t1, ratios, spread) = estimate_rounds(&rounds, ns.len())
            .ok_or_else(|| Error::Internal("no try of the curve was timed whole".into()))?;
        let scale =
            if first_n == 1 { t1 } else { lock(&self.table).curves.get(&context_len).map_or(t1, |c| c.value[0]) };
        let skip = usize::from(first_n > 1);
        Ok(Some((ratios[skip..].iter().map(|v| v * scale).collect(), spread)))
    }

    /// A cache holding `context_len` tokens (and room for `extra` more), filled in chunks, each a
    /// try of its own in the background; None if the engine went away.
    fn filled_cache(&self, context_len: usize, extra: usize, gate: Gate) -> Result<Option<KvCache>> {
        let context = probe_tokens(self.model.info().vocab_size, 0, context_len);
        let mut cache: KvCache = self.model.new_cache(context_len + extra)?;
        for chunk in context.chunks(CONTEXT_CHUNK) {
            // Filling the cache is not timed: a chunk a request overlapped still filled it.
            let filled = self.timed(gate, || self.model.forward_rows(chunk, &mut cache, LogitRows::None))?;
            if let Try::Gone = filled {
                return Ok(None);
            }
        }
        Ok(Some(cache))
    }

    /// Median seconds of one forward over `probe[..n]` on top of a cache holding `context`, for
    /// each `n` in `ns` (each at most `probe.len()`), over `repeats` interleaved rounds timed in
    /// this thread (`Engine::forward_cost`).
    pub fn time_forwards_now(&self, context: &[u32], probe: &[u32], ns: &[usize], repeats: usize) -> Result<Vec<f64>> {
        let _measuring = lock(&self.measuring);
        let mut cache: KvCache = self.model.new_cache(context.len() + probe.len())?;
        self.model.forward_rows(context, &mut cache, LogitRows::Last)?;
        let rounds = self.run_rounds(
            ns.len(),
            |slot| {
                Ok(self
                    .timed(Gate::Foreground, || {
                        cache.truncate(context.len());
                        self.model.forward(&probe[..ns[slot]], &mut cache)
                    })?
                    .per(|_| 1.0))
            },
            |rounds| rounds.len() >= repeats.max(1),
        )?;
        let rounds = rounds.ok_or_else(|| Error::Internal("the engine shut down while timing".into()))?;
        Ok((0..ns.len()).map(|i| median(&rounds.iter().filter_map(|r| r[i]).collect::<Vec<_>>())).collect())
    }

    /// c, drafting time per draft token (per draft, with `DraftCostUnit::Draft`) over one target
    /// step, and its spread; None if the engine went away. Each round times one target forward
    /// over 1 token on a `policy_context_len`-token cache (the step the policy's curve starts at)
    /// and one draft of `k` tokens on a `DRAFT_CONTEXT_LEN`-token context, so c is their median
    /// ratio within a round. A head reads the target's hidden states: round r drafts after a
    /// context one token longer, as a step whose draft was rejected hands the head one new row.
    fn measure_draft(
        &self,
        proposer: &mut dyn Proposer,
        draft_probe: DraftProbe,
        gate: Gate,
    ) -> Result<Option<(f64, Spread)>> {
        let DraftProbe { k, policy_context_len, reads_target_cache, unit } = draft_probe;
        let probe = probe_tokens(self.model.info().vocab_size, policy_context_len, 1);
        let Some(mut step_cache) = self.filled_cache(policy_context_len, 1, gate)? else { return Ok(None) };
        let context = probe_tokens(self.model.info().vocab_size, 0, DRAFT_CONTEXT_LEN + MAX_ROUNDS + 1);
        let full = &context[..DRAFT_CONTEXT_LEN];
        proposer.begin(full, &SamplingParams::greedy(k + 1))?;
        let mut target_cache = self.model.new_cache(context.len() + k)?;
        if reads_target_cache {
            // Only the layer-skip draft reads the target's cache.
            self.model.forward_rows(&full[..full.len() - 1], &mut target_cache, LogitRows::None)?;
        }
        let taps = proposer.taps();
        let hidden = if taps.is_empty() {
            Vec::new()
        } else {
            let mut batch = ForwardBatch::chain(&context, 0, LogitRows::None)?;
            batch.taps = taps;
            let mut cache = self.model.new_cache(context.len())?;
            self.model.forward_batch(&batch, &mut [&mut cache])?.hidden
        };
        let rows = |start: usize, n: usize| -> Result<Vec<Tensor>> {
            hidden.iter().map(|h| Ok(h.narrow(0, start, n)?)).collect()
        };
        if !hidden.is_empty() {
            proposer.observe_hidden(0, &rows(0, DRAFT_CONTEXT_LEN - 1)?)?;
        }
        let mut drafts = 0;
        let rounds = self.run_rounds(
            2,
            |slot| {
                if slot == 0 {
                    return Ok(self
                        .timed(gate, || {
                            step_cache.truncate(policy_context_len);
                            self.model.forward(&probe, &mut step_cache)
                        })?
                        .per(|_| 1.0));
                }
                let round_context = if hidden.is_empty() { full } else { &context[..DRAFT_CONTEXT_LEN + drafts] };
                if !hidden.is_empty() && drafts > 0 {
                    proposer.observe_hidden(round_context.len() - 2, &rows(round_context.len() - 2, 1)?)?;
                }
                drafts += 1;
                let attempt = self.timed(gate, || {
                    let input = ProposeInput {
                        context: round_context,
                        max_tokens: k,
                        tree: None,
                        target_cache: &mut target_cache,
                        num_unverified: 0,
                    };
                    Ok(proposer.propose_with(input)?.token_ids.len().max(1))
                })?;
                proposer.observe(&Feedback::accepted(0, &[], &[]))?;
                Ok(attempt.per(|num_tokens| unit.count(num_tokens)))
            },
            |rounds| enough_rounds(rounds, 2),
        )?;
        let Some(rounds) = rounds else { return Ok(None) };
        let (_, ratios, spread) = estimate_rounds(&rounds, 2)
            .ok_or_else(|| Error::Internal("no round of the draft cost was timed whole".into()))?;
        Ok(Some((ratios[1], spread)))
    }

    /// Rounds (`costs::Rounds`) of `slots` timings, `try_slot(i)` timing slot i once, after one
    /// untimed round (the first forwards after loading touch cold weight pages, which would
    /// inflate t(1) and deflate every ratio), until `done(rounds)` or `MAX_ROUNDS`; None if the
    /// engine went away.
    fn run_rounds(
        &self,
        slots: usize,
        mut try_slot: impl FnMut(usize) -> Result<Try<()>>,
        done: impl Fn(&Rounds) -> bool,
    ) -> Result<Option<Rounds>> {
        let mut rounds: Rounds = Vec::new();
        for round in 0..=MAX_ROUNDS {
            if round > 0 && done(&rounds) {
                break;
            }
            let mut tries = Vec::with_capacity(slots);
            for slot in 0..slots {
                match try_slot(slot)? {
                    Try::Gone => return Ok(None),
                    Try::Timed(seconds, ()) => tries.push(Some(seconds)),
                    Try::Spoiled => tries.push(None),
                }
            }
            if round > 0 {
                rounds.push(tries);
            }
        }
        Ok(Some(rounds))
    }

    /// Runs `work` (one forward or one draft) as a try: in the background, once no request is in
    /// flight, and spoiled if one started while it ran.
    fn timed<T>(&self, gate: Gate, work: impl FnOnce() -> Result<T>) -> Result<Try<T>> {
        if gate == Gate::Background && !self.wait_until_idle() {
            return Ok(Try::Gone);
        }
        let _measuring = (gate == Gate::Background).then(|| lock(&self.measuring));
        // A GPU runs launched work after the launch returns: wait for what is still queued so
        // none of it is counted here, and for this work's results before reading the clock.
        self.model.device().synchronize()?;
        let t0 = Instant::now();
        let out = work()?;
        self.model.device().synchronize()?;
        let seconds = t0.elapsed().as_secs_f64();
        if gate == Gate::Background && self.requests_kv.live() > 0 {
            self.unsettled.store(true, Ordering::Relaxed);
            return Ok(Try::Spoiled);
        }
        Ok(Try::Timed(seconds, out))
    }

    /// Waits until no request holds a KV cache (for `QUIET_POLLS` polls in a row if the engine was
    /// busy, a try was spoiled or a job starts); false if the engine went away first.
    fn wait_until_idle(&self) -> bool {
        let mut quiet_polls = if self.unsettled.swap(false, Ordering::Relaxed) { 0 } else { QUIET_POLLS };
        loop {
            if lock(&self.queue).shutdown {
                return false;
            }
            if self.requests_kv.live() > 0 {
                quiet_polls = 0;
            } else if quiet_polls >= QUIET_POLLS {
                return true;
            } else {
                quiet_polls += 1;
            }
            std::thread::sleep(IDLE_POLL);
        }
    }
}

/// One try of a timing.
enum Try<T> {
    /// Seconds, and what the work returned.
    Timed(f64, T),
    /// A request started while it ran: not a timing of the machine alone.
    Spoiled,
    /// The engine went away.
    Gone,
}

impl<T> Try<T> {
    /// The try's seconds per unit of what the work returned (per draft token, say).
    fn per(self, units: impl FnOnce(T) -> f64) -> Try<()> {
        match self {
            Try::Timed(seconds, value) => Try::Timed(seconds / units(value), ()),
            Try::Spoiled => Try::Spoiled,
            Try::Gone => Try::Gone,
        }
    }
}

/// `len` token ids from position `start` of a fixed pseudo-random sequence in the vocabulary.
fn probe_tokens(vocab_size: usize, start: usize, len: usize) -> Vec<u32> {
    let vocab = vocab_size as u64;
    (start..start + len).map(|i| ((i as u64 * 7919 + 13) % vocab) as u32).collect()
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::config::SamplingParams;
    use crate::engine::scheduler::{Scheduler, SchedulerConfig};
    use crate::engine::Engine;
    use crate::model::llama_config::LlamaConfig;
    use crate::spec_config::SpeculativeConfig;

    /// A one-layer random Llama (no file: no disk cache), whose forwards take microseconds.
    fn engine() -> Arc<Engine> {
        let config = LlamaConfig::from_json(
            r#"{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 160}"#,
        )
        .unwrap();
        Arc::new(Engine::random_llama(config, 0, "f32", "cpu").unwrap())
    }

    fn ngram(k: usize) -> SpeculativeConfig {
        SpeculativeConfig::from_json(&format!(r#"{{"method": "ngram", "num_speculative_tokens": {k}}}"#)).unwrap()
    }

    #[test]
    fn a_cold_engine_reads_the_prior_and_its_thread_measures_the_curve_once() {
        let engine = engine();
        let version = engine.cost_version();
        let costs = engine.prepare(&ngram(3)).unwrap();
        assert_eq!((costs.verify_cost_source, costs.verify_cost_spread), (CostSource::Prior, None));
        let status = engine.cost_status();
        assert_eq!((status.num_foreground, status.pending.len()), (0, 1), "{status:?}");
        assert!(engine.wait_for_costs(None));
        let costs = engine.policy_costs(&ngram(3)).unwrap();
        assert_eq!(costs.verify_cost_source, CostSource::Measured);
        assert!(costs.verify_cost_spread.unwrap().tries >= crate::costs::MIN_TRIES);
        assert_eq!(costs.verify_cost_ratios.len(), 4);
        assert_ne!(engine.cost_version(), version);
        let status = engine.cost_status();
        assert_eq!((status.num_foreground, status.num_background, status.num_failed), (0, 1, 0));
        // Known now: nothing more is queued, and a larger k queues only its new points.
        engine.prepare(&ngram(3)).unwrap();
        assert!(engine.cost_status().pending.is_empty());
        engine.prepare(&ngram(5)).unwrap();
        assert!(engine.wait_for_costs(None));
        let longer = engine.policy_costs(&ngram(5)).unwrap().verify_cost_ratios;
        assert_eq!(longer[..4], costs.verify_cost_ratios[..], "the first points never move");
    }

    #[test]
    fn a_request_in_flight_keeps_the_measurement_from_completing() {
        let engine = engine();
        let session = engine.start(vec![1, 2, 3], SamplingParams::greedy(4), None).unwrap();
        engine.prepare(&ngram(3)).unwrap();
        // However long it waits, no try can be timed while the request holds its cache.
        assert!(!engine.wait_for_costs(Some(Duration::from_millis(300))));
        assert_eq!(engine.cost_status().num_background, 0);
        drop(session);
        assert!(engine.wait_for_costs(None));
        assert_eq!(engine.cost_status().num_background, 1);
    }

    #[test]
    fn a_scheduler_follows_a_measurement_that_lands() {
        let engine = engine();
        let mut scheduler = Scheduler::new(engine.clone(), SchedulerConfig::default()).unwrap();
        assert_eq!(scheduler.cost_curve().1, CostSource::Prior);
        assert!(engine.wait_for_costs(None));
        scheduler.add(0, vec![1, 2, 3], SamplingParams::greedy(2), None).unwrap();
        scheduler.step().unwrap();
        let (curve, source) = scheduler.cost_curve();
        assert_eq!((source, curve.len()), (CostSource::Measured, crate::engine::scheduler::BUDGET_CURVE_ROWS));
    }

    #[test]
    fn a_noisy_figure_from_the_disk_cache_is_measured_again_once() {
        let dir = std::env::temp_dir().join(format!("specrs-cost-worker-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model_file = dir.join("model.gguf");
        std::fs::write(&model_file, b"weights").unwrap();
        let disk = DiskCache::for_model(&dir, &model_file, "Cpu", "reference", 1).unwrap();
        let mut stored = CostTable::default();
        stored.extend_curve(1, 1, &[0.5, 0.9, 1.2], Spread { ratio: 1e9, tries: 15 });
        disk.store(&stored);
        let target = engine();
        let book = Arc::new(CostBook::new(target.model().clone(), Arc::default(), Some(disk.clone())));
        assert_eq!(book.table().curves[&1].source, CostSource::Cached);
        book.want_curve(1, 3);
        assert_eq!(book.status().pending.len(), 1, "queued for its one refresh");
        assert!(book.wait(None));
        let refreshed = book.table().curves[&1].clone();
        assert_eq!(refreshed.source, CostSource::Measured);
        assert!(refreshed.spread.unwrap().ratio < 1e9 && refreshed.value.len() == 3);
        // Measured by this engine: final for it, whatever its spread.
        book.want_curve(1, 3);
        assert!(book.status().pending.is_empty());
        assert_eq!(disk.load().curves[&1].value, refreshed.value, "stored for later processes");
        book.shutdown();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
