//! The two costs the adaptive draft length weighs (`draft_length.rs`): the verification cost curve
//! t(n), seconds of one target forward over n new tokens on a fixed-length context, and each
//! draft's cost c (drafting time over t(1), per draft token or per draft: `DraftCost`). Every
//! figure says where it came from — measured in this process, read from the on-disk cache a
//! previous process measured on this machine, given in the speculative config, extrapolated past
//! the measured curve, or a prior — so the metrics can say when a figure is not a measurement.
//!
//! Why a disk cache: the measurements take seconds, and a user's first request must not wait for
//! them (nor a server's first client). They depend on the model file, the device and the thread
//! count, which key the cache (`$SPECRS_CACHE_DIR/costs/`; `SPECRS_COST_CACHE=0` turns it off;
//! delete a file to measure again).
//!
//! Why interleaved rounds, a fastest try and median ratios (`estimate_rounds`): on a machine whose
//! cores another process takes, a timing is the forward's own time plus whatever the other process
//! stole; nothing makes a forward faster than the machine runs it, so the fastest try of one
//! target step is its cost. What the policy weighs are ratios (v(n) = t(n)/t(1), c = drafting
//! time over t(1)), and under a load both timings of one round stretch alike: each ratio is the
//! median over rounds of the two timed in the same round, where the fastest tries of each,
//! taken apart, would pair one timing's lucky moment with another's ordinary one. The median try
//! over the fastest is the spread: how disturbed the tries were (1.0: a quiet machine; seen here:
//! up to 50x while other processes had the cores). Every figure is stored with its spread, so a busy
//! machine no longer makes every later process measure again; a figure whose spread is over
//! `MAX_QUIET_SPREAD` is measured once more (in the background, `engine/cost_worker.rs`) by a
//! later engine, which keeps the quieter of the two. A curve is made non-decreasing (a forward
//! over more tokens never costs less), so v(n) >= 1 always.
//!
//! Invariant: a curve only grows. New n are appended and measured n are never measured again
//! (except a noisy curve's one refresh, which replaces it whole), so a request's draft lengths
//! (which read `[t(1), ..., t(k+1)]`) never change because a later request asked for a larger k.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// Where a cost figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostSource {
    /// Timed by this process.
    Measured,
    /// Timed by an earlier process on this machine, read from the disk cache.
    Cached,
    /// Given in the speculative config (`verify_cost_ratios`, `draft_cost`).
    Config,
    /// Read past the end of a measured (or given) curve by extending its last slope.
    Extrapolated,
    /// Nothing measured yet (or measuring turned off): a documented guess.
    Prior,
}

impl CostSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CostSource::Measured => "measured",
            CostSource::Cached => "cached",
            CostSource::Config => "config",
            CostSource::Extrapolated => "extrapolated",
            CostSource::Prior => "prior",
        }
    }
}

/// What drafting costs, in single-token target steps t(1). A proposer that runs once per draft
/// token (a draft model, a recurrent head) costs `value` per token: m * c for an m-token draft. A
/// block drafter (PARD, DFlash, DSpark) drafts the whole block in one forward, so a short draft
/// costs what a long one does: c per draft, whatever its length. Charging a block drafter per
/// token would make its short drafts look cheaper than they are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftCost {
    pub value: f64,
    pub unit: DraftCostUnit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftCostUnit {
    Token,
    Draft,
}

impl DraftCostUnit {
    /// How many units a draft of `num_tokens` (> 0) tokens is charged: its tokens, or one draft.
    pub fn count(self, num_tokens: usize) -> f64 {
        match self {
            DraftCostUnit::Token => num_tokens as f64,
            DraftCostUnit::Draft => 1.0,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DraftCostUnit::Token => "token",
            DraftCostUnit::Draft => "draft",
        }
    }
}

impl DraftCost {
    /// A model-free proposer's: its microseconds do not matter next to a forward.
    pub const FREE: DraftCost = DraftCost { value: 0.0, unit: DraftCostUnit::Token };

    pub fn per_token(value: f64) -> Self {
        Self { value, unit: DraftCostUnit::Token }
    }

    /// The cost of a draft of `num_tokens` tokens (none: 0).
    pub fn of(self, num_tokens: usize) -> f64 {
        if num_tokens == 0 {
            return 0.0;
        }
        self.unit.count(num_tokens) * self.value
    }

    /// What one more token adds to a draft of `num_tokens`.
    pub fn marginal(self, num_tokens: usize) -> f64 {
        self.of(num_tokens + 1) - self.of(num_tokens)
    }

    pub fn is_free(self) -> bool {
        self.value <= 0.0
    }

    /// Follows one timed draft (an exponential average, `TIMING_WEIGHT` per timing): `draft_s`
    /// seconds for a draft of `num_tokens` tokens (or tree levels), beside a forward over `rows`
    /// rows that took `forward_s`, whose single-row step t(1) is forward_s / v(rows) on
    /// `verify_cost_ratios` (`[v(1), ...]`). A free cost stays free (a lookup's microseconds are
    /// noise next to a forward); a forward past the curve's end teaches nothing.
    pub fn follow(&mut self, draft_s: f64, num_tokens: usize, forward_s: f64, rows: usize, verify_cost_ratios: &[f64]) {
        let Some(&v) = rows.checked_sub(1).and_then(|i| verify_cost_ratios.get(i)) else { return };
        if num_tokens == 0 || forward_s <= 0.0 || self.is_free() {
            return;
        }
        let measured = draft_s / self.unit.count(num_tokens) / (forward_s / v);
        self.value = (1.0 - TIMING_WEIGHT) * self.value + TIMING_WEIGHT * measured;
    }
}

/// Weight of each new timing in a request's own draft cost (`DraftCost::follow`): a memory of a
/// few drafts.
const TIMING_WEIGHT: f64 = 0.3;

impl std::fmt::Display for DraftCost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:.2} per {}", self.value, self.unit.as_str())
    }
}

/// The prior verification cost per extra token, v(n) = 1 + PRIOR_VERIFY_SLOPE * (n - 1): what
/// SmolLM2 and Gemma 3 measure on 2 CPU cores (v(5) = 2.3-2.6). Pessimistic on a GPU, where v is
/// near 1, which errs towards shorter drafts: slower, never wrong.
pub const PRIOR_VERIFY_SLOPE: f64 = 0.3;

/// `[v(1), ..., v(max_n)]` from `ratios` (`[v(1) = 1, v(2), ...]`): past its end, the last
/// segment's slope continues (never below flat). Returns whether any value was extrapolated.
pub fn extend_ratios(ratios: &[f64], max_n: usize) -> (Vec<f64>, bool) {
    let mut out: Vec<f64> = ratios.iter().copied().take(max_n).collect();
    let extrapolated = out.len() < max_n;
    let slope = match ratios {
        [] | [_] => PRIOR_VERIFY_SLOPE,
        [.., before, last] => (last - before).max(0.0),
    };
    while out.len() < max_n {
        let last = out.last().copied().unwrap_or(1.0);
        out.push(last + slope);
    }
    (out, extrapolated)
}

/// The prior curve `[v(1), ..., v(max_n)]`.
pub fn prior_ratios(max_n: usize) -> Vec<f64> {
    (0..max_n).map(|i| 1.0 + PRIOR_VERIFY_SLOPE * i as f64).collect()
}

/// Tries of one timing: at least this many, interleaved with the other timings of the figure.
pub const MIN_TRIES: usize = 5;
/// ... and at most this many, while the tries are disturbed (spread over `MAX_QUIET_SPREAD`).
pub const MAX_TRIES: usize = 15;

/// A figure whose median try took more than this times its fastest was disturbed: it is used and
/// stored, and a later engine measures it once more, keeping the quieter. `SPECRS_MAX_QUIET_SPREAD`
/// overrides it.
pub const MAX_QUIET_SPREAD: f64 = 1.25;

fn max_quiet_spread() -> f64 {
    std::env::var("SPECRS_MAX_QUIET_SPREAD").ok().and_then(|v| v.parse().ok()).unwrap_or(MAX_QUIET_SPREAD)
}

/// How disturbed the tries behind a figure were.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    /// Median try over the fastest (>= 1; 1.0 on a quiet machine). For a curve, its worst point's.
    pub ratio: f64,
    /// Tries behind the figure (for a curve, its point with the fewest).
    pub tries: usize,
}

impl Spread {
    pub fn is_quiet(&self) -> bool {
        self.ratio <= max_quiet_spread()
    }

    /// The spread of a figure made of both (a curve's points): the worse ratio, the fewer tries.
    pub fn worst(self, other: Spread) -> Spread {
        Spread { ratio: self.ratio.max(other.ratio), tries: self.tries.min(other.tries) }
    }
}

/// The figure of repeated timings of one thing (seconds): the fastest try, and the spread.
/// `tries` must not be empty.
pub fn estimate(tries: &[f64]) -> (f64, Spread) {
    let fastest = tries.iter().copied().fold(f64::INFINITY, f64::min);
    let ratio = if fastest > 0.0 { median(tries) / fastest } else { f64::INFINITY };
    (fastest, Spread { ratio, tries: tries.len() })
}

/// Rounds of interleaved tries of the timings behind one figure: `rounds[r][i]` is the seconds
/// of timing i in round r (None: the try was spoiled). Timing 0 is the reference, t(1) (one
/// target step), that the others are relative to.
pub type Rounds = Vec<Vec<Option<f64>>>;

/// Timing `i`'s tries, spoiled ones left out.
fn tries_of(rounds: &[Vec<Option<f64>>], i: usize) -> Vec<f64> {
    rounds.iter().filter_map(|round| round[i]).collect()
}

/// Timing `i` over the reference, one ratio per round that has both. Under a steady load both
/// stretch alike, so the ratio survives a busy machine where each timing alone does not: the
/// fastest try of each would pair the one lucky moment of one timing with another's ordinary one
/// (seen here, on 2 cores under a load of 10: v(2) = 3.9 from the fastest tries, against 1.3
/// quiet).
fn ratios_of(rounds: &[Vec<Option<f64>>], i: usize) -> Vec<f64> {
    rounds.iter().filter_map(|round| Some(round[i]? / round[0].filter(|t| *t > 0.0)?)).collect()
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[(sorted.len() - 1) / 2]
}

/// Whether `rounds` (of `num_timings` timings) are enough: `MIN_TRIES` paired tries of each
/// timing, and quiet ones or `MAX_TRIES`.
pub fn enough_rounds(rounds: &[Vec<Option<f64>>], num_timings: usize) -> bool {
    let fewest = (0..num_timings).map(|i| ratios_of(rounds, i).len()).min().unwrap_or(0);
    let quiet = (0..num_timings).all(|i| {
        let tries = tries_of(rounds, i);
        !tries.is_empty() && estimate(&tries).1.is_quiet()
    });
    fewest >= MAX_TRIES || (fewest >= MIN_TRIES && quiet)
}

/// The figures of `rounds` (see `Rounds`): the reference's fastest try (the machine's own cost
/// of one step, `estimate`), each timing's median ratio to it within a round (1 for the
/// reference), and the spread (the worst timing's). None unless every timing has a paired try.
pub fn estimate_rounds(rounds: &[Vec<Option<f64>>], num_timings: usize) -> Option<(f64, Vec<f64>, Spread)> {
    let reference_tries = tries_of(rounds, 0);
    if reference_tries.is_empty() {
        return None;
    }
    let (reference, mut spread) = estimate(&reference_tries);
    let mut ratios = Vec::with_capacity(num_timings);
    for i in 0..num_timings {
        let paired = ratios_of(rounds, i);
        if paired.is_empty() {
            return None;
        }
        ratios.push(median(&paired));
        spread = spread.worst(estimate(&tries_of(rounds, i)).1);
    }
    Some((reference, ratios, spread))
}

/// One cost figure, where it came from, and (for a timing) its spread.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure<T> {
    pub value: T,
    pub source: CostSource,
    /// None for a figure that was not timed (config, prior).
    pub spread: Option<Spread>,
}

impl<T> Figure<T> {
    /// A timing of this process.
    pub fn measured(value: T, spread: Spread) -> Self {
        Self { value, source: CostSource::Measured, spread: Some(spread) }
    }

    /// Whether its tries were disturbed (a later engine that reads it from the disk cache
    /// measures it once more).
    pub fn is_noisy(&self) -> bool {
        self.spread.is_some_and(|s| !s.is_quiet())
    }
}

/// What an engine knows of its costs: verification curves by context length (seconds, growing
/// only, non-decreasing) and draft costs by draft identity.
#[derive(Debug, Clone, Default)]
pub struct CostTable {
    pub curves: BTreeMap<usize, Figure<Vec<f64>>>,
    pub draft_costs: BTreeMap<String, Figure<f64>>,
}

impl CostTable {
    /// Appends measured `t(n)` for n past the curve's end (the curve never shrinks, and what it
    /// holds never changes), each at least the one before it. `first_n` is the n of
    /// `new_costs_s[0]`: points the curve already holds are skipped (another measurement took
    /// them first). Returns whether the curve grew.
    pub fn extend_curve(&mut self, context_len: usize, first_n: usize, new_costs_s: &[f64], spread: Spread) -> bool {
        let curve = self.curves.entry(context_len).or_insert(Figure::measured(Vec::new(), spread));
        let have = curve.value.len();
        if first_n > have + 1 || first_n + new_costs_s.len() <= have + 1 {
            return false;
        }
        for &t in &new_costs_s[have + 1 - first_n..] {
            let floor = curve.value.last().copied().unwrap_or(0.0);
            curve.value.push(t.max(floor));
        }
        curve.spread = Some(curve.spread.map_or(spread, |s| s.worst(spread)));
        true
    }

    /// Replaces a noisy curve with a new measurement of it (at least as long) if that is
    /// quieter. Returns whether it did.
    pub fn refresh_curve(&mut self, context_len: usize, costs_s: &[f64], spread: Spread) -> bool {
        let Some(curve) = self.curves.get_mut(&context_len) else { return false };
        let quieter = curve.spread.is_none_or(|old| spread.ratio < old.ratio);
        if !quieter || costs_s.len() < curve.value.len() {
            return false;
        }
        let mut value = Vec::with_capacity(costs_s.len());
        for &t in costs_s {
            value.push(t.max(value.last().copied().unwrap_or(0.0)));
        }
        *curve = Figure::measured(value, spread);
        true
    }

    /// Sets a draft cost measured now: a new one, or a quieter measurement of a noisy one.
    /// Returns whether it changed.
    pub fn set_draft_cost(&mut self, key: &str, cost: f64, spread: Spread) -> bool {
        if let Some(old) = self.draft_costs.get(key) {
            if !old.is_noisy() || old.spread.is_some_and(|s| spread.ratio >= s.ratio) {
                return false;
            }
        }
        self.draft_costs.insert(key.to_string(), Figure::measured(cost, spread));
        true
    }

    fn to_json(&self) -> String {
        let spread_items = |spread: Option<Spread>| -> [(String, Value); 2] {
            let spread = spread.unwrap_or(Spread { ratio: 1.0, tries: 0 });
            [("spread".into(), spread.ratio.into()), ("tries".into(), spread.tries.into())]
        };
        let curves: Map<String, Value> = self
            .curves
            .iter()
            .filter(|(_, curve)| curve.spread.is_some())
            .map(|(len, curve)| {
                let mut entry = Map::from_iter(spread_items(curve.spread));
                entry.insert("costs_s".into(), curve.value.clone().into());
                (len.to_string(), entry.into())
            })
            .collect();
        let drafts: Map<String, Value> = self
            .draft_costs
            .iter()
            .filter(|(_, c)| c.spread.is_some())
            .map(|(key, c)| {
                let mut entry = Map::from_iter(spread_items(c.spread));
                entry.insert("cost".into(), c.value.into());
                (key.clone(), entry.into())
            })
            .collect();
        Value::Object(Map::from_iter([
            ("format".into(), DISK_FORMAT.into()),
            ("verify_costs_s".into(), curves.into()),
            ("draft_costs".into(), drafts.into()),
        ]))
        .to_string()
    }

    /// A table read back from `to_json`, every figure marked `Cached`; None if unreadable (an
    /// older format, or a curve that is not positive, finite and non-decreasing, was not written
    /// by this `to_json`).
    fn from_json(text: &str) -> Option<Self> {
        let value: Value = serde_json::from_str(text).ok()?;
        if value.get("format")?.as_u64()? != DISK_FORMAT {
            return None;
        }
        let spread = |entry: &Value| -> Option<Spread> {
            let ratio = entry.get("spread")?.as_f64().filter(|r| r.is_finite() && *r >= 1.0)?;
            Some(Spread { ratio, tries: entry.get("tries")?.as_u64()? as usize })
        };
        let mut table = Self::default();
        for (len, entry) in value.get("verify_costs_s")?.as_object()? {
            let costs: Vec<f64> = entry.get("costs_s")?.as_array()?.iter().map(Value::as_f64).collect::<Option<_>>()?;
            let valid = costs.iter().all(|t| t.is_finite() && *t > 0.0) && costs.windows(2).all(|w| w[0] <= w[1]);
            if costs.is_empty() || !valid {
                return None;
            }
            let figure = Figure { value: costs, source: CostSource::Cached, spread: Some(spread(entry)?) };
            table.curves.insert(len.parse().ok()?, figure);
        }
        for (key, entry) in value.get("draft_costs")?.as_object()? {
            let c = entry.get("cost")?.as_f64().filter(|c| c.is_finite() && *c >= 0.0)?;
            let figure = Figure { value: c, source: CostSource::Cached, spread: Some(spread(entry)?) };
            table.draft_costs.insert(key.clone(), figure);
        }
        Some(table)
    }
}

/// The disk cache's format: files of another (the unscreened medians of older versions) are
/// ignored and measured again.
const DISK_FORMAT: u64 = 2;

/// The disk cache of one model file on one device at one thread count.
#[derive(Debug, Clone)]
pub struct DiskCache {
    path: PathBuf,
}

impl DiskCache {
    /// The cache file for `model_path` (None when the cache is off or the file cannot be
    /// stat'ed): keyed by the file's canonical path, size and mtime, the device, the kernels the
    /// model runs on (`ModelInfo::kernels`), the thread count and the specrs version, so a
    /// changed model, machine setting or kernel measures afresh.
    pub fn for_model(
        cache_dir: &Path,
        model_path: &Path,
        device: &str,
        kernels: &str,
        num_threads: usize,
    ) -> Option<Self> {
        if std::env::var("SPECRS_COST_CACHE").is_ok_and(|v| v == "0" || v.eq_ignore_ascii_case("off")) {
            return None;
        }
        let canonical = model_path.canonicalize().ok()?;
        let meta = std::fs::metadata(&canonical).ok()?;
        let mtime = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos();
        let key = format!(
            "{}|{}|{}|{mtime}|{device}|{num_threads}|{kernels}",
            env!("CARGO_PKG_VERSION"),
            canonical.display(),
            meta.len()
        );
        let stem = canonical.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        Some(Self { path: cache_dir.join("costs").join(format!("{stem}-{:016x}.json", fnv1a(key.as_bytes()))) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What an earlier process stored (empty if nothing, or if the file is unreadable: the
    /// figures are then measured again).
    pub fn load(&self) -> CostTable {
        std::fs::read_to_string(&self.path).ok().and_then(|text| CostTable::from_json(&text)).unwrap_or_default()
    }

    /// Stores `table`'s timed figures over the file's (written to a temporary file and renamed,
    /// so a concurrent reader sees the old or the new file, never half of one). A cache that cannot be written only costs the
    /// next process a measurement, so failures are not errors.
    pub fn store(&self, table: &CostTable) {
        let Some(dir) = self.path.parent() else { return };
        // What another process stored meanwhile and this one does not know is kept.
        let mut merged = self.load();
        merged.curves.extend(table.curves.iter().filter(|(_, c)| c.spread.is_some()).map(|(k, v)| (*k, v.clone())));
        merged
            .draft_costs
            .extend(table.draft_costs.iter().filter(|(_, c)| c.spread.is_some()).map(|(k, v)| (k.clone(), v.clone())));
        let tmp = self.path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&tmp, merged.to_json()));
        if written.and_then(|()| std::fs::rename(&tmp, &self.path)).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// FNV-1a: a hash that stays the same across Rust versions, for file names.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extension_keeps_the_curve_and_continues_its_last_slope() {
        assert_eq!(extend_ratios(&[1.0, 1.4, 1.6], 2), (vec![1.0, 1.4], false));
        let (curve, extrapolated) = extend_ratios(&[1.0, 1.4, 1.6], 5);
        assert!(extrapolated);
        for (got, want) in curve.iter().zip([1.0, 1.4, 1.6, 1.8, 2.0]) {
            assert!((got - want).abs() < 1e-12, "{curve:?}");
        }
        // A noisy decreasing tail extends flat, never downwards.
        assert_eq!(extend_ratios(&[1.0, 1.2, 1.1], 4).0, vec![1.0, 1.2, 1.1, 1.1]);
        assert_eq!(extend_ratios(&[1.0], 3).0, prior_ratios(3));
    }

    const QUIET: Spread = Spread { ratio: 1.02, tries: 5 };

    #[test]
    fn a_curve_only_grows_and_never_decreases() {
        let mut table = CostTable::default();
        assert!(table.extend_curve(512, 1, &[0.01, 0.014], QUIET));
        assert!(table.extend_curve(512, 3, &[0.016, 0.012], QUIET));
        // Points it holds are never measured again: a second measurement of t(2..4) adds t(5) only.
        assert!(table.extend_curve(512, 2, &[0.5, 0.5, 0.5, 0.02], QUIET));
        assert!(!table.extend_curve(512, 1, &[0.5], QUIET), "nothing past the end");
        assert!(!table.extend_curve(512, 7, &[0.5], QUIET), "a gap is not appended");
        let curve = &table.curves[&512];
        assert_eq!(curve.value, vec![0.01, 0.014, 0.016, 0.016, 0.02]);
        assert_eq!((curve.source, curve.spread), (CostSource::Measured, Some(QUIET)));
    }

    #[test]
    fn the_fastest_try_is_the_figure_and_the_median_over_it_the_spread() {
        let (t, spread) = estimate(&[0.012, 0.011, 0.013, 0.012, 0.014]);
        assert_eq!((t, spread.tries), (0.011, 5));
        assert!((spread.ratio - 0.012 / 0.011).abs() < 1e-12 && spread.is_quiet());
        // Another process took the cores for most tries: the fastest is still the machine's own
        // cost, and the spread says the tries were disturbed.
        let (t, spread) = estimate(&[0.6, 0.012, 0.7, 0.011, 0.65]);
        assert_eq!(t, 0.011);
        assert!(!spread.is_quiet(), "{spread:?}");
    }

    /// Rounds of [t(1), t(2), t(3)] with the quiet costs [10, 13, 15] ms, each round's timings
    /// stretched by its load (a factor per timing, for a load that changed within a round).
    fn rounds(loads: &[[f64; 3]]) -> Rounds {
        loads.iter().map(|load| [10e-3, 13e-3, 15e-3].iter().zip(load).map(|(t, l)| Some(t * l)).collect()).collect()
    }

    #[test]
    fn ratios_are_paired_within_a_round_so_a_steady_load_leaves_them_as_they_are() {
        // Every round three times slower, and one round whose t(1) alone was quiet: the fastest
        // tries taken apart give v(2) = 3.9 (what this machine measured under a load of 10);
        // ratios within a round give 1.3.
        let mut loads = vec![[3.0, 3.0, 3.0]; 6];
        loads.push([1.0, 3.0, 3.0]);
        let (t1, ratios, spread) = estimate_rounds(&rounds(&loads), 3).unwrap();
        assert_eq!(t1, 10e-3);
        for (got, want) in ratios.iter().zip([1.0, 1.3, 1.5]) {
            assert!((got - want).abs() < 1e-12, "{ratios:?}");
        }
        assert!(!spread.is_quiet() && spread.tries == 7, "{spread:?}");
        // A spoiled try (None) leaves its round out of that timing's ratio only.
        let mut spoiled = rounds(&[[1.0, 1.0, 1.0]; 5]);
        spoiled[0][2] = None;
        spoiled[1][0] = None;
        let (_, ratios, spread) = estimate_rounds(&spoiled, 3).unwrap();
        assert!((ratios[2] - 1.5).abs() < 1e-12 && spread.tries == 4);
        assert_eq!(estimate_rounds(&[vec![None, Some(1.0)]], 2), None);
    }

    #[test]
    fn quiet_rounds_stop_at_the_fewest_tries_and_disturbed_ones_at_the_most() {
        assert!(!enough_rounds(&rounds(&[[1.0; 3]; MIN_TRIES - 1]), 3));
        assert!(enough_rounds(&rounds(&[[1.0; 3]; MIN_TRIES]), 3));
        let mut busy = vec![[4.0, 4.0, 4.0]; MIN_TRIES];
        busy[0] = [1.0, 1.0, 1.0];
        assert!(!enough_rounds(&rounds(&busy), 3), "disturbed: more tries");
        busy.resize(MAX_TRIES, [4.0, 4.0, 4.0]);
        assert!(enough_rounds(&rounds(&busy), 3), "but no more than MAX_TRIES");
        // Spoiled tries do not count.
        let mut spoiled = rounds(&[[1.0; 3]; MIN_TRIES]);
        spoiled[0][1] = None;
        assert!(!enough_rounds(&spoiled, 3));
    }

    #[test]
    fn disturbed_figures_are_stored_with_their_spread_and_replaced_only_by_quieter_ones() {
        let noisy = Spread { ratio: 3.0, tries: 15 };
        let mut table = CostTable::default();
        table.extend_curve(512, 1, &[0.01, 0.02], QUIET);
        table.extend_curve(60, 1, &[0.5, 0.7], noisy);
        table.set_draft_cost("quiet", 0.3, QUIET);
        table.set_draft_cost("noisy", 9.0, noisy);
        // Everything is stored (a busy machine must not make every later process measure again).
        let mut back = CostTable::from_json(&table.to_json()).unwrap();
        assert_eq!(back.curves.keys().collect::<Vec<_>>(), [&60, &512]);
        assert_eq!(back.curves[&60].spread, Some(noisy));
        assert!(back.curves[&60].is_noisy() && !back.curves[&512].is_noisy());
        assert_eq!(back.draft_costs["noisy"].source, CostSource::Cached);
        // A quiet figure is never replaced; a noisy one by a quieter measurement only.
        assert!(!back.set_draft_cost("quiet", 0.1, Spread { ratio: 1.0, tries: 5 }));
        assert!(!back.set_draft_cost("noisy", 8.0, Spread { ratio: 4.0, tries: 15 }));
        assert!(back.set_draft_cost("noisy", 0.4, QUIET));
        assert_eq!(back.draft_costs["noisy"], Figure::measured(0.4, QUIET));
        assert!(!back.refresh_curve(60, &[0.4, 0.6], Spread { ratio: 5.0, tries: 15 }));
        assert!(!back.refresh_curve(60, &[0.4], QUIET), "a refresh covers the whole curve");
        assert!(back.refresh_curve(60, &[0.4, 0.3, 0.6], QUIET));
        assert_eq!(back.curves[&60], Figure::measured(vec![0.4, 0.4, 0.6], QUIET));
        // A decreasing curve on disk was not written by specrs; nor was a file of the older format.
        let bad = r#"{"format": 2, "verify_costs_s": {"512": {"costs_s": [0.6, 0.4], "spread": 1.0, "tries": 5}},
                      "draft_costs": {}}"#;
        assert!(CostTable::from_json(bad).is_none());
        assert!(CostTable::from_json(r#"{"verify_costs_s": {"512": [0.1, 0.2]}, "draft_costs": {}}"#).is_none());
    }

    #[test]
    fn the_disk_cache_round_trips_and_is_keyed_by_the_model_file() {
        let dir = std::env::temp_dir().join(format!("specrs-costs-test-{}", std::process::id()));
        let model = dir.join("model.gguf");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&model, b"weights").unwrap();
        let cache = DiskCache::for_model(&dir, &model, "Cpu", "reference", 2).unwrap();
        assert!(cache.load().curves.is_empty());
        let mut table = CostTable::default();
        table.extend_curve(512, 1, &[0.01, 0.02], QUIET);
        table.set_draft_cost("layer_skip:8", 0.4, QUIET);
        cache.store(&table);
        let back = cache.load();
        assert_eq!(
            back.curves[&512],
            Figure { value: vec![0.01, 0.02], source: CostSource::Cached, spread: Some(QUIET) }
        );
        assert_eq!(back.draft_costs["layer_skip:8"].value, 0.4);
        assert_eq!(back.draft_costs["layer_skip:8"].source, CostSource::Cached);
        // A process storing what it knows keeps what another stored that it does not know.
        let mut other_process = CostTable::default();
        other_process.set_draft_cost("eagle3:head", 0.2, QUIET);
        cache.store(&other_process);
        let merged = cache.load();
        assert!(merged.curves.contains_key(&512) && merged.draft_costs.contains_key("layer_skip:8"));
        assert_eq!(merged.draft_costs["eagle3:head"].value, 0.2);
        // Another thread count (or device, or kernel set) is another file.
        let other = DiskCache::for_model(&dir, &model, "Cpu", "reference", 4).unwrap();
        assert_ne!(other.path(), cache.path());
        let other_kernels = DiskCache::for_model(&dir, &model, "Cpu", "x86_avx2", 2).unwrap();
        assert_ne!(other_kernels.path(), cache.path());
        assert!(other.load().curves.is_empty());
        // A corrupt file is ignored (measured again), not an error.
        std::fs::write(cache.path(), b"{not json").unwrap();
        assert!(cache.load().curves.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
