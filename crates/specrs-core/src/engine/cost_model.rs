//! The cost model as requests use it: the verification curve t(n) (measured once per context
//! length and kept, on disk too), the draft cost c, and the expected speedup they predict.
//!
//! Invariant: measured figures never change once stored, so a seeded request picks the same
//! draft lengths (and so the same tokens) every time it runs on one engine.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Instant;

use candle_core::Tensor;

use super::{lock, Engine};
use crate::config::SamplingParams;
use crate::costs::{extend_ratios, median_if_quiet, prior_ratios, CostSource, Figure};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::metrics::{expected_speedup_refined, expected_speedup_textbook, verify_cost_at, SpecDecodeMetrics};
use crate::model::{ForwardBatch, LogitRows};
use crate::proposer::{Feedback, ProposeInput};
use crate::spec_config::{Method, SpeculativeConfig, MAX_SPECULATIVE_TOKENS};

/// The expected-speedup model evaluated on measured acceptance and costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpectedSpeedup {
    pub textbook: f64,
    pub refined: f64,
    /// c: proposer time per draft relative to one single-token target step.
    pub draft_cost: f64,
    /// v: t(k+1) / t(1).
    pub verify_cost_ratio: f64,
    /// Where the verification curve came from (measured, cached, extrapolated past its end).
    pub verify_cost_source: CostSource,
}

/// The costs one config's draft-length policy weighs, with their sources.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyCosts {
    /// `[k + 1]`: v(n) = t(n)/t(1).
    pub verify_cost_ratios: Vec<f64>,
    pub verify_cost_source: CostSource,
    /// c: drafting time per draft token over t(1).
    pub draft_cost: f64,
    pub draft_cost_source: Option<CostSource>,
}

/// The context length the draft-length policy's curve is measured at (or less, for a model whose
/// context cannot hold it beside the longest verify).
const POLICY_CONTEXT_LEN: usize = 512;

impl Engine {
    /// Whether a request whose config needs a figure nobody measured yet measures it (default
    /// true). Off, it gets the nearest figure instead: the curve extended past its measured end,
    /// or a prior draft cost, and its metrics say so. A server turns it off once it serves.
    pub fn set_measure_on_demand(&self, on: bool) {
        self.measure_on_demand.store(on, Ordering::Relaxed);
    }

    /// The verification curve `[v(1), ..., v(k+1)]` and draft cost c the draft-length policy of
    /// `config` weighs: the config's own (`verify_cost_ratios`, `draft_cost`), else the engine's,
    /// measured now if `measure` and nobody has yet, else the nearest figure (the curve extended
    /// past its end, a prior). Every request of one engine reads one curve, at one context length,
    /// and measured figures never change, so a seeded request picks the same draft lengths (and so
    /// the same sampled tokens) every time it runs on this engine, whatever ran before it.
    pub fn policy_costs(&self, config: &SpeculativeConfig, measure: bool) -> Result<PolicyCosts> {
        let max_n = config.num_speculative_tokens + 1;
        let (verify_cost_ratios, verify_cost_source) = match &config.costs.verify_cost_ratios {
            Some(given) => match extend_ratios(given, max_n) {
                (ratios, true) => (ratios, CostSource::Extrapolated),
                (ratios, false) => (ratios, CostSource::Config),
            },
            None => match self.curve_s(self.policy_context_len(), max_n, measure)? {
                Some((curve, source)) => (curve.iter().map(|t| t / curve[0]).collect(), source),
                None => (prior_ratios(max_n), CostSource::Prior),
            },
        };
        let (draft_cost, draft_cost_source) = match config.costs.draft_cost {
            Some(c) => (c, Some(CostSource::Config)),
            None => match self.draft_cost(config, measure)? {
                Some((c, source)) => (c, Some(source)),
                None => (0.0, None),
            },
        };
        Ok(PolicyCosts { verify_cost_ratios, verify_cost_source, draft_cost, draft_cost_source })
    }

    /// The policy curve's context: `POLICY_CONTEXT_LEN`, or less where the model's context cannot
    /// hold it plus the longest verify. Fixed per engine, so every k reads the same curve.
    fn policy_context_len(&self) -> usize {
        let context = self.model.info().context_length;
        POLICY_CONTEXT_LEN.min(context.saturating_sub(MAX_SPECULATIVE_TOKENS + 1)).max(1)
    }

    /// c: drafting time per draft token over one target step, for model-based drafts (None for
    /// model-free ones, whose microseconds do not matter). Measured once per draft (on a
    /// 128-token context) when `measure`, else a prior from the draft's size: decoding is
    /// memory-bound, so a draft costs about its weight bytes over the target's per token.
    fn draft_cost(&self, config: &SpeculativeConfig, measure: bool) -> Result<Option<(f64, CostSource)>> {
        let Some(key) = self.draft_identity(config)? else { return Ok(None) };
        if let Some(known) = lock(&self.costs)?.draft_costs.get(&key) {
            return Ok(Some((known.value, known.source)));
        }
        if !measure {
            return Ok(Some((self.prior_draft_cost(config)?, CostSource::Prior)));
        }
        let Some((single_step, _)) = self.curve_s(self.policy_context_len(), 1, true)? else {
            return Err(Error::Internal("the verification curve was not measured".into()));
        };
        let k = config.num_speculative_tokens;
        let vocab = self.model.info().vocab_size as u64;
        let context: Vec<u32> = (0..128u64).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
        let mut proposer = self.proposer(config, None)?;
        proposer.begin(&context, &SamplingParams::greedy(k + 1))?;
        let mut target_cache = self.model.new_cache(context.len() + k)?;
        if matches!(config.method, Method::LayerSkip { .. }) {
            // Only the layer-skip draft reads the target's cache.
            self.model.forward_rows(&context[..context.len() - 1], &mut target_cache, LogitRows::Last)?;
        }
        // A head reads the target's hidden states: round r drafts after a context one token
        // longer, as a step whose draft was rejected hands the head one new row.
        let taps = proposer.taps();
        let hidden = if taps.is_empty() {
            Vec::new()
        } else {
            let mut batch = ForwardBatch::chain(&context, 0, LogitRows::None)?;
            batch.taps = taps;
            let mut cache = self.model.new_cache(context.len())?;
            self.model.forward_batch(&batch, &mut [&mut cache])?.hidden
        };
        let first_round_context = context.len() - 4;
        let rows = |start: usize, n: usize| -> Result<Vec<Tensor>> {
            hidden.iter().map(|h| Ok(h.narrow(0, start, n)?)).collect()
        };
        if !hidden.is_empty() {
            proposer.observe_hidden(0, &rows(0, first_round_context - 1)?)?;
        }
        let mut times = Vec::new();
        for round in 0..4 {
            let context = if hidden.is_empty() { &context[..] } else { &context[..first_round_context + round] };
            if !hidden.is_empty() && round > 0 {
                proposer.observe_hidden(context.len() - 2, &rows(context.len() - 2, 1)?)?;
            }
            let t0 = Instant::now();
            let input = ProposeInput { context, max_tokens: k, tree: None, target_cache: &mut target_cache };
            let draft = proposer.propose_with(input)?;
            self.model.device().synchronize()?;
            if round > 0 {
                // The first round is a warm-up (cold weight pages).
                times.push(t0.elapsed().as_secs_f64() / draft.token_ids.len().max(1) as f64);
            }
            proposer.observe(&Feedback::accepted(0, &[], &[]))?;
        }
        let (per_token_s, quiet) = median_if_quiet(&times);
        let cost = per_token_s / single_step[0];
        let mut costs = lock(&self.costs)?;
        let figure = Figure::measured(cost, quiet);
        let source = figure.source;
        costs.draft_costs.insert(key, figure);
        if let Some(disk) = &self.cost_cache {
            disk.store(&costs);
        }
        Ok(Some((cost, source)))
    }

    /// What a draft's cost depends on (the draft's weights, how many layers, PARD's k), so every
    /// config drafting alike shares one figure; None for model-free methods.
    fn draft_identity(&self, config: &SpeculativeConfig) -> Result<Option<String>> {
        let file = |path: &Path| {
            let meta = std::fs::metadata(path).ok();
            let mtime = meta
                .as_ref()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
            format!("{}:{}:{}", canonical.display(), meta.map_or(0, |m| m.len()), mtime.map_or(0, |d| d.as_nanos()))
        };
        Ok(match &config.method {
            Method::Ngram { .. } | Method::Suffix(_) | Method::Custom => None,
            Method::DraftModel(d) => Some(format!("draft_model:{}", file(Path::new(&d.model)))),
            Method::Pard { draft, mask_token_id } => Some(format!(
                "pard:{}:{mask_token_id}:k={}",
                file(Path::new(&draft.model)),
                config.num_speculative_tokens
            )),
            Method::QuantizedSelf { quantization, .. } => Some(format!("quantized_self:{quantization}")),
            Method::LayerSkip { exit_layer } => Some(format!("layer_skip:{exit_layer}")),
            Method::Head { method, model, quantization } => Some(format!(
                "{}:{}:{}",
                method.name(),
                model.as_deref().map_or_else(|| "target".to_string(), |m| file(Path::new(m))),
                quantization.as_deref().unwrap_or("f32")
            )),
        })
    }

    /// The prior draft cost per token (see `draft_cost`): a draft model's weight bytes over the
    /// target's (PARD drafts k tokens per forward), a layer-skip draft's share of the layers.
    fn prior_draft_cost(&self, config: &SpeculativeConfig) -> Result<f64> {
        let bytes = |path: &Path| -> Result<f64> {
            Ok(self.draft_model(path)?.weight_bytes() as f64 / self.model.weight_bytes().max(1) as f64)
        };
        Ok(match &config.method {
            Method::Ngram { .. } | Method::Suffix(_) | Method::Custom => 0.0,
            Method::DraftModel(d) => bytes(Path::new(&d.model))?,
            Method::Pard { draft, .. } => bytes(Path::new(&draft.model))? / config.num_speculative_tokens as f64,
            Method::QuantizedSelf { quantization, .. } => bytes(&self.quantized_self_path(quantization)?)?,
            Method::LayerSkip { exit_layer } => *exit_layer as f64 / self.model.info().num_layers.max(1) as f64,
            // One layer (a few sub-heads) of the target's width: its share of the target's
            // weights, at least one layer's worth when it shares the target's LM head.
            Method::Head { method, model, quantization } => {
                let head_bytes = self.head(*method, model.as_deref(), quantization.as_deref())?.weight_bytes as f64;
                (head_bytes / self.model.weight_bytes().max(1) as f64)
                    .max(1.0 / self.model.info().num_layers.max(1) as f64)
            }
        })
    }

    /// The expected-speedup model for the acceptance in `spec`, or None without drafts (or
    /// without a curve, where measuring on demand is off). k is the mean draft length; the draft
    /// cost c is the mean proposer time per draft over t(1); v is t(k+1)/t(1) from the policy's
    /// verification cost curve.
    pub fn expected_speedup(&self, spec: &SpecDecodeMetrics) -> Result<Option<ExpectedSpeedup>> {
        if spec.num_drafts == 0 {
            return Ok(None);
        }
        let k = spec.mean_draft_length();
        let measure = self.measure_on_demand.load(Ordering::Relaxed);
        // [t(1), ..., t(ceil(k) + 1)]
        let Some((costs, verify_cost_source)) =
            self.curve_s(self.policy_context_len(), k.ceil() as usize + 1, measure)?
        else {
            return Ok(None);
        };
        let t1 = costs[0];
        let ratios: Vec<f64> = costs.iter().map(|t| t / t1).collect();
        let verify_cost_ratio = verify_cost_at(&ratios, k);
        let draft_cost = spec.propose_s / spec.num_drafts as f64 / t1;
        let a = spec.acceptance_rate();
        Ok(Some(ExpectedSpeedup {
            textbook: expected_speedup_textbook(a, k, draft_cost),
            refined: expected_speedup_refined(a, k, draft_cost, verify_cost_ratio),
            draft_cost,
            verify_cost_ratio,
            verify_cost_source,
        }))
    }

    /// `[T(1), ..., T(max_rows)]` seconds for the scheduler's draft budget (`draft_budget.rs`),
    /// with its source: the policy's verification curve (one forward over R rows of one sequence
    /// on a 512-token cache, which costs what R rows of R sequences do: the same matmuls, each row
    /// attending to ~512 positions), measured up to `max_rows` when `measure`, else the stored
    /// curve extended past its end, else the prior in units of T(1).
    pub fn batch_costs(&self, max_rows: usize, measure: bool) -> Result<(Vec<f64>, CostSource)> {
        Ok(match self.curve_s(self.policy_context_len(), max_rows, measure)? {
            Some(curve) => curve,
            None => (prior_ratios(max_rows), CostSource::Prior),
        })
    }

    pub(super) fn measures_on_demand(&self) -> bool {
        self.measure_on_demand.load(Ordering::Relaxed)
    }

    /// Verification cost curve in seconds, `[t(1), ..., t(max_n)]`: one forward over n new tokens
    /// on a `context_len`-token cache (fewer for a model whose context cannot hold both), measured
    /// once and kept (the draft-length policy reads the one at 512 tokens).
    pub fn verify_costs(&self, max_n: usize, context_len: usize) -> Result<Vec<f64>> {
        let context_len = context_len.min(self.model.info().context_length.saturating_sub(max_n)).max(1);
        match self.curve_s(context_len, max_n, true)? {
            Some((costs, _)) => Ok(costs),
            None => Err(Error::Internal("the verification curve was not measured".into())),
        }
    }

    /// `[t(1), ..., t(max_n)]` seconds at `context_len` with its source: the stored curve, grown
    /// by measuring the missing n if `measure` (else extended past its end), or None if nothing is
    /// stored and `measure` is false. The lock is held while measuring, so two requests never time
    /// forwards against each other nor measure one figure twice.
    fn curve_s(&self, context_len: usize, max_n: usize, measure: bool) -> Result<Option<(Vec<f64>, CostSource)>> {
        let max_n = max_n.max(1);
        let mut costs = lock(&self.costs)?;
        let have = costs.curves.get(&context_len).map_or(0, |curve| curve.value.len());
        // A model whose context cannot hold a verify of max_n has the rest extrapolated.
        let measurable = max_n.min(self.model.info().context_length.saturating_sub(context_len)).max(1);
        if measure && have < measurable {
            let (new_costs, quiet) = self.measure_curve(context_len, have + 1, measurable)?;
            costs.extend_curve(context_len, &new_costs, quiet);
            if let Some(disk) = &self.cost_cache {
                disk.store(&costs);
            }
        }
        let Some(Figure { value: curve, source, .. }) = costs.curves.get(&context_len) else { return Ok(None) };
        if curve.len() >= max_n {
            return Ok(Some((curve[..max_n].to_vec(), *source)));
        }
        let t1 = curve[0];
        let (ratios, _) = extend_ratios(&curve.iter().map(|t| t / t1).collect::<Vec<_>>(), max_n);
        Ok(Some((ratios.iter().map(|v| v * t1).collect(), CostSource::Extrapolated)))
    }

    /// `[t(first_n), ..., t(last_n)]`: median seconds of one forward over n new tokens on a
    /// `context_len`-token cache, and whether every timing was quiet (see `costs.rs`). Any tokens
    /// do: a forward's cost does not depend on which it reads.
    fn measure_curve(&self, context_len: usize, first_n: usize, last_n: usize) -> Result<(Vec<f64>, bool)> {
        let vocab = self.model.info().vocab_size as u64;
        let token = |i: usize| ((i as u64 * 7919 + 13) % vocab) as u32;
        let context: Vec<u32> = (0..context_len).map(token).collect();
        let probe: Vec<u32> = (context_len..context_len + last_n).map(token).collect();
        let ns: Vec<usize> = (first_n..=last_n).collect();
        let timings: Vec<(f64, bool)> =
            self.time_forwards(&context, &probe, &ns, 5)?.iter().map(|t| median_if_quiet(t)).collect();
        Ok((timings.iter().map(|t| t.0).collect(), timings.iter().all(|t| t.1)))
    }

    /// Verification cost curve: median seconds of one forward over `n` new tokens on top of a
    /// cache holding `context_ids`, for each `n` in `ns` (the new tokens are the context's last
    /// ones, reversed).
    pub fn forward_cost(&self, context_ids: &[u32], ns: &[usize], repeats: usize) -> Result<Vec<(usize, f64)>> {
        let max_n = ns.iter().copied().max().unwrap_or(1);
        if ns.contains(&0) || context_ids.len() < max_n {
            return Err(Error::config(format!(
                "forward_cost needs token counts of at least 1 (got {ns:?}) and at least {max_n} context tokens \
                 (got {})",
                context_ids.len()
            )));
        }
        let vocab = self.model.info().vocab_size;
        if let Some(bad) = context_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::config(format!(
                "forward_cost: context token id {bad} is outside the vocabulary (size {vocab}); pass ids below {vocab}"
            )));
        }
        let probe: Vec<u32> = context_ids.iter().rev().take(max_n).copied().collect();
        let timings = self.time_forwards(context_ids, &probe, ns, repeats)?;
        Ok(ns.iter().zip(timings).map(|(&n, t)| (n, median_if_quiet(&t).0)).collect())
    }

    /// Seconds of one forward over `probe[..n]` on top of a cache holding `context_ids`, `repeats`
    /// timings for each `n` in `ns` (each at most `probe.len()`). The `n` values are interleaved within
    /// each repeat so slow drift of the machine affects them alike, and the device is synchronized
    /// inside the timed region, so on a GPU this is the forward's own time, not its launch.
    fn time_forwards(&self, context_ids: &[u32], probe: &[u32], ns: &[usize], repeats: usize) -> Result<Vec<Vec<f64>>> {
        let mut cache: KvCache = self.model.new_cache(context_ids.len() + probe.len())?;
        self.model.forward_rows(context_ids, &mut cache, LogitRows::Last)?;
        // One untimed round first: the first forwards after loading touch cold weight pages, which
        // would inflate t(1) and deflate every ratio t(n)/t(1).
        for &n in ns {
            cache.truncate(context_ids.len());
            self.model.forward(&probe[..n], &mut cache)?;
        }
        let mut times = vec![Vec::with_capacity(repeats); ns.len()];
        let device = self.model.device();
        for _ in 0..repeats.max(1) {
            for (slot, &n) in ns.iter().enumerate() {
                cache.truncate(context_ids.len());
                // A GPU runs launched work after the launch returns: wait for what is still queued
                // (the untimed round's forwards) so none of it is counted here, and for this
                // forward's logits [n, vocab_size] before reading the clock, so t(n), and
                // v(n) = t(n)/t(1), are device time.
                device.synchronize()?;
                let t0 = Instant::now();
                let logits = self.model.forward(&probe[..n], &mut cache)?;
                logits.device().synchronize()?;
                times[slot].push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(times)
    }
}
