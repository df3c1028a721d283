//! The cost model as requests use it: the verification curve t(n), the draft cost c, and the
//! expected speedup they predict, read from the engine's cost figures (`cost_worker.rs`). Reading
//! never measures: a figure nobody measured yet is the nearest one known (the curve extended past
//! its end, a prior) and is queued for the background thread.
//!
//! Invariant: a request reads its figures once, at its start, and a figure changes at most once
//! per engine (when its measurement lands), so a seeded request picks the same draft lengths
//! (and so the same tokens) every time it runs on one engine once the engine's figures are
//! measured (`Engine::wait_for_costs`), and in later processes that read the same cache.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::cost_worker::{CostStatus, DraftProbe};
use super::Engine;
use crate::costs::{extend_ratios, prior_ratios, CostSource, CostTable, DraftCost, DraftCostUnit, Figure, Spread};
use crate::error::{Error, Result};
use crate::metrics::{expected_speedup_refined, expected_speedup_textbook, verify_cost_at, SpecDecodeMetrics};
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
    /// Where the verification curve came from (measured, cached, extrapolated past its end, prior).
    pub verify_cost_source: CostSource,
}

/// The costs one config's draft-length policy weighs, with their sources and spreads.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyCosts {
    /// `[k + 1]`: v(n) = t(n)/t(1).
    pub verify_cost_ratios: Vec<f64>,
    pub verify_cost_source: CostSource,
    /// How disturbed the curve's timings were (None: not timed).
    pub verify_cost_spread: Option<Spread>,
    /// c: drafting time over t(1), per draft token or per draft (`Method::draft_cost_unit`).
    pub draft_cost: DraftCost,
    pub draft_cost_source: Option<CostSource>,
    pub draft_cost_spread: Option<Spread>,
    /// The per-token acceptance this engine measured for a costly draft from its first requests
    /// (`acceptance_prior.rs`): where a request's policy starts (unless "verification" is
    /// "rejection"). None until measured (requests then try their first draft) and for drafts
    /// that cost nothing.
    pub draft_acceptance: Option<f64>,
    /// What the draft's figures are kept under (`draft_identity`; None for model-free methods),
    /// read once per config: it stats the draft's file.
    pub draft_identity: Option<String>,
}

/// The context length the draft-length policy's curve is measured at (or less, for a model whose
/// context cannot hold it beside the longest verify).
const POLICY_CONTEXT_LEN: usize = 512;

impl Engine {
    /// Whether figures nobody measured yet are measured (in the background, while no request
    /// runs; default true). Off, they stay the nearest known figure: the curve extended past its
    /// measured end, a prior draft cost, and the metrics say so.
    pub fn set_measure_on_demand(&self, on: bool) {
        self.costs.measure_on_demand.store(on, Ordering::Relaxed);
    }

    /// Whether the background thread writes a line on stderr for each figure it measures.
    pub fn set_log_measurements(&self, on: bool) {
        self.costs.log.store(on, Ordering::Relaxed);
    }

    /// What the engine measured, where (a caller's thread or the background), what is still
    /// queued, and every figure with its source and spread.
    pub fn cost_status(&self) -> CostStatus {
        self.costs.status()
    }

    /// Waits until the background thread has measured everything queued (at most `timeout`);
    /// returns whether it has. Figures change only when a measurement lands, so a program that
    /// wants the same draft lengths on every run waits once, before its requests.
    pub fn wait_for_costs(&self, timeout: Option<Duration>) -> bool {
        self.costs.wait(timeout)
    }

    /// Moves whenever a cost figure changes (a measurement landed).
    pub fn cost_version(&self) -> u64 {
        self.costs.version()
    }

    /// The verification curve `[v(1), ..., v(k+1)]` and draft cost c the draft-length policy of
    /// `config` weighs: the config's own (`verify_cost_ratios`, `draft_cost`), else the engine's
    /// figures as they are now — measured, cached, extended past the curve's end, or a prior —
    /// with what is missing (or noisy) queued for the background thread. Never measures here.
    /// Every request of one engine reads one curve, at one context length.
    pub fn policy_costs(&self, config: &SpeculativeConfig) -> Result<PolicyCosts> {
        let max_n = config.num_speculative_tokens + 1;
        let table = self.costs.table();
        let (verify_cost_ratios, verify_cost_source, verify_cost_spread) = match &config.costs.verify_cost_ratios {
            Some(given) => match extend_ratios(given, max_n) {
                (ratios, true) => (ratios, CostSource::Extrapolated, None),
                (ratios, false) => (ratios, CostSource::Config, None),
            },
            None => {
                self.costs
                    .want_curve(self.policy_context_len(), self.costs.measurable(self.policy_context_len(), max_n));
                match curve_s(&table, self.policy_context_len(), max_n) {
                    Some((curve, source, spread)) => (curve.iter().map(|t| t / curve[0]).collect(), source, spread),
                    None => (prior_ratios(max_n), CostSource::Prior, None),
                }
            }
        };
        let unit = config.method.draft_cost_unit();
        let draft_identity = self.draft_identity(config)?;
        let (draft_cost, draft_cost_source, draft_cost_spread) = match config.costs.draft_cost {
            Some(c) => (DraftCost { value: c, unit }, Some(CostSource::Config), None),
            None => match self.draft_cost(&table, config, draft_identity.as_deref())? {
                Some((c, source, spread)) => (DraftCost { value: c, unit }, Some(source), spread),
                None => (DraftCost::FREE, None, None),
            },
        };
        let draft_acceptance = match &draft_identity {
            Some(draft) if !draft_cost.is_free() => self.acceptance.landed(draft)?,
            _ => None,
        };
        Ok(PolicyCosts {
            verify_cost_ratios,
            verify_cost_source,
            verify_cost_spread,
            draft_cost,
            draft_cost_source,
            draft_cost_spread,
            draft_acceptance,
            draft_identity,
        })
    }

    /// The policy curve's context: `POLICY_CONTEXT_LEN`, or less where the model's context cannot
    /// hold it plus the longest verify. Fixed per engine, so every k reads the same curve.
    fn policy_context_len(&self) -> usize {
        let context = self.model.info().context_length;
        POLICY_CONTEXT_LEN.min(context.saturating_sub(MAX_SPECULATIVE_TOKENS + 1)).max(1)
    }

    /// c: drafting time per draft token (per draft for a block drafter) over one target step, for
    /// model-based drafts (None for model-free ones, whose microseconds do not matter): the
    /// engine's figure, else a prior from the draft's size (decoding is memory-bound, so a draft
    /// forward costs about its weight bytes over the target's) while the background thread
    /// measures it (on a 128-token context). `identity`: `config`'s `draft_identity`.
    fn draft_cost(
        &self,
        table: &CostTable,
        config: &SpeculativeConfig,
        identity: Option<&str>,
    ) -> Result<Option<(f64, CostSource, Option<Spread>)>> {
        // "auto"'s drafts cost what its model drafter's cost (so the background thread times that
        // drafter, not whichever drafter "auto" would pick).
        let drafter = self.auto_model_drafter(config)?;
        let key = match &drafter {
            Some(drafter) => self.draft_identity(drafter)?,
            None => identity.map(str::to_string),
        };
        let config = drafter.as_ref().unwrap_or(config);
        let Some(key) = key else { return Ok(None) };
        let probe = DraftProbe {
            k: config.num_speculative_tokens,
            policy_context_len: self.policy_context_len(),
            reads_target_cache: matches!(config.method, Method::LayerSkip { .. }),
            unit: config.method.draft_cost_unit(),
        };
        self.costs.want_draft_cost(&key, probe, || self.proposer(config, None))?;
        if let Some(known) = table.draft_costs.get(&key) {
            return Ok(Some((known.value, known.source, known.spread)));
        }
        Ok(Some((self.prior_draft_cost(config)?, CostSource::Prior, None)))
    }

    /// What a draft's cost depends on (the draft's weights, how many layers, PARD's k, and the
    /// unit it is measured in), so every config drafting alike shares one figure; None for
    /// model-free methods.
    pub(super) fn draft_identity(&self, config: &SpeculativeConfig) -> Result<Option<String>> {
        let file = |path: &Path| {
            let meta = std::fs::metadata(path).ok();
            let mtime = meta
                .as_ref()
                .and_then(|m| m.modified().ok())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
            format!("{}:{}:{}", canonical.display(), meta.map_or(0, |m| m.len()), mtime.map_or(0, |d| d.as_nanos()))
        };
        let identity = match &config.method {
            // "auto" is costed by its model drafter's own config (`draft_cost`).
            Method::Ngram { .. } | Method::Suffix(_) | Method::Custom | Method::Auto { .. } => None,
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
        };
        // Figures cached before block drafters were charged per draft were per token: not reused.
        Ok(identity.map(|key| match config.method.draft_cost_unit() {
            DraftCostUnit::Token => key,
            DraftCostUnit::Draft => format!("{key}:per_draft"),
        }))
    }

    /// The prior draft cost (see `draft_cost`): a draft model's weight bytes over the target's
    /// (per forward: a token's, or PARD's whole draft), a layer-skip draft's share of the layers,
    /// a head's share of the weights (per forward: a token's, or a block drafter's whole block).
    fn prior_draft_cost(&self, config: &SpeculativeConfig) -> Result<f64> {
        let bytes = |path: &Path| -> Result<f64> {
            Ok(self.draft(path, false)?.model.weight_bytes() as f64 / self.model.weight_bytes().max(1) as f64)
        };
        Ok(match &config.method {
            Method::Ngram { .. } | Method::Suffix(_) | Method::Custom | Method::Auto { .. } => 0.0,
            Method::DraftModel(d) => bytes(Path::new(&d.model))?,
            Method::Pard { draft, .. } => bytes(Path::new(&draft.model))?,
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

    /// The expected-speedup model for the acceptance in `spec`, or None without drafts. k is the
    /// mean draft length; the draft cost c is the mean proposer time per draft over t(1) (the
    /// prior curve's t(1) is unknown, so c is then 0); v is t(k+1)/t(1) from the policy's
    /// verification cost curve as it is now.
    pub fn expected_speedup(&self, spec: &SpecDecodeMetrics) -> Result<Option<ExpectedSpeedup>> {
        if spec.num_drafts == 0 {
            return Ok(None);
        }
        let k = spec.mean_draft_length();
        let max_n = k.ceil() as usize + 1;
        self.costs.want_curve(self.policy_context_len(), self.costs.measurable(self.policy_context_len(), max_n));
        let (ratios, t1, verify_cost_source) = match curve_s(&self.costs.table(), self.policy_context_len(), max_n) {
            Some((costs, source, _)) => (costs.iter().map(|t| t / costs[0]).collect(), Some(costs[0]), source),
            None => (prior_ratios(max_n), None, CostSource::Prior),
        };
        let verify_cost_ratio = verify_cost_at(&ratios, k);
        let draft_cost = t1.map_or(0.0, |t1| spec.propose_s / spec.num_drafts as f64 / t1);
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
    /// attending to ~512 positions) as it is now, extended past its end, else the prior in units
    /// of T(1); what is missing is queued for the background thread.
    pub fn batch_costs(&self, max_rows: usize) -> (Vec<f64>, CostSource) {
        let context_len = self.policy_context_len();
        self.costs.want_curve(context_len, self.costs.measurable(context_len, max_rows));
        match curve_s(&self.costs.table(), context_len, max_rows) {
            Some((curve, source, _)) => (curve, source),
            None => (prior_ratios(max_rows), CostSource::Prior),
        }
    }

    /// Verification cost curve in seconds, `[t(1), ..., t(max_n)]`: one forward over n new tokens
    /// on a `context_len`-token cache (fewer for a model whose context cannot hold both). Points
    /// nobody measured are measured now, in this thread (a program asked for the curve itself);
    /// kept, and stored on disk, like the background thread's.
    pub fn verify_costs(&self, max_n: usize, context_len: usize) -> Result<Vec<f64>> {
        let max_n = max_n.max(1);
        let context_len = context_len.min(self.model.info().context_length.saturating_sub(max_n)).max(1);
        self.costs.measure_curve_now(context_len, max_n)?;
        match curve_s(&self.costs.table(), context_len, max_n) {
            Some((costs, ..)) => Ok(costs),
            None => Err(Error::Internal("the verification curve was not measured".into())),
        }
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
        let medians = self.costs.time_forwards_now(context_ids, &probe, ns, repeats)?;
        Ok(ns.iter().copied().zip(medians).collect())
    }
}

/// `[t(1), ..., t(max_n)]` seconds at `context_len` in `table`, with its source and spread:
/// extended past the curve's end along its last slope (then `Extrapolated`), None if nothing is
/// stored.
fn curve_s(table: &CostTable, context_len: usize, max_n: usize) -> Option<(Vec<f64>, CostSource, Option<Spread>)> {
    let Figure { value: curve, source, spread } = table.curves.get(&context_len)?;
    let max_n = max_n.max(1);
    if curve.len() >= max_n {
        return Some((curve[..max_n].to_vec(), *source, *spread));
    }
    let t1 = curve[0];
    let (ratios, _) = extend_ratios(&curve.iter().map(|t| t / t1).collect::<Vec<_>>(), max_n);
    Some((ratios.iter().map(|v| v * t1).collect(), CostSource::Extrapolated, *spread))
}
