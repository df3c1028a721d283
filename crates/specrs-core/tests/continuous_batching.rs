//! The continuous-batching `Scheduler` on the real SmolLM2 weights: every request yields exactly
//! the tokens it yields alone (greedy and seeded sampling; off, ngram, suffix and a draft model;
//! short and long prompts), under a small KV budget that forces admission waits and preemption,
//! with a request aborted mid-batch, and with the load budget cutting drafts; at batch 1 the budget
//! grants what the request asks for.

use std::sync::Arc;

use specrs_core::engine::FinishReason;
use specrs_core::kv_cache::{KvCache, KvLayout, PagedPool};
use specrs_core::model::{CausalLm, ForwardBatch, ForwardOutput, ModelInfo};
use specrs_core::{
    DraftBudget, Engine, Error, Generation, SamplingParams, Scheduler, SchedulerConfig, SpeculativeConfig, StepReport,
};

use crate::common;

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Speculative decoding verifies a draft in one forward pass. Speculative decoding",
    "List three colors: red, green,",
];

/// Each config pins the costs its adaptive draft length weighs (`verify_cost_ratios`, and the
/// layer-skip draft's `draft_cost`): a seeded request drafting from a model (layer skip, verified by
/// rejection sampling, so its tokens depend on its draft lengths: the scheduler pins it) samples its
/// draft, so other draft lengths draw other tokens, and two engines that each timed their own costs
/// (on a loaded machine, each its own noise) chose other lengths for request 7. Flat enough that the
/// layer-skip draft pays at the prior acceptance, so the sampled request drafts.
const METHODS: [Option<&str>; 4] = [
    None,
    Some(r#"{"method": "ngram", "num_speculative_tokens": 4, "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3, 1.4]}"#),
    Some(r#"{"method": "suffix", "num_speculative_tokens": 5, "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]}"#),
    Some(
        r#"{"method": "layer_skip", "num_speculative_tokens": 3, "exit_layer": 20, "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3], "draft_cost": 0.1, "verification": "rejection"}"#,
    ),
];

struct Request {
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    config: Option<&'static str>,
}

fn sampled(max_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(seed), ..SamplingParams::greedy(max_tokens) }
}

/// `n` requests cycling through the methods, greedy and seeded sampling, and prompts from a few
/// tokens to a few hundred (a prompt repeated is also what n-gram and suffix drafting feed on).
fn mixed_requests(engine: &Engine, n: usize) -> Vec<Request> {
    (0..n)
        .map(|i| {
            let repeats = [1, 2, 12, 30][i % 4 / 2 + (i / 8) * 2];
            let text = PROMPTS[(i + i / 4) % PROMPTS.len()].repeat(repeats);
            let prompt_ids = engine.tokenizer().encode(&text, true).unwrap();
            let max_tokens = 16 + 5 * (i % 5);
            let params =
                if i % 3 == 1 { sampled(max_tokens, 100 + i as u64) } else { SamplingParams::greedy(max_tokens) };
            Request { prompt_ids, params, config: METHODS[i % METHODS.len()] }
        })
        .collect()
}

fn alone(engine: &Engine, requests: &[Request]) -> Vec<Generation> {
    requests
        .iter()
        .map(|r| engine.generate(r.prompt_ids.clone(), r.params.clone(), speculation(engine, r.config)).unwrap())
        .collect()
}

fn speculation(engine: &Engine, config: Option<&str>) -> Option<specrs_core::Speculation> {
    config.map(|c| engine.speculation(&SpeculativeConfig::from_json(c).unwrap(), None).unwrap())
}

/// Runs `requests` (ids 0..n) through a scheduler to the end, calling `between(step, scheduler)`
/// after each step; returns each request's tokens as streamed, its end, and every step's report.
struct Batched {
    tokens: Vec<Vec<u32>>,
    ends: Vec<Option<Generation>>,
    reports: Vec<StepReport>,
}

impl Batched {
    /// A step's outputs and report: none failed, none ended twice.
    fn take(&mut self, outputs: Vec<specrs_core::RequestOutput>, report: StepReport) {
        for o in outputs {
            assert!(o.error.is_none(), "request {} failed: {:?}", o.id, o.error);
            self.tokens[o.id as usize].extend(&o.token_ids);
            if let Some(end) = o.finished {
                assert!(self.ends[o.id as usize].is_none(), "request {} ended twice", o.id);
                self.ends[o.id as usize] = Some(end);
            }
        }
        self.reports.push(report);
    }
}

fn batched(
    scheduler: &mut Scheduler,
    engine: &Engine,
    requests: &[Request],
    mut between: impl FnMut(usize, &mut Scheduler),
) -> Batched {
    for (id, r) in requests.iter().enumerate() {
        scheduler.add(id as u64, r.prompt_ids.clone(), r.params.clone(), speculation(engine, r.config)).unwrap();
    }
    let mut out =
        Batched { tokens: vec![Vec::new(); requests.len()], ends: vec![None; requests.len()], reports: Vec::new() };
    let mut step = 0;
    while scheduler.has_unfinished() {
        let (outputs, report) = scheduler.step().unwrap();
        out.take(outputs, report);
        between(step, scheduler);
        step += 1;
        assert!(step < 10_000, "the scheduler does not finish");
    }
    out
}

fn assert_same(alone: &[Generation], batched: &Batched, skip: &[usize]) {
    for (i, a) in alone.iter().enumerate().filter(|(i, _)| !skip.contains(i)) {
        let end = batched.ends[i].as_ref().unwrap_or_else(|| panic!("request {i} never ended"));
        assert_eq!(a.token_ids, end.token_ids, "request {i}: tokens differ from alone");
        assert_eq!(a.token_ids, batched.tokens[i], "request {i}: streamed tokens differ from alone");
        assert_eq!(a.text, end.text, "request {i}");
        assert_eq!(a.finish_reason, end.finish_reason, "request {i}");
    }
}

/// SmolLM2 with every method prepared (its draft weights loaded; its costs are the config's) and
/// nothing measured later (the load budget's batch curve, where a test does not pin one, is the
/// nearest figure, which only shortens drafts that do not change tokens).
fn load() -> Arc<Engine> {
    load_with(KvLayout::Contiguous)
}

fn load_with(layout: KvLayout) -> Arc<Engine> {
    let engine = Engine::load(common::smollm2_path(), "cpu").unwrap().with_kv_layout(layout).unwrap();
    for config in METHODS.iter().flatten() {
        engine.prepare(&SpeculativeConfig::from_json(config).unwrap()).unwrap();
    }
    assert!(engine.wait_for_costs(None), "the background thread measured what prepare queued");
    engine.set_measure_on_demand(false);
    Arc::new(engine)
}

#[test]
fn sixteen_mixed_requests_batched_yield_what_they_yield_alone() {
    let engine = load();
    let requests = mixed_requests(&engine, 16);
    let expected = alone(&engine, &requests);
    // A flat pinned cost curve: the load budget grants every wish, whatever this machine's timing
    // (a measured steep one may cut every draft of a full batch).
    let config = SchedulerConfig {
        max_num_seqs: 16,
        prefill_chunk: Some(64),
        cost_curve_s: Some(vec![0.01; 32]),
        ..SchedulerConfig::default()
    };
    let mut scheduler = Scheduler::new(engine.clone(), config).unwrap();
    let run = batched(&mut scheduler, &engine, &requests, |_, _| {});
    assert_same(&expected, &run, &[]);
    // It batched, prefilled in chunks beside decoding, and speculated.
    assert!(run.reports.iter().any(|r| r.num_sequences >= 8), "never 8 requests in one forward");
    assert!(
        run.reports.iter().any(|r| r.num_context_rows > 0 && r.num_rows > r.num_context_rows),
        "no chunk beside decoding"
    );
    // One verifier call per step for every request's draft (the host verifier).
    assert!(run.reports.iter().all(|r| r.num_verifier_calls <= 1), "a step verified more than once");
    for r in run.reports.iter().filter(|r| r.num_rows > r.num_context_rows) {
        assert_eq!(r.num_verifier_calls, 1, "{r:?}");
    }
    let totals = scheduler.totals();
    assert!(totals.num_draft_tokens > 0 && totals.num_accepted_tokens > 0, "{totals:?}");
    let forwards_alone: usize = expected.iter().map(|g| g.metrics.num_forward_passes).sum();
    assert!(totals.num_steps < forwards_alone / 2, "{} steps vs {forwards_alone} forwards alone", totals.num_steps);
}

#[test]
fn a_small_kv_budget_makes_requests_wait_and_be_preempted_without_changing_them() {
    let engine = load();
    // 4 fit at first, fewer as they grow.
    let requests = forty_and_forty(&engine);
    let expected = alone(&engine, &requests);
    let config = SchedulerConfig { max_kv_tokens: Some(200), prefill_chunk: Some(16), ..SchedulerConfig::default() };
    let mut scheduler = Scheduler::new(engine.clone(), config).unwrap();
    let mut max_running = 0;
    let run = batched(&mut scheduler, &engine, &requests, |_, s| max_running = max_running.max(s.num_running()));
    assert_same(&expected, &run, &[]);
    assert!(max_running < requests.len(), "all {max_running} ran at once: the budget admitted too many");
    assert!(scheduler.totals().num_preemptions > 0, "nothing was preempted: {:?}", scheduler.totals());
    assert!(run.reports.iter().any(|r| r.num_waiting > 0));

    // A request that could never fit is refused when added, naming the setting.
    let long = engine.tokenizer().encode(&PROMPTS[2].repeat(20), true).unwrap();
    let err = scheduler.add(99, long, SamplingParams::greedy(8), None).unwrap_err();
    assert!(matches!(err, Error::ContextLength(_)) && err.to_string().contains("max_kv_tokens"), "{err}");
}

/// 8 requests of 40 prompt tokens and up to 40 more.
fn forty_and_forty(engine: &Engine) -> Vec<Request> {
    mixed_requests(engine, 8)
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            r.prompt_ids = engine.tokenizer().encode(&PROMPTS[i % PROMPTS.len()].repeat(12), true).unwrap();
            r.prompt_ids.truncate(40);
            r.params.max_tokens = 40;
            r
        })
        .collect()
}

/// Under the paged layout the pool is the budget, counted in blocks: with no `max_kv_tokens` the
/// scheduler admits and preempts so that no request ever runs the pool out of blocks (which
/// would fail it), tokens stay those of a contiguous engine alone, samples of one prompt hold
/// its full blocks once, and every block is back at the end.
#[test]
fn a_paged_pool_is_the_budget_in_blocks() {
    let contiguous = load();
    // 14 blocks of 16: a request takes 3 blocks to start and up to 5 as it grows.
    let engine = load_with(KvLayout::Paged { block_size: 16, num_blocks: 14 });
    let pool = engine.kv_pool().unwrap().clone();
    let requests = forty_and_forty(&engine);
    let expected = alone(&contiguous, &requests);
    let config = SchedulerConfig { prefill_chunk: Some(16), ..SchedulerConfig::default() };
    let mut scheduler = Scheduler::new(engine.clone(), config.clone()).unwrap();
    let mut max_running = 0;
    let mut min_free = pool.num_blocks();
    let run = batched(&mut scheduler, &engine, &requests, |_, s| {
        max_running = max_running.max(s.num_running());
        min_free = min_free.min(pool.num_free());
    });
    assert_same(&expected, &run, &[]);
    assert!(max_running < requests.len() && max_running >= 3, "{max_running} ran at once");
    assert!(scheduler.totals().num_preemptions > 0, "nothing was preempted: {:?}", scheduler.totals());
    assert!(min_free <= 4, "the pool was never close to full: {min_free} blocks free at least");
    assert_eq!(pool.num_free(), pool.num_blocks(), "every block is back");

    // A request that could never fit the pool is refused when added, naming the setting.
    let long = engine.tokenizer().encode(&PROMPTS[2].repeat(20), true).unwrap();
    let err = scheduler.add(99, long, SamplingParams::greedy(8), None).unwrap_err();
    assert!(matches!(err, Error::ContextLength(_)) && err.to_string().contains("max_kv_tokens"), "{err}");
    // max_kv_tokens bounds a paged pool further, in whole blocks; less than one block is refused.
    let err = Scheduler::new(engine.clone(), SchedulerConfig { max_kv_tokens: Some(8), ..config.clone() }).err();
    assert!(err.is_some_and(|e| e.to_string().contains("block")));

    // Samples of one prompt: its full blocks are held once, so the four fit where four copies
    // would not (4 x 4 blocks of prompt > 14), and the budget still preempts as they grow.
    let prompt_ids = engine.tokenizer().encode(&PROMPTS[2].repeat(4), true).unwrap();
    assert!(prompt_ids.len() > 48 && prompt_ids.len() <= 64, "{} prompt tokens", prompt_ids.len());
    let params = SamplingParams { n: 4, ..sampled(40, 7) };
    let want: Vec<Vec<u32>> =
        (0..4).map(|i| contiguous.generate(prompt_ids.clone(), sampled(40, 7 + i), None).unwrap().token_ids).collect();
    let (tokens, totals) = run_samples(&engine, config, &prompt_ids, &params, None, |_, _| {});
    assert_eq!(tokens, want);
    assert_eq!(totals.num_shared_prompt_tokens, 3 * (prompt_ids.len() - 1), "{totals:?}");
    assert_eq!(pool.num_free(), pool.num_blocks());
}

#[test]
fn an_aborted_request_ends_alone() {
    let engine = load();
    let requests = mixed_requests(&engine, 6);
    let expected = alone(&engine, &requests);
    let mut scheduler = Scheduler::new(engine.clone(), SchedulerConfig::default()).unwrap();
    let run = batched(&mut scheduler, &engine, &requests, |step, s| {
        if step == 3 {
            assert!(s.abort(2));
            assert!(!s.abort(2), "aborted twice");
            assert!(!s.abort(777), "an unknown id");
        }
    });
    assert_same(&expected, &run, &[2]);
    let aborted = run.ends[2].as_ref().expect("the aborted request ends");
    assert_eq!(aborted.finish_reason, Some(FinishReason::Abort));
    assert!(aborted.token_ids.len() < expected[2].token_ids.len());
    assert_eq!(aborted.token_ids, expected[2].token_ids[..aborted.token_ids.len()]);
    // Its id is free again once it ended.
    scheduler.add(2, requests[0].prompt_ids.clone(), SamplingParams::greedy(2), None).unwrap();
    assert!(scheduler.add(2, requests[0].prompt_ids.clone(), SamplingParams::greedy(2), None).is_err());
}

/// The launch/finish halves of a step, as an asynchronous loop drives them: requests added and
/// aborted while a step is in flight (an abort of a running request then takes effect after the
/// step, its end with the next), a second launch refused before the finish (no step plans from
/// tokens the one before has not produced), a finish without a launch refused; every request
/// yields what it yields alone.
#[test]
fn steps_launched_then_finished_take_requests_and_aborts_in_flight() {
    let engine = load();
    let requests = mixed_requests(&engine, 8);
    let expected = alone(&engine, &requests);
    let mut scheduler = Scheduler::new(engine.clone(), SchedulerConfig::default()).unwrap();
    let error = scheduler.finish().unwrap_err().to_string();
    assert!(error.contains("call launch before finish"), "{error}");
    for (id, r) in requests.iter().enumerate().take(4) {
        scheduler.add(id as u64, r.prompt_ids.clone(), r.params.clone(), speculation(&engine, r.config)).unwrap();
    }
    let mut run =
        Batched { tokens: vec![Vec::new(); requests.len()], ends: vec![None; requests.len()], reports: Vec::new() };
    let (mut step, mut aborted_at) = (0, None);
    while scheduler.has_unfinished() {
        assert!(scheduler.launch().unwrap(), "step {step} has a forward");
        let error = scheduler.launch().unwrap_err().to_string();
        assert!(error.contains("a step is in flight"), "{error}");
        if step == 1 {
            for (id, r) in requests.iter().enumerate().skip(4) {
                let config = speculation(&engine, r.config);
                scheduler.add(id as u64, r.prompt_ids.clone(), r.params.clone(), config).unwrap();
            }
        }
        if step == 2 {
            assert!(scheduler.abort(1), "request 1 runs");
            assert!(!scheduler.abort(1), "aborted twice");
            aborted_at = Some(run.tokens[1].len());
        }
        let (outputs, report) = scheduler.finish().unwrap();
        assert!(report.launch_s > 0.0 && report.wait_s <= report.finish_s, "{report:?}");
        run.take(outputs, report);
        step += 1;
        assert!(step < 10_000, "the scheduler does not finish");
    }
    assert_same(&expected, &run, &[1]);
    // The step in flight when request 1 was aborted still committed its tokens; it ended after.
    let end = run.ends[1].as_ref().expect("the aborted request ends");
    assert_eq!(end.finish_reason, Some(FinishReason::Abort));
    assert!(end.token_ids.len() > aborted_at.unwrap() && end.token_ids.len() < expected[1].token_ids.len());
    assert_eq!(end.token_ids, expected[1].token_ids[..end.token_ids.len()]);
}

/// A device that records what each target forward reads: per sequence, its first row's position
/// and token (the newest token it was given, or a prompt chunk's first), and the log of forwards
/// and finished steps in order. Everything else is the wrapped model's.
struct RecordingDevice {
    inner: Arc<dyn CausalLm>,
    log: std::sync::Mutex<Vec<Event>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Event {
    /// A target forward's sequences: (first row's position, its token).
    Forward(Vec<(usize, u32)>),
    Finished,
}

impl CausalLm for RecordingDevice {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn device(&self) -> &candle_core::Device {
        self.inner.device()
    }
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }
    fn step_weight_bytes(&self) -> usize {
        self.inner.step_weight_bytes()
    }
    fn kv_read_bytes(&self, context: usize) -> usize {
        self.inner.kv_read_bytes(context)
    }
    fn new_cache(&self, capacity: usize) -> specrs_core::Result<KvCache> {
        self.inner.new_cache(capacity)
    }
    fn new_paged_pool(&self, block_size: usize, num_blocks: usize) -> specrs_core::Result<Arc<PagedPool>> {
        self.inner.new_paged_pool(block_size, num_blocks)
    }
    fn forward_batch(&self, batch: &ForwardBatch, caches: &mut [&mut KvCache]) -> specrs_core::Result<ForwardOutput> {
        if batch.exit_layer.is_none() {
            let firsts = (0..batch.num_seqs()).map(|s| batch.seq_range(s).start);
            let seqs = firsts.map(|row| (batch.positions[row], batch.tokens[row])).collect();
            self.log.lock().unwrap().push(Event::Forward(seqs));
        }
        self.inner.forward_batch(batch, caches)
    }
    fn embed(&self, tokens: &[u32]) -> specrs_core::Result<candle_core::Tensor> {
        self.inner.embed(tokens)
    }
    fn lm_head(
        &self,
        hidden: &candle_core::Tensor,
        subset: Option<&[u32]>,
    ) -> specrs_core::Result<candle_core::Tensor> {
        self.inner.lm_head(hidden, subset)
    }
}

/// The asynchronous loop's ordering on a recording device: each step's forward comes only after
/// the step before finished, and every sequence's first row is a token the loop had already
/// received (the newest of its request's tokens, or a prompt token), never one the step before
/// had yet to produce.
#[test]
fn a_launched_step_reads_only_tokens_the_step_before_produced() {
    let engine = load();
    let recording = Arc::new(RecordingDevice { inner: engine.model().clone(), log: Default::default() });
    let gguf = specrs_core::gguf::GgufFile::open(common::smollm2_path()).unwrap();
    let tokenizer = specrs_core::tokenizer::TextTokenizer::from_gguf(&gguf).unwrap();
    let device = Arc::new(Engine::from_model(recording.clone(), tokenizer, None).unwrap());
    let requests: Vec<Request> =
        mixed_requests(&engine, 8).into_iter().map(|r| Request { config: None, ..r }).collect();
    let mut scheduler = Scheduler::new(device.clone(), SchedulerConfig::default()).unwrap();
    let mut histories: Vec<Vec<u32>> = requests.iter().map(|r| r.prompt_ids.clone()).collect();
    for (id, r) in requests.iter().enumerate() {
        let config = METHODS[1 + id % 2].map(|c| device.speculation(&SpeculativeConfig::from_json(c).unwrap(), None));
        scheduler.add(id as u64, r.prompt_ids.clone(), r.params.clone(), config.transpose().unwrap()).unwrap();
    }
    let mut num_steps = 0;
    while scheduler.has_unfinished() {
        let seen = recording.log.lock().unwrap().len();
        scheduler.launch().unwrap();
        let log = recording.log.lock().unwrap().clone();
        assert!(seen == 0 || log[seen - 1] == Event::Finished, "a forward came before the step before finished");
        for event in &log[seen..] {
            let Event::Forward(seqs) = event else { panic!("a step finished inside a launch") };
            for &(position, token) in seqs {
                let known = requests.iter().zip(&histories).any(|(r, h)| {
                    h.get(position) == Some(&token) && (position < r.prompt_ids.len() || position + 1 == h.len())
                });
                assert!(known, "step {num_steps} read token {token} at {position}, which no step had produced yet");
            }
        }
        let (outputs, _) = scheduler.finish().unwrap();
        recording.log.lock().unwrap().push(Event::Finished);
        for o in outputs {
            assert!(o.error.is_none(), "request {} failed: {:?}", o.id, o.error);
            histories[o.id as usize].extend(&o.token_ids);
        }
        num_steps += 1;
    }
    let forwards = recording.log.lock().unwrap().iter().filter(|e| matches!(e, Event::Forward(_))).count();
    assert!(forwards >= num_steps - 1 && num_steps > 8, "{forwards} forwards in {num_steps} steps");
}

#[test]
fn at_batch_one_the_budget_grants_what_the_request_asks() {
    let engine = load();
    let prompt_ids = engine.tokenizer().encode(&PROMPTS[2].repeat(3), true).unwrap();
    let requests = vec![Request { prompt_ids, params: SamplingParams::greedy(24), config: METHODS[1] }];
    let expected = alone(&engine, &requests);
    let mut scheduler = Scheduler::new(engine.clone(), SchedulerConfig::default()).unwrap();
    let run = batched(&mut scheduler, &engine, &requests, |_, _| {});
    assert_same(&expected, &run, &[]);
    let wanted: usize = run.reports.iter().map(|r| r.num_draft_tokens_wanted).sum();
    assert!(wanted > 0, "the request never wanted a draft");
    for r in &run.reports {
        assert_eq!(r.num_draft_tokens_granted, r.num_draft_tokens_wanted, "{r:?}");
    }
    let m = &expected[0].metrics.spec;
    let t = scheduler.totals();
    assert_eq!((m.num_draft_tokens, m.num_accepted_tokens), (t.num_draft_tokens, t.num_accepted_tokens));
}

#[test]
fn a_saturated_batch_on_an_unprofitable_curve_gets_no_drafts_and_the_same_tokens() {
    let engine = load();
    // Model-free drafts only (a pinned draft model would be granted whatever the curve).
    let requests: Vec<Request> = mixed_requests(&engine, 16)
        .into_iter()
        .filter(|r| r.config.is_some_and(|c| c.contains("ngram") || c.contains("suffix")))
        .collect();
    let expected = alone(&engine, &requests);
    // Every row costs a whole forward: a draft token never buys its time back.
    let linear: Vec<f64> = (1..=32).map(|r| 0.01 * r as f64).collect();
    let config = SchedulerConfig { cost_curve_s: Some(linear), ..SchedulerConfig::default() };
    let mut scheduler = Scheduler::new(engine.clone(), config).unwrap();
    let run = batched(&mut scheduler, &engine, &requests, |_, _| {});
    assert_same(&expected, &run, &[]);
    let saturated: Vec<&StepReport> =
        run.reports.iter().filter(|r| r.num_sequences > 1 && r.num_context_rows == 0).collect();
    assert!(saturated.iter().any(|r| r.num_draft_tokens_wanted > 0), "no saturated step wanted a draft");
    for r in saturated {
        assert_eq!(r.num_draft_tokens_granted, 0, "{r:?}");
    }
    // The requests say so: their speculation stood idle for the load in those steps.
    let idle_for_load: usize = run
        .ends
        .iter()
        .flatten()
        .map(|g| g.metrics.spec.idle_steps_by_reason().iter().find(|(r, _)| *r == "load").unwrap().1)
        .sum();
    assert!(idle_for_load > 0, "no request counted a step idle for the load");
    // With a flat curve (rows free) the same batch gets every draft it wants.
    let config = SchedulerConfig { cost_curve_s: Some(vec![0.01; 32]), ..SchedulerConfig::default() };
    assert_every_wish_granted(config, &requests, &expected);
}

#[test]
fn the_off_budget_drafts_what_each_request_would_alone() {
    let engine = load();
    let requests = mixed_requests(&engine, 8);
    let expected = alone(&engine, &requests);
    // Request 7 samples with a layer-skip draft: its tokens follow its draft lengths, which the two
    // engines here (alone, batched) read from the pinned costs, not from their own timings.
    assert!(requests[7].params.seed.is_some() && requests[7].config.is_some_and(|c| c.contains("layer_skip")));
    assert!(expected[7].metrics.spec.num_draft_tokens > 0, "the sampled layer-skip request never drafted");
    let config = SchedulerConfig { draft_budget: DraftBudget::Off, ..SchedulerConfig::default() };
    assert_every_wish_granted(config, &requests, &expected);
}

/// Runs `requests` under `config` on a fresh engine: the tokens of `expected`, and every step
/// granted every draft token its requests wanted.
fn assert_every_wish_granted(config: SchedulerConfig, requests: &[Request], expected: &[Generation]) {
    let engine = load();
    let mut scheduler = Scheduler::new(engine.clone(), config).unwrap();
    let run = batched(&mut scheduler, &engine, requests, |_, _| {});
    assert_same(expected, &run, &[]);
    for r in &run.reports {
        assert_eq!(r.num_draft_tokens_granted, r.num_draft_tokens_wanted, "{r:?}");
    }
}

#[test]
fn bad_scheduler_settings_are_refused_by_name() {
    let engine = load();
    for (config, words) in [
        (SchedulerConfig { max_num_seqs: 0, ..SchedulerConfig::default() }, "max_num_seqs"),
        (SchedulerConfig { max_num_batched_tokens: 4, ..SchedulerConfig::default() }, "max_num_batched_tokens"),
        (SchedulerConfig { prefill_chunk: Some(0), ..SchedulerConfig::default() }, "prefill_chunk"),
        (SchedulerConfig { cost_curve_s: Some(vec![]), ..SchedulerConfig::default() }, "cost curve"),
    ] {
        let err = Scheduler::new(engine.clone(), config).err().expect("refused");
        assert!(err.to_string().contains(words), "{err}");
    }
    assert!(DraftBudget::parse("sometimes").unwrap_err().to_string().contains("'load' or 'off'"));
}

/// Runs `n` samples of `prompt_ids` (ids 0..n) through a scheduler made with `config`, calling
/// `before_step` first; each sample's tokens as streamed, and the scheduler's totals.
fn run_samples(
    engine: &Arc<Engine>,
    config: SchedulerConfig,
    prompt_ids: &[u32],
    params: &SamplingParams,
    spec: Option<&str>,
    mut before_step: impl FnMut(usize, &mut Scheduler),
) -> (Vec<Vec<u32>>, specrs_core::SchedulerTotals) {
    let mut scheduler = Scheduler::new(engine.clone(), config).unwrap();
    let ids: Vec<u64> = (0..params.n as u64).collect();
    let speculations = ids.iter().map(|_| speculation(engine, spec)).collect();
    scheduler.add_samples(&ids, prompt_ids.to_vec(), params.clone(), speculations).unwrap();
    let mut tokens = vec![Vec::new(); params.n];
    let mut step = 0;
    while scheduler.has_unfinished() {
        before_step(step, &mut scheduler);
        let (outputs, _) = scheduler.step().unwrap();
        for o in outputs {
            assert!(o.error.is_none(), "sample {} failed: {:?}", o.id, o.error);
            tokens[o.id as usize].extend(&o.token_ids);
        }
        step += 1;
        assert!(step < 10_000, "the scheduler does not finish");
    }
    (tokens, scheduler.totals())
}

#[test]
fn samples_share_the_prompt_through_chunked_prefill_and_preemption_and_prefill_alone_when_the_first_is_gone() {
    let engine = load();
    let prompt_ids = engine.tokenizer().encode(&PROMPTS[2].repeat(10), true).unwrap();
    let num_prompt = prompt_ids.len();
    let params = SamplingParams { n: 4, ..sampled(30, 7) };
    let spec = METHODS[1];
    // Sample i is the request seeded 7 + i, alone.
    let expected: Vec<Vec<u32>> = (0..4)
        .map(|i| engine.generate(prompt_ids.clone(), sampled(30, 7 + i), speculation(&engine, spec)).unwrap().token_ids)
        .collect();
    let no_hook = |_: usize, _: &mut Scheduler| {};

    // The first sample's prompt is read in chunks; the others wait for all of it, then copy it.
    let chunked = SchedulerConfig { prefill_chunk: Some(32), ..SchedulerConfig::default() };
    let (tokens, totals) = run_samples(&engine, chunked, &prompt_ids, &params, spec, no_hook);
    assert_eq!(tokens, expected);
    assert_eq!(totals.num_shared_prompt_tokens, 3 * (num_prompt - 1));

    // A KV budget for two prompts and 30 tokens: the others wait, and growing samples are preempted.
    let tight = SchedulerConfig { max_kv_tokens: Some(2 * num_prompt + 30), ..SchedulerConfig::default() };
    let (tokens, totals) = run_samples(&engine, tight, &prompt_ids, &params, spec, no_hook);
    assert_eq!(tokens, expected);
    assert!(totals.num_shared_prompt_tokens >= num_prompt - 1 && totals.num_preemptions > 0, "{totals:?}");

    // One at a time: the first has ended (its cache freed) before the others start.
    let one = SchedulerConfig { max_num_seqs: 1, ..SchedulerConfig::default() };
    let (tokens, totals) = run_samples(&engine, one, &prompt_ids, &params, spec, no_hook);
    assert_eq!(tokens, expected);
    assert_eq!(totals.num_shared_prompt_tokens, 0);

    // The first is aborted before it ran: the others are prefilled like any request.
    let abort_first = |step: usize, s: &mut Scheduler| {
        if step == 0 {
            assert!(s.abort(0));
        }
    };
    let (tokens, totals) = run_samples(&engine, SchedulerConfig::default(), &prompt_ids, &params, spec, abort_first);
    assert!(tokens[0].is_empty());
    assert_eq!(tokens[1..], expected[1..]);
    assert_eq!(totals.num_shared_prompt_tokens, 0);
}

/// Requests drafting from a draft model (SmolLM2 drafting for itself, alone and inside "auto";
/// greedy and seeded sampling) have their chains drafted together, one draft forward per depth
/// for the whole batch rather than one per request and token, and yield what they yield alone.
#[test]
fn draft_model_chains_drafted_together_yield_what_each_request_yields_alone() {
    let engine = load();
    let draft = common::smollm2_path();
    let leak = |config: String| -> &'static str { Box::leak(config.into_boxed_str()) };
    let draft_model = leak(format!(
        r#"{{"method": "draft_model", "model": {draft:?}, "num_speculative_tokens": 3, "adaptive_draft_length": false}}"#
    ));
    // Costs pinned so that the model pays at the prior acceptance: auto drafts from it where no
    // lookup matches, as the engine alone and the batched one both decide.
    let auto = leak(format!(
        r#"{{"method": "auto", "model": {draft:?}, "num_speculative_tokens": 3,
             "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3], "draft_cost": 0.05}}"#
    ));
    // auto's requests are greedy: its suffix lookup reads the engine-wide suffix cache, which the
    // other requests fill as they end (in another order alone than batched), and a sampled
    // request's tokens follow its drafts.
    let requests: Vec<Request> = (0..6)
        .map(|i| {
            let prompt_ids = engine.tokenizer().encode(PROMPTS[i % PROMPTS.len()], true).unwrap();
            let config = [draft_model, auto, draft_model][i % 3];
            let params =
                if i % 2 == 1 && config != auto { sampled(20, 300 + i as u64) } else { SamplingParams::greedy(20) };
            Request { prompt_ids, params, config: Some(config) }
        })
        .collect();
    let expected = alone(&engine, &requests);
    let from_model = |g: &Generation| g.metrics.drafters.iter().any(|d| d.name == "draft_model" && d.num_drafts > 0);
    assert!(expected.iter().skip(1).step_by(3).all(from_model), "auto never drafted from its model");

    let config = SchedulerConfig { draft_budget: DraftBudget::Off, ..SchedulerConfig::default() };
    let mut scheduler = Scheduler::new(engine.clone(), config).unwrap();
    let run = batched(&mut scheduler, &engine, &requests, |_, _| {});
    assert_same(&expected, &run, &[]);
    let totals = scheduler.totals();
    assert!(run.reports.iter().any(|r| r.num_chains_drafted_together >= 4), "{totals:?}");
    for r in &run.reports {
        // k = 3: at most three forwards however many chains (the first one reads what each draft
        // has not seen yet, the prompt at first).
        assert!(r.num_shared_draft_forwards <= 3, "{r:?}");
    }
    assert!(totals.num_shared_draft_forwards * 2 < totals.num_chains_drafted_together * 3, "{totals:?}");
}
