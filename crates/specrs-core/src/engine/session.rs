//! `Session`: one request's decoding state, stepped as plan -> forward -> commit.
//!
//! `plan` asks the proposer for a draft and returns this request's rows of the next forward
//! (prompt chunk, prompt, or [newest token, draft...]); the forward runs them (alone in `step`,
//! or gathered with other sessions' rows by `scheduler.rs`); `commit` verifies the draft against
//! the returned logits, truncates the cache to what was kept, tells the proposer (`Feedback`),
//! and emits the tokens. `generate` and the Python stream are loops over `step`.
//!
//! A scheduler may cap a plan (`plan_with`: context rows, draft tokens) and may take a request's
//! cache away (`preempt`); the next plans then feed the context again before decoding resumes.
//!
//! Each emitted token's text is decoded as it is committed (`output_text.rs`): a stop string ends
//! the request at the token that completes it, whichever step (and draft) that token came in,
//! and the tokens verified after it are never emitted, so the output, the suffix cache and the
//! proposer's `finish` see exactly plain decoding's tokens.
//!
//! A request whose settings change the logits (grammar, allowed_token_ids, bad_words, penalties,
//! logit_bias, min_tokens) has every verified row processed as plain decoding would process it
//! (`logits_processor.rs`); its drafts are cut where its grammar forbids them, and the tokens its
//! grammar forces open the drafts (chains and trees) of proposers that draft from the context
//! alone (`grammar_drafts`).
//!
//! Invariant: after every commit of an unfinished request that was not preempted, the cache holds
//! exactly the prompt plus every generated token but the newest one (which the next forward
//! consumes), so `cache.len() == all_ids.len() - 1`; rejected draft tokens never stay in the cache.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Tensor;

use super::logits_processor::{bad_words_token_ids, LogitsProcessor};
use super::output_text::OutputText;
use super::step_together::step_together;
use super::{lock, Engine, Speculation};
use crate::config::SamplingParams;
use crate::costs::{CostSource, DraftCost};
use crate::detokenizer::IncrementalDetokenizer;
use crate::draft_budget::DraftWish;
use crate::draft_length::Verdict;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::metrics::{EngineMetrics, IdleReason, RequestMetrics, RequestTimer, SpecDecodeMetrics};
use crate::model::{CausalLm, LogitRows, SeqRows, Tap};
use crate::proposer::chains_together::ChainJob;
use crate::proposer::ngram_together::NgramJob;
use crate::proposer::suffix_together::SuffixJob;
use crate::proposer::tree::{path_tokens, rank_paths};
use crate::proposer::{Draft, Feedback, ProposeInput, TreeLimits};
use crate::sampler::Sampler;
use crate::spec_config::Verification;
use crate::tokenizer::TextTokenizer;
use crate::verify::batch::{SeqRule, VerifyBatchBuilder};
use crate::verify::host::sequence_inputs;
use crate::verify::tree::TreeVerification;

impl Engine {
    /// Starts a request, speculative when `speculation` is given. Fails with `ContextLength` when
    /// prompt (after `truncate_prompt_tokens`) + max_tokens exceeds the context. Its KV cache
    /// reserves room for the whole request.
    pub fn start(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculation: Option<Speculation>,
    ) -> Result<Session> {
        let needed = self.request_prompt(&prompt_ids, &params).len() + params.max_tokens;
        self.start_reserving(prompt_ids, params, speculation, needed)
    }

    /// `start` with `reserve` KV positions allocated up front; the cache grows (by doubling) past
    /// them as the request needs. A scheduler that counts what requests hold, not what they may
    /// one day need, reserves little.
    pub fn start_reserving(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculation: Option<Speculation>,
        reserve: usize,
    ) -> Result<Session> {
        let prompt_ids = self.request_prompt(&prompt_ids, &params).to_vec();
        self.check_request(&prompt_ids, &params)?;
        let constraint = match &params.grammar {
            Some(spec) => Some(self.compile_grammar(spec)?),
            None => None,
        };
        let bad_words = self.bad_words_token_ids(&params)?;
        let eos = self.tokenizer.eos_token_ids();
        let processor = LogitsProcessor::new(&params, &prompt_ids, eos, constraint, bad_words);
        let cache = self.new_target_cache(reserve)?;
        let timer = RequestTimer::new();
        let sampler = Sampler::new(params.seed);
        let mut speculation = speculation;
        if let Some(speculation) = speculation.as_mut() {
            // A coupled draft draws with the verifier's positional uniforms: under "coupled" an
            // unseeded request's proposer gets the seed drawn above; under "auto" it stays
            // unseeded (and drafts for rejection sampling).
            let drafting = if speculation.verification == Verification::Coupled && params.seed.is_none() {
                Cow::Owned(SamplingParams { seed: Some(sampler.seed()), ..params.clone() })
            } else {
                Cow::Borrowed(&params)
            };
            speculation.proposer.begin(&prompt_ids, &drafting)?;
        }
        Ok(Session {
            model: self.model.clone(),
            tokenizer: self.tokenizer.clone(),
            cache,
            prompt_len: prompt_ids.len(),
            detokenizer: IncrementalDetokenizer::new(
                prompt_ids.len(),
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            ),
            output: OutputText::new(params.stop.clone(), params.include_stop_str_in_output),
            all_ids: prompt_ids,
            sampler,
            params,
            timer,
            num_forward_passes: 0,
            finish_reason: None,
            stop_reason: None,
            speculation,
            spec_metrics: SpecDecodeMetrics::default(),
            engine_metrics: self.metrics.clone(),
            prefill_chunk: None,
            tree_draft_timing: None,
            processor,
            logprobs: Vec::new(),
            cost_idle: None,
        })
    }

    /// The prompt a request with `params` runs on: `prompt_ids`, cut to its last
    /// `truncate_prompt_tokens` tokens when asked (vLLM's left truncation).
    pub fn request_prompt<'a>(&self, prompt_ids: &'a [u32], params: &SamplingParams) -> &'a [u32] {
        params.truncated_prompt(prompt_ids, self.model.info().context_length)
    }

    /// The token sequences `params.bad_words` ban (`logits_processor::bad_words_token_ids`); a
    /// word that tokenizes to nothing is a ConfigError.
    pub fn bad_words_token_ids(&self, params: &SamplingParams) -> Result<Vec<Vec<u32>>> {
        bad_words_token_ids(&params.bad_words, |word| self.tokenizer.encode(word, false))
    }

    /// What `start` refuses before allocating anything: bad sampling parameters, n > 1 (a session
    /// is one sample), an empty prompt, token ids outside the vocabulary, or prompt + max_tokens
    /// past the context.
    pub fn check_request(&self, prompt_ids: &[u32], params: &SamplingParams) -> Result<()> {
        params.validate()?;
        if params.n > 1 {
            return Err(Error::config(format!(
                "n = {} asks for {} samples, but a request here yields one; add them together with \
                 Scheduler::add_samples (Python: Engine.generate_samples), which shares their prompt's prefill",
                params.n, params.n
            )));
        }
        if prompt_ids.is_empty() {
            return Err(Error::config("the prompt is empty; pass at least one token"));
        }
        let vocab = self.model.info().vocab_size;
        if let Some(bad) = prompt_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::config(format!("prompt token id {bad} is outside the vocabulary (size {vocab})")));
        }
        params.check_token_ids(vocab)?;
        self.check_context(prompt_ids.len(), Some(params.max_tokens), "max_tokens")
    }

    /// Whether a request fits the context: its prompt must leave room for one new token, and
    /// with `max_tokens` (None: the prompt alone, for a caller that sizes max_tokens from the room
    /// left, as a server's default does) the prompt plus max_tokens must fit. `limit_name` is the
    /// field that set max_tokens, named in the message (a server's "max_completion_tokens").
    /// The one context check: `check_request` and the server both call it.
    pub fn check_context(&self, prompt_len: usize, max_tokens: Option<usize>, limit_name: &str) -> Result<()> {
        let context = self.model.info().context_length;
        if prompt_len >= context {
            return Err(Error::ContextLength(format!(
                "this model's maximum context length is {context} tokens, but the prompt has {prompt_len}, which \
                 leaves no room for an answer; shorten the prompt"
            )));
        }
        let Some(max_tokens) = max_tokens else { return Ok(()) };
        let needed = prompt_len.saturating_add(max_tokens);
        if needed > context {
            return Err(Error::ContextLength(format!(
                "this model's maximum context length is {context} tokens, but {needed} were requested \
                 ({prompt_len} in the prompt, {max_tokens} in {limit_name}); shorten the prompt or lower {limit_name}"
            )));
        }
        Ok(())
    }

    /// Compiles `params`' grammar, if any, so a server can refuse a bad one before it answers
    /// (an `Error::Config` carrying llguidance's reason). A good one is kept in the grammar
    /// cache, so the request's start does not compile it again (`compile_grammar`).
    pub fn check_grammar(&self, params: &SamplingParams) -> Result<()> {
        match &params.grammar {
            Some(spec) => self.compile_grammar(spec).map(drop),
            None => Ok(()),
        }
    }

    /// Runs a request to completion.
    pub fn generate(
        &self,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
        speculation: Option<Speculation>,
    ) -> Result<Generation> {
        let mut session = self.start(prompt_ids, params, speculation)?;
        while !session.is_finished() {
            session.step()?;
        }
        Ok(session.result())
    }
}

/// Why a request stopped, with vLLM's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token was generated, a stop string completed, or the grammar
    /// ended.
    Stop,
    /// max_tokens was reached.
    Length,
    /// The caller stopped the request (a cancelled stream).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What ended a request that stopped on a stop string or a stop token (vLLM's `stop_reason`;
/// None for an end-of-sequence token, the grammar's end, max_tokens or an abort).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// A string of `SamplingParams::stop`.
    Text(String),
    /// A token of `SamplingParams::stop_token_ids`.
    TokenId(u32),
}

/// The forward a step's rows were part of: its seconds and its rows (every session's, in a
/// batched forward), which a request's own draft cost is timed against.
#[derive(Debug, Clone, Copy)]
pub struct ForwardTiming {
    pub seconds: f64,
    pub rows: usize,
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub token_ids: Vec<u32>,
    pub text: String,
    /// One per token of `token_ids` when the request asked for logprobs.
    pub logprobs: Vec<TokenLogprobs>,
}

/// One emitted token's log-probability and the most likely alternatives at its position, from
/// the distribution the request samples from before its top-k / top-p / min-p filters: the
/// processed logits (grammar, bias, penalties) divided by the temperature (1 when greedy),
/// log-softmaxed, floored at -9999 (vLLM's; JSON has no -inf). The same for an accepted,
/// recovered or bonus token as plain decoding's.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token_id: u32,
    pub logprob: f32,
    /// `(token_id, logprob)`, most likely first (ties: lower id first); as many as asked for.
    pub top: Vec<(u32, f32)>,
}

/// A finished (or stopped) request.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    /// The stop string or stop token that ended it, if one did.
    pub stop_reason: Option<StopReason>,
    pub metrics: RequestMetrics,
    /// One per generated token when the request asked for logprobs.
    pub logprobs: Option<Vec<TokenLogprobs>>,
}

/// What kind of forward a plan asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PlanKind {
    /// Context rows that yield no token: a prompt chunk (chunked prefill), or part of the context
    /// of a preempted request being recomputed.
    PrefillChunk,
    /// The (rest of the) prompt: yields the first token.
    Prefill,
    /// The newest token and a draft (possibly empty).
    Decode,
}

/// Caps a scheduler puts on one session's next plan (`Session::plan_with`); None: no cap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanLimits {
    /// Context rows (prompt, or the context of a preempted request) this step may feed.
    pub max_context_rows: Option<usize>,
    /// Draft tokens this step may verify.
    pub max_draft_tokens: Option<usize>,
}

/// One session's part of the next forward (`Session::plan`), handed back to its commit
/// (`commit_context`, then `commit_verdict`).
#[derive(Debug)]
pub struct StepPlan {
    /// The rows to run after the session's cache.
    pub rows: SeqRows,
    kind: PlanKind,
    draft: Draft,
    /// Leading draft tokens the grammar forced (not the proposer's).
    num_forced: usize,
    /// Positions the cache held when planned.
    cache_len: usize,
    /// Rows of `rows` that are context (prompt or newest token), before the draft.
    num_unseen: usize,
    /// Why a speculating request's decode plan has no draft.
    idle: Option<IdleReason>,
}

impl StepPlan {
    /// Whether the plan's forward yields a token to verify (every plan but a prompt chunk's).
    pub(super) fn yields_a_token(&self) -> bool {
        self.kind != PlanKind::PrefillChunk
    }

    /// Draft tokens this plan verifies.
    pub fn num_draft_tokens(&self) -> usize {
        self.draft.token_ids.len()
    }
}

/// A chain a scheduler looks up together with other sessions' on the device (`Session::lookup_job`).
pub(crate) enum LookupJob<'a> {
    Ngram(NgramJob<'a>),
    Suffix(SuffixJob<'a>),
}

pub struct Session {
    model: Arc<dyn CausalLm>,
    tokenizer: Arc<TextTokenizer>,
    cache: KvCache,
    /// Prompt followed by every generated token.
    all_ids: Vec<u32>,
    prompt_len: usize,
    params: SamplingParams,
    sampler: Sampler,
    detokenizer: IncrementalDetokenizer,
    /// The output's text: emitted, and held back while it may begin a stop string.
    output: OutputText,
    timer: RequestTimer,
    num_forward_passes: usize,
    finish_reason: Option<FinishReason>,
    stop_reason: Option<StopReason>,
    speculation: Option<Speculation>,
    spec_metrics: SpecDecodeMetrics,
    engine_metrics: Arc<Mutex<EngineMetrics>>,
    /// At most this many prompt tokens per step (None: the whole prompt in the first step).
    prefill_chunk: Option<usize>,
    /// The last tree draft's drafting seconds and depth, for the tree chooser's draft cost (None
    /// where it read a backlog of context first).
    tree_draft_timing: Option<(f64, usize)>,
    /// Grammar, penalties, logit_bias, min_tokens (None: the logits are sampled as they come).
    processor: Option<LogitsProcessor>,
    /// Every generated token's logprobs, when asked for.
    logprobs: Vec<TokenLogprobs>,
    /// The cost judgement of the last step that drafted nothing for cost, for `idle_reason`.
    cost_idle: Option<CostIdle>,
}

/// Why the last step idle for cost judged no draft to pay.
#[derive(Debug, Clone, Copy)]
enum CostIdle {
    /// The chain policy's best length and its predicted speedup.
    Chain(Verdict),
    /// The chain policy's best length pays per step, but over the tokens left it would not win
    /// back the draft's catching up on the context it has not read (`OwnLengths::catch_up`).
    CatchUp(CatchUp),
    /// The tree chooser planned no level (its estimates are per depth and sibling rank).
    Tree,
}

/// A draft's reading of context it has not read before its next draft, which its best length
/// did not win back over the request's remaining tokens (`DraftLengthPolicy::pays_back`).
#[derive(Debug, Clone, Copy)]
struct CatchUp {
    unseen: usize,
    steps: f64,
    remaining: usize,
    /// The speedup weighed, and whether at the request's own acceptance (else the engine's).
    speedup: f64,
    observed: bool,
}

/// A request's next draft length: what its settings allow (k, max_tokens, the heuristic
/// schedule) and what it would draft alone (that, cut by its cost-aware policy), with the
/// catch-up that cut it to nothing, if one did. Both 0 without speculation.
struct OwnLengths {
    settings_max: usize,
    own: usize,
    catch_up: Option<CatchUp>,
}

impl Session {
    /// Chunked prefill: a step feeds at most `tokens` prompt tokens, so a server interleaving
    /// requests stalls the others for one chunk rather than a whole long prompt. Rows are
    /// computed independently, so the logits and the output do not change.
    pub fn set_prefill_chunk(&mut self, tokens: Option<usize>) -> Result<()> {
        if tokens == Some(0) {
            return Err(Error::config("the prefill chunk must be at least 1 token (or None for no chunking)"));
        }
        self.prefill_chunk = tokens;
        Ok(())
    }

    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }

    pub fn generated_ids(&self) -> &[u32] {
        &self.all_ids[self.prompt_len..]
    }

    /// One step for this request alone, through the scheduler's driver (`step_together`): plan,
    /// one target forward over the planned rows, one verification, commit.
    pub fn step(&mut self) -> Result<StepOutput> {
        let mut sessions = [self];
        step_together(&mut sessions)?.pop().expect("one session, one result")
    }

    /// Hidden states this request's proposer reads from the target (`Proposer::taps`); a forward
    /// over this session's rows must return them.
    pub fn taps(&self) -> Vec<Tap> {
        self.speculation.as_ref().map_or_else(Vec::new, |s| s.proposer.taps())
    }

    /// The model this session's forwards run on (a scheduler gathers sessions of one model).
    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.model
    }

    /// The target cache the planned rows extend, for the forward between `plan` and `commit`.
    pub fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// This request's part of the next target forward: a prompt chunk, the whole (rest of the)
    /// prompt, or the newest token followed by the proposer's draft. None once finished. The
    /// forward must append exactly these rows to `cache_mut()` before `commit`.
    pub fn plan(&mut self) -> Result<Option<StepPlan>> {
        self.plan_with(PlanLimits::default())
    }

    /// `plan` within a scheduler's caps: at most `max_context_rows` context rows (on top of the
    /// session's own prefill chunk) and at most `max_draft_tokens` draft tokens (on top of what
    /// the request's own speculation settings ask for). After `preempt`, the context is fed again
    /// from the start, in chunks, before decoding resumes.
    pub fn plan_with(&mut self, limits: PlanLimits) -> Result<Option<StepPlan>> {
        if self.is_finished() {
            return Ok(None);
        }
        let cache_len = self.cache.len();
        let num_unseen = self.all_ids.len() - cache_len;
        let is_prefill = self.all_ids.len() == self.prompt_len;
        let mut chunk_limit = match (self.prefill_chunk, limits.max_context_rows) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if !is_prefill && num_unseen > 1 {
            // Recomputing a preempted request: all but the newest token go in without logits, so
            // its next plan is the decode step, with the draft, it would have taken unpreempted
            // (a seeded sampler and the draft-length policy then see the same steps as alone).
            chunk_limit = Some(chunk_limit.map_or(num_unseen - 1, |chunk| chunk.min(num_unseen - 1)));
        }
        if let Some(chunk) = chunk_limit.filter(|&chunk| num_unseen > chunk) {
            if chunk == 0 {
                return Err(Error::Internal("plan_with: a scheduler gave a session no context row".into()));
            }
            // A context chunk alone yields no token; its logits are not needed.
            let tokens = self.all_ids[cache_len..cache_len + chunk].to_vec();
            return Ok(Some(StepPlan {
                rows: SeqRows::chain(tokens, LogitRows::None),
                kind: PlanKind::PrefillChunk,
                draft: Draft::default(),
                num_forced: 0,
                cache_len,
                num_unseen: chunk,
                idle: None,
            }));
        }
        // A draft needs the whole context in the cache (a layer-skip draft extends it).
        let (draft, num_forced, idle) =
            if num_unseen > 1 { (Draft::default(), 0, None) } else { self.propose(limits.max_draft_tokens)? };
        let mut input = self.all_ids[cache_len..].to_vec();
        input.extend_from_slice(&draft.token_ids);
        // Logits for the newest token and every draft token: [num_draft_tokens + 1, vocab].
        let num_logit_rows = draft.token_ids.len() + 1;
        let mut rows = SeqRows::chain(input, LogitRows::All);
        rows.logit_rows = (num_unseen - 1..num_unseen - 1 + num_logit_rows).collect();
        if let Some(parents) = &draft.parents {
            // A tree hangs below the newest token (row num_unseen - 1).
            let root = num_unseen as i32 - 1;
            for (row, &parent) in rows.parents[num_unseen..].iter_mut().zip(parents) {
                *row = if parent < 0 { root } else { root + 1 + parent };
            }
        }
        let kind = if is_prefill { PlanKind::Prefill } else { PlanKind::Decode };
        Ok(Some(StepPlan { rows, kind, draft, num_forced, cache_len, num_unseen, idle }))
    }

    /// The start of every commit: checks the forward added exactly the plan's rows and counts it;
    /// a prompt chunk (no token, nothing to verify) is committed here (returns true).
    pub(super) fn commit_context(&mut self, plan: &StepPlan, hidden: &[(Tap, Tensor)]) -> Result<bool> {
        if self.cache.len() != plan.cache_len + plan.rows.tokens.len() {
            return Err(Error::Internal(format!(
                "commit: the cache holds {} positions, but the plan left it at {} and added {} rows",
                self.cache.len(),
                plan.cache_len,
                plan.rows.tokens.len()
            )));
        }
        self.num_forward_passes += 1;
        if !plan.yields_a_token() {
            self.observe_hidden(plan.cache_len, plan.rows.tokens.len(), hidden)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Whether this request's logits are processed before verification (a grammar, penalties,
    /// logit bias: `process_logits`); the step copies the forward's logits only for such.
    pub(super) fn processes_logits(&self) -> bool {
        self.processor.is_some()
    }

    /// Processes this session's host logits `[n + 1, vocab]` for its plan's draft in place, before
    /// the step's one verification; a no-op without a processor.
    pub(super) fn process_logits(&mut self, plan: &StepPlan, logits: &mut [f32]) -> Result<()> {
        let vocab = self.model.info().vocab_size;
        match self.processor.as_mut() {
            Some(processor) => processor.process_rows(logits, vocab, &draft_paths(&plan.draft)),
            None => Ok(()),
        }
    }

    /// This session's sequence in the step's one verification (`step_together`): its draft, its
    /// rule and what the rule reads of its random streams (`host::sequence_inputs`).
    pub(super) fn verify_part(&self, plan: &StepPlan, batch: &mut VerifyBatchBuilder) -> Result<()> {
        let draft = &plan.draft;
        let parents = draft.parents();
        let rule = SeqRule::new(&self.params, draft.probs.is_some(), draft.parents.is_some());
        let (row_noise, uniforms) = sequence_inputs(&rule, &parents, &self.sampler, self.all_ids.len())?;
        batch.push(&draft.token_ids, &parents, rule, &row_noise, &uniforms, draft.probs.as_deref());
        Ok(())
    }

    /// `commit` of a session verified in the step's one verification: `accepted` (its accepted
    /// nodes, root's child first), `next_token` and the sequential uniforms the walk read, over its
    /// processed `host_logits` `[n + 1, vocab]`; `verify_s`: that verification's seconds (shared by
    /// every session in it, like `forward`).
    #[allow(clippy::too_many_arguments)] // the verdict's three parts and commit's own inputs
    pub(super) fn commit_verdict(
        &mut self,
        plan: StepPlan,
        accepted: &[u32],
        next_token: u32,
        uniforms_used: usize,
        host_logits: &[f32],
        hidden: &[(Tap, Tensor)],
        forward: ForwardTiming,
        verify_s: f64,
    ) -> Result<StepOutput> {
        self.sampler.skip_uniforms(uniforms_used);
        let accepted_path: Vec<usize> = accepted.iter().map(|&node| node as usize).collect();
        let mut token_ids: Vec<u32> = accepted_path.iter().map(|&node| plan.draft.token_ids[node]).collect();
        token_ids.push(next_token);
        let verification = TreeVerification { accepted_path, token_ids };
        self.apply_verification(plan, verification, host_logits, hidden, forward, verify_s)
    }

    /// The rest of a commit, once the draft is verified (in `verify_s` seconds): keeps the
    /// accepted positions, tells the proposer and the policies, emits the tokens (with logprobs
    /// from `host_logits`, which a request that reports none may leave empty).
    fn apply_verification(
        &mut self,
        plan: StepPlan,
        verification: TreeVerification,
        host_logits: &[f32],
        hidden: &[(Tap, Tensor)],
        forward: ForwardTiming,
        verify_s: f64,
    ) -> Result<StepOutput> {
        let t1 = Instant::now();
        let draft = &plan.draft;
        let num_draft_tokens = draft.token_ids.len();
        let num_accepted = verification.accepted_path.len();
        // Keep [newest token, accepted path]; the rest of the draft leaves the cache.
        let kept_start = plan.cache_len + plan.num_unseen;
        let hidden = if draft.parents.is_some() {
            self.cache.keep(kept_start, &verification.accepted_path)?;
            // The kept rows' hidden states, in the order the cache now holds them.
            let rows: Vec<u32> = (0..plan.num_unseen)
                .chain(verification.accepted_path.iter().map(|&node| plan.num_unseen + node))
                .map(|row| row as u32)
                .collect();
            hidden
                .iter()
                .map(|(tap, t)| Ok((*tap, t.index_select(&Tensor::new(rows.as_slice(), t.device())?, 0)?)))
                .collect::<Result<Vec<_>>>()?
        } else {
            self.cache.truncate(kept_start + num_accepted);
            hidden.to_vec()
        };
        let hidden = hidden.as_slice();
        self.observe_hidden(plan.cache_len, plan.num_unseen + num_accepted, hidden)?;
        if plan.kind == PlanKind::Decode {
            self.spec_metrics.num_decode_steps += 1;
            if num_draft_tokens == 0 && self.speculation.is_some() {
                self.spec_metrics.observe_idle(plan.idle.unwrap_or(IdleReason::NoDraft));
            }
            self.spec_metrics.forward_s += forward.seconds;
            self.spec_metrics.verify_s += verify_s + t1.elapsed().as_secs_f64();
        }
        if num_draft_tokens > 0 {
            self.spec_metrics.observe_draft(num_draft_tokens, num_accepted);
            let num_forced = plan.num_forced;
            let num_forced_accepted = verification.accepted_path.iter().filter(|&&node| node < num_forced).count();
            self.spec_metrics.num_grammar_draft_tokens += num_forced;
            self.spec_metrics.num_grammar_accepted_tokens += num_forced_accepted;
            // The proposer's own part of the draft, for the policies that judge its drafts.
            let own_tree = own_part(&draft.parents(), &verification.accepted_path, num_forced)
                .filter(|(parents, _)| !parents.is_empty());
            let own_observation =
                own_tree.as_ref().map(|(parents, accepted_path)| (parents.len(), accepted_path.len()));
            if draft.is_tree() {
                self.spec_metrics.observe_tree(num_draft_tokens, draft.depth(), num_accepted);
            }
            // The tree chooser follows this request's drafting time where its tokens do not depend
            // on its draft lengths and the config does not pin c.
            let tree_draft_timing = self.tree_draft_timing.take().filter(|_| self.follows_draft_timings());
            if let Some(speculation) = self.speculation.as_mut() {
                if let Some((policy, (drafted, accepted))) = speculation.draft_length.as_mut().zip(own_observation) {
                    policy.observe(drafted, accepted);
                    if let Some(recorder) = &speculation.acceptance_recorder {
                        recorder.record(drafted, accepted)?;
                    }
                }
                if let Some((chooser, (parents, accepted_path))) = speculation.tree_chooser.as_mut().zip(own_tree) {
                    chooser.observe(&parents, &accepted_path);
                    if let Some((draft_s, depth)) = tree_draft_timing {
                        chooser.observe_timing(draft_s, depth, forward.seconds, forward.rows);
                    }
                }
                if let Some((schedule, (drafted, accepted))) = speculation.schedule.as_mut().zip(own_observation) {
                    schedule.observe(drafted, accepted);
                }
                let feedback = Feedback {
                    num_accepted_tokens: num_accepted,
                    accepted_path: &verification.accepted_path,
                    token_ids: &verification.token_ids,
                    hidden,
                };
                speculation.proposer.observe(&feedback)?;
            }
        }

        let mut new_ids = Vec::with_capacity(verification.token_ids.len());
        let mut new_logprobs = Vec::new();
        let rows = emitted_rows(&verification.accepted_path);
        for (&token, &row) in verification.token_ids.iter().zip(&rows) {
            self.all_ids.push(token);
            new_ids.push(token);
            if let Some(n) = self.params.logprobs {
                let vocab = self.model.info().vocab_size;
                let row = &host_logits[row * vocab..(row + 1) * vocab];
                new_logprobs.push(token_logprobs(row, token, n, self.params.temperature));
            }
            if let Some(processor) = self.processor.as_mut() {
                processor.accept(&[token])?;
            }
            // The tokens verified after one that ends the request are never emitted.
            self.take_token(token)?;
            if self.is_finished() {
                break;
            }
        }
        self.logprobs.extend(new_logprobs.iter().cloned());
        self.timer.tokens_arrived(new_ids.len());
        let text = self.output.release(self.is_finished());
        if self.is_finished() {
            self.on_finish();
        }
        Ok(StepOutput { token_ids: new_ids, text, logprobs: new_logprobs })
    }

    /// Adds the text of `token`, just appended to the output, and ends the request there when it
    /// should end, in vLLM's order: an end-of-sequence or stop token (whose text is left out
    /// unless `include_stop_str_in_output`), a stop string completed by its text (not within the
    /// first `min_tokens` tokens), the grammar's end, max_tokens.
    fn take_token(&mut self, token: u32) -> Result<()> {
        let is_eos = !self.params.ignore_eos && self.tokenizer.eos_token_ids().contains(&token);
        if is_eos || self.params.stop_token_ids.contains(&token) {
            self.finish_reason = Some(FinishReason::Stop);
            self.stop_reason = (!is_eos).then_some(StopReason::TokenId(token));
            let text_end = self.all_ids.len() - usize::from(!self.params.include_stop_str_in_output);
            let rest = self.detokenizer.finish(&self.tokenizer, &self.all_ids[..text_end])?;
            self.output.push(&rest, false);
            return Ok(());
        }
        let grammar_done = self.processor.as_ref().is_some_and(LogitsProcessor::grammar_finished);
        let at_length = self.generated_ids().len() >= self.params.max_tokens;
        let mut text = self.detokenizer.next(&self.tokenizer, &self.all_ids)?;
        if grammar_done || at_length {
            text.push_str(&self.detokenizer.finish(&self.tokenizer, &self.all_ids)?);
        }
        let may_stop = self.generated_ids().len() > self.params.min_tokens;
        if let Some(stop) = self.output.push(&text, may_stop) {
            self.finish_reason = Some(FinishReason::Stop);
            self.stop_reason = Some(StopReason::Text(stop));
        } else if grammar_done {
            self.finish_reason = Some(FinishReason::Stop);
        } else if at_length {
            self.finish_reason = Some(FinishReason::Length);
        }
        Ok(())
    }

    /// Hands a hidden-state head (a proposer with taps) the target's hidden rows of the `kept`
    /// positions from `start` on that stay in the cache, after every forward: prompt chunks, the
    /// prompt, each verification (with or without a draft), so the head sees every context
    /// position exactly once.
    fn observe_hidden(&mut self, start: usize, kept: usize, hidden: &[(Tap, Tensor)]) -> Result<()> {
        let Some(speculation) = self.speculation.as_mut().filter(|_| !hidden.is_empty()) else { return Ok(()) };
        let rows = hidden.iter().map(|(_, rows)| Ok(rows.narrow(0, 0, kept)?)).collect::<Result<Vec<Tensor>>>()?;
        speculation.proposer.observe_hidden(start, &rows)
    }

    /// Whether this plan's verdict needs its logits alone, so a GPU step verifies it where the
    /// logits are (`verify::device`): greedy or temperature-only sampling of a one-hot draft
    /// (chain, tree or none), no logprobs. Deterministic drafts are verified there in coupled form
    /// (one uniform per output position), so a seeded request emits plain sampling's tokens on the
    /// device as on the host, whatever the draft.
    pub(super) fn needs_only_its_logits(&self, plan: &StepPlan) -> bool {
        self.params.is_temperature_only() && self.params.logprobs.is_none() && plan.draft.probs.is_none()
    }

    /// The proposer's draft for this step: at most k tokens (fewer near max_tokens so a step never
    /// overshoots it, fewer when the schedule or the cost-aware policy says so, chosen before
    /// proposing so a model-based draft computes only what will be verified), checked, and cut
    /// after the first token below the confidence threshold.
    /// `cap`: a scheduler's limit on top of the request's own choice; the request's own state
    /// (its cost-aware policy) evolves as it would alone, so a cut by load is never taken for
    /// the request's own decision not to draft.
    /// With a grammar: the grammar's forced run opens the draft (its length is returned too), and
    /// the draft is cut where the grammar forbids it. An empty draft comes with why.
    fn propose(&mut self, cap: Option<usize>) -> Result<(Draft, usize, Option<IdleReason>)> {
        let forced = self.forced_run(cap);
        let own_cap = cap.map(|cap| cap - forced.len());
        let (mut draft, mut idle) = self.propose_own(own_cap, &forced)?;
        let num_forced = forced.len();
        if num_forced > 0 {
            if draft.probs.is_some() {
                return Err(Error::Internal(
                    "a grammar's forced run was prepended to a draft with probabilities".into(),
                ));
            }
            draft = after_forced_run(forced, draft);
        }
        let proposed = draft.token_ids.len();
        self.cut_by_grammar(&mut draft);
        if proposed > 0 && draft.token_ids.is_empty() {
            idle = Some(IdleReason::Grammar);
        }
        Ok((draft, num_forced, idle))
    }

    /// The tokens this request's grammar forces next, for the draft (chain or tree) of a proposer
    /// that drafts after unverified tokens (n-gram, suffix, auto's lookups), within `cap` and the
    /// tokens left; empty otherwise.
    fn forced_run(&mut self, cap: Option<usize>) -> Vec<u32> {
        /// A forced run is cheap to draft but costs a verify row per token: JSON keys take a few.
        const MAX_FORCED_TOKENS: usize = 16;
        let depth_room = self.depth_room();
        if !self.drafts_after_forced_runs() {
            return Vec::new();
        }
        let Some(processor) = self.processor.as_mut() else { return Vec::new() };
        let max = MAX_FORCED_TOKENS.min(depth_room).min(cap.unwrap_or(usize::MAX));
        processor.forced_tokens(max)
    }

    /// Whether this request's drafts open with its grammar's forced run (`forced_run`).
    fn drafts_after_forced_runs(&self) -> bool {
        let Some(speculation) = self.speculation.as_ref() else { return false };
        self.processor.as_ref().is_some_and(LogitsProcessor::has_grammar)
            && speculation.grammar_drafts
            && speculation.proposer.drafts_after_unverified_tokens()
    }

    /// The draft model's chain the next `plan_with(limits)` will draft, for a scheduler to draft
    /// it together with other sessions' (`chains_together.rs`); that plan's `propose` then
    /// returns it. None where the next plan drafts no model chain: it feeds context, drafts a
    /// tree or after a forced run, or its proposer drafts no model chain or nothing this step.
    pub(crate) fn chain_job(&mut self, limits: PlanLimits) -> Option<ChainJob<'_>> {
        let max_tokens = self.next_chain_length(limits)?;
        let speculation = self.speculation.as_mut()?;
        let context = &self.all_ids;
        let (drafter, max_tokens) = speculation.proposer.model_chain(context, max_tokens).ok().flatten()?;
        Some(ChainJob { drafter, context, max_tokens, propose_s: &mut self.spec_metrics.propose_s })
    }

    /// The n-gram or suffix-tree chain the next `plan_with(limits)` will draft, for a scheduler to
    /// look it up together with other sessions' on the device (`ngram_together.rs`,
    /// `suffix_together.rs`); that plan's `propose` then returns it. None where the next plan
    /// drafts no such chain (as for `chain_job`).
    pub(crate) fn lookup_job(&mut self, limits: PlanLimits) -> Option<LookupJob<'_>> {
        let max_tokens = self.next_chain_length(limits)?;
        let proposer = &mut self.speculation.as_mut()?.proposer;
        let (context, propose_s) = (&self.all_ids[..], &mut self.spec_metrics.propose_s);
        if proposer.ngram_chain().is_some() {
            let proposer = proposer.ngram_chain()?;
            return Some(LookupJob::Ngram(NgramJob { proposer, context, max_tokens, propose_s }));
        }
        let proposer = proposer.suffix_chain()?;
        Some(LookupJob::Suffix(SuffixJob { proposer, context, max_tokens, propose_s }))
    }

    /// The length of the chain the next `plan_with(limits)` asks its proposer for; None where it
    /// asks for none: it feeds context, drafts a tree or after a forced run, or nothing this step.
    fn next_chain_length(&self, limits: PlanLimits) -> Option<usize> {
        let decodes = !self.is_finished() && self.all_ids.len() - self.cache.len() == 1;
        if !decodes || self.drafts_after_forced_runs() {
            return None;
        }
        let own = self.own_draft_lengths().own;
        let max_tokens = limits.max_draft_tokens.map_or(own, |cap| own.min(cap));
        self.speculation.as_ref().filter(|s| !s.tree.is_on() && max_tokens > 0).map(|_| max_tokens)
    }

    /// Cuts `draft` where the grammar forbids it. A deterministic chain stops before the first
    /// forbidden token. A chain with draft probabilities keeps that token (it is rejected for
    /// certain, and its rejection draws the next token from norm(max(0, p - q)), which a cut
    /// before it would not: verify.rs). A deterministic tree loses the forbidden nodes and
    /// their subtrees; a tree with probabilities is verified whole (its siblings are drawn
    /// without replacement, so a removed sibling would bias the others).
    fn cut_by_grammar(&mut self, draft: &mut Draft) {
        let Some(processor) = self.processor.as_mut().filter(|p| p.has_grammar()) else { return };
        let vocab = self.model.info().vocab_size;
        let num_tokens = draft.token_ids.len();
        match (&draft.parents, &draft.probs) {
            (None, probs) => {
                let valid = processor.valid_draft_len(&draft.token_ids);
                let keep = if probs.is_some() { (valid + 1).min(num_tokens) } else { valid };
                draft.truncate(keep, vocab);
            }
            (Some(parents), None) => {
                let valid = processor.valid_tree_nodes(&draft.token_ids, parents);
                let keep: Vec<usize> = (0..num_tokens).filter(|&node| valid[node]).collect();
                if keep.len() < num_tokens {
                    draft.keep_nodes(&keep, vocab);
                }
            }
            (Some(_), Some(_)) => {}
        }
        self.spec_metrics.num_grammar_cut_tokens += num_tokens - draft.token_ids.len();
    }

    /// The proposer's draft, after `forced` (tokens the grammar forces, not yet verified: the
    /// proposer continues the context extended by them, and its draft grows from their end); an
    /// empty one comes with why.
    fn propose_own(&mut self, cap: Option<usize>, forced: &[u32]) -> Result<(Draft, Option<IdleReason>)> {
        let OwnLengths { settings_max, own, catch_up } = self.own_draft_lengths();
        let depth_room = self.depth_room().saturating_sub(forced.len());
        let Some(speculation) = self.speculation.as_mut() else { return Ok((Draft::default(), None)) };
        if let Some(policy) = speculation.draft_length.as_mut().filter(|_| settings_max > 0 && own == 0) {
            let judged = match catch_up {
                Some(catch_up) => Some(CostIdle::CatchUp(catch_up)),
                None => policy.verdict(settings_max).map(CostIdle::Chain),
            };
            if judged.is_some() {
                self.cost_idle = judged;
            }
            policy.skipped();
        }
        // After a forced run, the run's tokens count against the tokens left: a chain's length is
        // its depth; a tree keeps its node budget and its depth is capped below.
        let own = if forced.is_empty() || speculation.tree.is_on() { own } else { own.min(depth_room) };
        let max_draft = cap.map_or(own, |cap| own.min(cap));
        if max_draft == 0 {
            let idle = match (settings_max, own) {
                (0, _) => IdleReason::MaxTokens,
                (_, 0) => IdleReason::Cost,
                _ => IdleReason::Load,
            };
            return Ok((Draft::default(), Some(idle)));
        }
        // A tree: `max_draft` nodes at most, as deep as its settings (and the tokens left) allow
        // and, in "auto" mode, as deep as the chooser expects to pay.
        let tree = speculation.tree.is_on().then(|| {
            let mut depth = speculation.tree.max_depth.min(max_draft).min(depth_room);
            let limits = TreeLimits { max_nodes: max_draft, max_children: speculation.tree.max_children };
            if let Some(chooser) = &speculation.tree_chooser {
                depth = chooser.planned_depth(depth, limits.max_nodes, limits.max_children);
            }
            (depth, limits)
        });
        let max_tokens = tree.map_or(max_draft, |(depth, _)| depth);
        if max_tokens == 0 {
            let idle = match speculation.tree_chooser.as_mut() {
                Some(chooser) if depth_room > 0 => {
                    chooser.skipped();
                    self.cost_idle = Some(CostIdle::Tree);
                    IdleReason::Cost
                }
                _ => IdleReason::MaxTokens,
            };
            return Ok((Draft::default(), Some(idle)));
        }
        let extended: Vec<u32>;
        let context = if forced.is_empty() {
            &self.all_ids
        } else {
            extended = [self.all_ids.as_slice(), forced].concat();
            &extended
        };
        // A draft that first reads context its proposer has not seen (a draft model's first draft
        // reads the prompt; one after skipped steps, what they added) times that reading, not
        // drafting: the tree chooser does not follow it. Without a comparable `kv_len` (a draft in
        // another tokenizer), only the first draft is known to read a backlog.
        let reads_backlog = match speculation.proposer.kv_len() {
            Some(kv_len) => context.len().saturating_sub(kv_len) > max_tokens + 1,
            None => self.spec_metrics.num_drafts == 0,
        };
        let t0 = Instant::now();
        let mut draft = speculation.proposer.propose_with(ProposeInput {
            context,
            max_tokens,
            tree: tree.map(|(_, limits)| limits),
            target_cache: &mut self.cache,
            num_unverified: forced.len(),
        })?;
        let draft_s = t0.elapsed().as_secs_f64();
        self.spec_metrics.propose_s += draft_s;
        let vocab = self.model.info().vocab_size;
        draft.validate(max_tokens, tree.map(|(_, limits)| limits), vocab, speculation.method)?;
        self.tree_draft_timing = tree.filter(|_| !reads_backlog).map(|_| (draft_s, draft.depth()));
        let mut pruned_by_chooser = false;
        if draft.parents.is_some() {
            let before = draft.token_ids.len();
            prune_tree(speculation, &mut draft, vocab);
            pruned_by_chooser = before > 0 && draft.token_ids.is_empty() && speculation.tree_chooser.is_some();
            if pruned_by_chooser {
                self.cost_idle = Some(CostIdle::Tree);
            }
        }
        if self.cache.len() != self.all_ids.len() - 1 {
            return Err(Error::Proposer(format!(
                "the {} proposer changed the target cache length; it must leave it as it found it",
                speculation.method
            )));
        }
        // Chains only: cutting a tree by its drawn tokens' probabilities would bias the recursive
        // rejection sampling of the siblings left (verify/tree.rs).
        let threshold_applies = speculation.draft_confidence_threshold > 0.0 && draft.parents.is_none();
        if let Some(probs) = draft.probs.as_ref().filter(|_| threshold_applies) {
            let threshold = speculation.draft_confidence_threshold;
            let unsure =
                draft.token_ids.iter().enumerate().position(|(i, &x)| probs[i * vocab + x as usize] < threshold);
            if let Some(i) = unsure {
                draft.truncate(i + 1, vocab);
            }
        }
        // A tree the chooser pruned to nothing was judged not to pay; any other empty draft is
        // the proposer's own (no match).
        let idle = match (draft.token_ids.is_empty(), pruned_by_chooser) {
            (false, _) => None,
            (true, true) => Some(IdleReason::Cost),
            (true, false) => Some(IdleReason::NoDraft),
        };
        Ok((draft, idle))
    }

    /// How deep the next draft may go: a draft m deep emits up to m + 1 tokens, so one fewer
    /// than the tokens max_tokens leaves.
    fn depth_room(&self) -> usize {
        (self.params.max_tokens - self.generated_ids().len()).saturating_sub(1)
    }

    /// The next draft's lengths (`OwnLengths`). A draft with a cache of its own that must first
    /// read context it has not read (its first draft reads the whole prompt) drafts only where
    /// its best length's speedup, over the tokens max_tokens leaves, wins that reading back.
    fn own_draft_lengths(&self) -> OwnLengths {
        let Some(speculation) = self.speculation.as_ref() else {
            return OwnLengths { settings_max: 0, own: 0, catch_up: None };
        };
        // A chain's length is its depth; a tree keeps its node budget while any depth fits
        // (`propose` caps the depth).
        let depth_room = self.depth_room();
        let mut settings_max = match speculation.tree.is_on() {
            true if depth_room > 0 => speculation.num_speculative_tokens,
            true => 0,
            false => speculation.num_speculative_tokens.min(depth_room),
        };
        if let Some(schedule) = &speculation.schedule {
            settings_max = settings_max.min(schedule.current());
        }
        let Some(policy) = speculation.draft_length.as_ref().filter(|_| settings_max > 0) else {
            return OwnLengths { settings_max, own: settings_max, catch_up: None };
        };
        let plan = policy.plan(settings_max);
        let proposer = &speculation.proposer;
        let unseen = proposer.kv_len().map_or(0, |kv_len| self.all_ids.len().saturating_sub(kv_len));
        let steps = policy.catch_up_steps(unseen, proposer.context_row_share());
        let remaining = self.params.max_tokens - self.generated_ids().len();
        match policy.pays_back(settings_max, steps, remaining) {
            (false, speedup) if plan.length > 0 => {
                let catch_up = CatchUp { unseen, steps, remaining, speedup, observed: plan.observed };
                return OwnLengths { settings_max, own: 0, catch_up: Some(catch_up) };
            }
            _ => {}
        }
        OwnLengths { settings_max, own: plan.length, catch_up: None }
    }

    /// What this request would draft alone next step, for a scheduler budgeting drafts by load
    /// (`draft_budget.rs`); None unless its context is complete (the next plan decodes).
    pub fn draft_wish(&self) -> Option<DraftWish> {
        if self.is_finished() || self.all_ids.len() - self.cache.len() != 1 || self.all_ids.len() == self.prompt_len {
            return None;
        }
        let own = self.own_draft_lengths().own;
        let policy = self.speculation.as_ref().and_then(|s| s.draft_length.as_ref());
        let acceptance = match policy {
            Some(policy) => policy.acceptance(),
            // No policy (a fixed k): accepted tokens over accepted tokens plus drafts, with the
            // policy's prior of one of each (each draft holds at most one rejection).
            None => {
                let m = &self.spec_metrics;
                (m.num_accepted_tokens as f64 + 1.0) / (m.num_accepted_tokens as f64 + m.num_drafts as f64 + 2.0)
            }
        };
        Some(DraftWish {
            max_tokens: own,
            acceptance,
            draft_cost: policy.map_or(DraftCost::FREE, |p| p.draft_cost()),
            pinned: self.output_depends_on_draft_lengths(),
        })
    }

    /// Whether this request's tokens would change if its drafts were cut: a seeded sampled request
    /// whose drafts carry probabilities (their rejection sampling draws depend on the draft), or
    /// that runs on a GPU (cuBLAS picks kernels by the forward's shape, so a row's logits, and a
    /// draw near a CDF boundary, may follow the draft lengths; model/candle/mod.rs). Greedy
    /// requests, unseeded ones (no output to reproduce) and one-hot drafts verified on the host
    /// emit the same tokens whatever their draft lengths.
    pub fn output_depends_on_draft_lengths(&self) -> bool {
        let Some(speculation) = self.speculation.as_ref() else { return false };
        if self.params.is_greedy() || self.params.seed.is_none() {
            return false;
        }
        !speculation.one_hot_drafts || self.model.device().is_cuda()
    }

    /// Whether the tree chooser follows this request's own drafting times: not where its tokens
    /// depend on its draft lengths (a seeded request's would then depend on timing noise), nor
    /// where the config pins the draft cost.
    fn follows_draft_timings(&self) -> bool {
        let pinned = self.speculation.as_ref().is_some_and(|s| s.draft_cost_source == Some(CostSource::Config));
        !pinned && !self.output_depends_on_draft_lengths()
    }

    /// Frees the target KV cache of an unfinished request (a scheduler short of KV memory); the
    /// request keeps its tokens, sampler, proposer and metrics, and its next plans feed its context
    /// again (chunked like a prompt) before it decodes on. Rows are computed independently, so the
    /// recomputed cache is the one it had, and the output does not change.
    pub fn preempt(&mut self) {
        if self.is_finished() {
            return;
        }
        self.cache.release();
        if let Some(speculation) = self.speculation.as_mut() {
            speculation.proposer.target_context_dropped();
        }
    }

    /// The prompt's token ids.
    pub fn prompt_ids(&self) -> &[u32] {
        &self.all_ids[..self.prompt_len]
    }

    /// Starts this session's cache as a copy of what `source`'s cache holds of the same prompt,
    /// all but its last position (whose row yields this sample's own first token), so its
    /// prefill feeds only the rest. Rows are computed independently of what else is in a
    /// forward, so the copy equals what this session would have computed itself: its tokens are
    /// unchanged. Returns the positions copied: 0 when nothing can be shared (this session was
    /// fed already, the prompts differ, or the proposer reads the target's hidden states, which
    /// a copied cache does not give it).
    pub fn share_prompt_from(&mut self, source: &Session) -> Result<usize> {
        let fresh = self.cache.is_empty() && self.all_ids.len() == self.prompt_len;
        if !fresh || !self.taps().is_empty() || source.prompt_ids() != self.prompt_ids() {
            return Ok(0);
        }
        let len = source.cache.len().min(self.prompt_len - 1);
        if len > 0 {
            self.cache.copy_prefix_from(&source.cache, len)?;
        }
        Ok(len)
    }

    /// Tokens of prompt + output so far; once the context is fed, the cache holds all but the newest.
    pub fn num_context_tokens(&self) -> usize {
        self.all_ids.len()
    }

    /// Context tokens the cache does not hold yet (1 when decoding: the newest token).
    pub fn num_unseen_tokens(&self) -> usize {
        self.all_ids.len() - self.cache.len()
    }

    /// Rows of context still to feed before this request decodes: the unseen prompt (whose last
    /// row yields the first token), or after a preemption every unseen token but the newest (0
    /// when decoding).
    pub fn num_context_rows_to_feed(&self) -> usize {
        let unseen = self.num_unseen_tokens();
        if self.is_finished() || unseen == 0 {
            0
        } else if self.all_ids.len() == self.prompt_len {
            unseen
        } else {
            unseen - 1
        }
    }

    /// Draft tokens accepted so far.
    pub fn num_accepted_tokens(&self) -> usize {
        self.spec_metrics.num_accepted_tokens
    }

    /// Positions held by the target's KV cache and by the proposer's own, if it has one.
    pub fn kv_lens(&self) -> (usize, Option<usize>) {
        (self.cache.len(), self.speculation.as_ref().and_then(|s| s.proposer.kv_len()))
    }

    /// Called once when the request ends: the caches are freed, the proposer keeps what it learned
    /// and the engine adds the request to its sums.
    fn on_finish(&mut self) {
        self.cache.release();
        if let Some(speculation) = self.speculation.as_mut() {
            speculation.proposer.finish(&self.all_ids[self.prompt_len..]);
        }
        let metrics = self.metrics();
        // A poisoned lock is recovered rather than skipped (see `lock`): skipping would silently
        // drop this request from the engine's sums.
        if let Ok(mut engine) = lock(&self.engine_metrics) {
            engine.record(&metrics, &self.timer.itls_s());
        }
    }

    /// Stops the request early (a cancelled stream); its result keeps what was generated (the
    /// text held back for a possible stop string included: none can complete now).
    pub fn abort(&mut self) {
        if self.finish_reason.is_none() {
            self.finish_reason = Some(FinishReason::Abort);
            self.output.release(true);
            self.on_finish();
        }
    }

    pub fn metrics(&self) -> RequestMetrics {
        let mut m = self.timer.metrics(self.prompt_len, self.num_forward_passes);
        m.spec_method = self.speculation.as_ref().map(|s| s.method.to_string());
        m.num_speculative_tokens = self.speculation.as_ref().map_or(0, |s| s.num_speculative_tokens);
        m.verify_cost_source = self.speculation.as_ref().and_then(|s| s.verify_cost_source).map(CostSource::as_str);
        m.draft_cost_source = self.speculation.as_ref().and_then(|s| s.draft_cost_source).map(CostSource::as_str);
        m.idle_reason = self.idle_reason();
        m.spec = self.spec_metrics.clone();
        m.drafters = self.speculation.as_ref().map_or_else(Vec::new, |s| s.proposer.drafter_counts());
        if m.spec.num_accepted_tokens_per_pos.len() < m.num_speculative_tokens {
            m.spec.num_accepted_tokens_per_pos.resize(m.num_speculative_tokens, 0);
        }
        m
    }

    /// Why speculation stood idle in most of this request's idle steps, in words with the figures
    /// the decision rested on.
    fn idle_reason(&self) -> Option<String> {
        let speculation = self.speculation.as_ref()?;
        let reason = self.spec_metrics.main_idle_reason()?;
        let sources = format!(
            "verify cost {}{}",
            speculation.verify_cost_source.map_or("-", CostSource::as_str),
            speculation.draft_cost_source.map_or_else(String::new, |s| format!(", draft cost {}", s.as_str()))
        );
        Some(match (reason, self.cost_idle) {
            (IdleReason::Cost, Some(CostIdle::Chain(v))) => format!(
                "predicted speedup {:.2}x < 1 at {} acceptance {:.2} (best draft length {}: verify cost v({}) = {:.2}, \
                 draft cost c = {}; {sources})",
                v.predicted_speedup,
                if v.observed { "measured" } else { "the prior's" },
                v.acceptance,
                v.length,
                v.length + 1,
                v.verify_cost_ratio,
                v.draft_cost
            ),
            (IdleReason::Cost, Some(CostIdle::CatchUp(catch_up))) => format!(
                "predicted speedup {:.2}x at {} over the {} tokens left would not win back the {:.1} target \
                 steps the draft takes to read the {} context tokens it has not read ({sources})",
                catch_up.speedup,
                if catch_up.observed { "its measured acceptance" } else { "the engine's acceptance by draft depth" },
                catch_up.remaining,
                catch_up.steps,
                catch_up.unseen
            ),
            (IdleReason::Cost, _) => {
                format!(
                    "the tree chooser predicted no tree or chain pays at its measured acceptance per depth ({sources})"
                )
            }
            (IdleReason::NoDraft, _) => match speculation.method {
                "ngram" => "the ngram proposer found no earlier occurrence of the context's last tokens \
                            (prompt_lookup_min to prompt_lookup_max of them) to copy"
                    .into(),
                "suffix" => "the suffix proposer found no match of the context's end in the prompt, the output or \
                             earlier responses"
                    .into(),
                method => format!("the {method} proposer drafted nothing"),
            },
            (IdleReason::Load, _) => {
                "the load budget granted no draft rows (in a full batch a draft row costs more than it buys)".into()
            }
            (IdleReason::MaxTokens, _) => "too few tokens left before max_tokens for a draft".into(),
            (IdleReason::Grammar, _) => "the grammar forbade every drafted token".into(),
        })
    }

    pub fn result(&self) -> Generation {
        Generation {
            prompt_token_ids: self.all_ids[..self.prompt_len].to_vec(),
            token_ids: self.generated_ids().to_vec(),
            text: self.output.emitted().to_string(),
            finish_reason: self.finish_reason,
            stop_reason: self.stop_reason.clone(),
            metrics: self.metrics(),
            logprobs: self.params.logprobs.map(|_| self.logprobs.clone()),
        }
    }
}

/// The token path each verify row follows, for a logits processor: row 0 the output so far
/// (empty), row 1 + i draft node i's path.
fn draft_paths(draft: &Draft) -> Vec<Vec<u32>> {
    let parents = draft.parents();
    std::iter::once(Vec::new())
        .chain((0..draft.token_ids.len()).map(|node| path_tokens(&draft.token_ids, &parents, node)))
        .collect()
}

/// `own` (a chain or a tree) drafted after the grammar's `forced` run: the run as a trunk from
/// the newest token, `own` growing from its end.
fn after_forced_run(forced: Vec<u32>, own: Draft) -> Draft {
    let num_forced = forced.len() as i32;
    let parents = own.parents.as_ref().map(|parents| {
        let trunk = (0..num_forced).map(|i| i - 1);
        trunk.chain(parents.iter().map(|&p| if p < 0 { num_forced - 1 } else { p + num_forced })).collect()
    });
    let token_ids = [forced, own.token_ids].concat();
    match parents {
        Some(parents) => Draft::tree(token_ids, parents),
        None => Draft::tokens(token_ids),
    }
}

/// The proposer's own part of a draft that opened with `num_forced` forced tokens: its parents
/// and the accepted path within it, for the policies that judge its drafts. None when the forced
/// run was not accepted whole (the proposer's part was never reached).
fn own_part(parents: &[i32], accepted_path: &[usize], num_forced: usize) -> Option<(Vec<i32>, Vec<usize>)> {
    if accepted_path.iter().filter(|&&node| node < num_forced).count() < num_forced {
        return None;
    }
    let last_forced = num_forced as i32 - 1;
    let own_parents = parents[num_forced..].iter().map(|&p| if p == last_forced { -1 } else { p - num_forced as i32 });
    let own_path = accepted_path.iter().filter(|&&node| node >= num_forced).map(|&node| node - num_forced);
    Some((own_parents.collect(), own_path.collect()))
}

/// The logit row of each token a verification emits: row 0 for the first, then the row after
/// each accepted node (row 1 + node) for the next.
fn emitted_rows(accepted_path: &[usize]) -> Vec<usize> {
    std::iter::once(0).chain(accepted_path.iter().map(|&node| node + 1)).collect()
}

/// The lowest logprob reported (vLLM's floor): JSON has no -inf.
const MIN_LOGPROB: f32 = -9999.0;

/// `token`'s logprob and the `top` most likely tokens from one processed logit row `[vocab]`
/// (see `TokenLogprobs`).
fn token_logprobs(row: &[f32], token: u32, top: usize, temperature: f32) -> TokenLogprobs {
    let inv_t = if temperature > 0.0 { 1.0 / temperature } else { 1.0 };
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    // log-sum-exp in f64: the same value whatever the row's order of summation.
    let sum: f64 = row.iter().map(|&x| (f64::from((x - max) * inv_t)).exp()).sum();
    let log_z = sum.ln();
    let logprob = |x: f32| (f64::from((x - max) * inv_t) - log_z) as f32;
    let mut ranked: Vec<u32> = Vec::new();
    if top > 0 {
        let mut order: Vec<u32> = (0..row.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        let top = top.min(order.len());
        order.select_nth_unstable_by(top - 1, by_logit);
        order.truncate(top);
        order.sort_unstable_by(by_logit);
        ranked = order;
    }
    TokenLogprobs {
        token_id: token,
        logprob: logprob(row[token as usize]).max(MIN_LOGPROB),
        // Tokens the grammar or a bias of -inf rules out are no alternatives.
        top: ranked
            .into_iter()
            .filter(|&t| row[t as usize] > f32::NEG_INFINITY)
            .map(|t| (t, logprob(row[t as usize])))
            .collect(),
    }
}

/// Cuts a tree draft to the config's static shape (`speculative_token_tree`) and, in "auto" mode,
/// to the chooser's pick. Both keep a subtree whose siblings are a prefix of the proposer's order.
fn prune_tree(speculation: &mut Speculation, draft: &mut Draft, vocab: usize) {
    if let Some(shape) = &speculation.tree.static_tree {
        let keep: Vec<usize> = rank_paths(&draft.parents())
            .iter()
            .enumerate()
            .filter(|(_, path)| shape.contains(path))
            .map(|(i, _)| i)
            .collect();
        draft.keep_nodes(&keep, vocab);
    }
    if let Some(chooser) = &speculation.tree_chooser {
        let choice = chooser.choose(&draft.parents());
        draft.keep_nodes(&choice.keep, vocab);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_run_is_the_trunk_a_chain_or_tree_grows_from() {
        let chain = after_forced_run(vec![7, 8], Draft::tokens(vec![1, 2]));
        assert_eq!((chain.token_ids.clone(), chain.parents), (vec![7, 8, 1, 2], None));
        // 1 -> {2, 3}, 2 -> 4 after the run: every root of the tree hangs from the run's last token.
        let tree = after_forced_run(vec![7, 8], Draft::tree(vec![1, 5, 2, 3], vec![-1, -1, 0, 0]));
        assert_eq!(tree.token_ids, [7, 8, 1, 5, 2, 3]);
        assert_eq!(tree.parents, Some(vec![-1, 0, 1, 1, 2, 2]));
    }

    #[test]
    fn the_proposers_own_part_is_judged_only_when_the_forced_run_was_accepted() {
        let parents = [-1, 0, 1, 1, 2];
        assert_eq!(own_part(&parents, &[0, 1, 2, 4], 2), Some((vec![-1, -1, 0], vec![0, 2])));
        assert_eq!(own_part(&parents, &[0], 2), None, "the run was cut: the own part was never reached");
        assert_eq!(own_part(&parents, &[0, 1], 0), Some((parents.to_vec(), vec![0, 1])));
    }
}
