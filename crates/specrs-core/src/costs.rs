//! The two costs the adaptive draft length weighs (`draft_length.rs`): the verification cost curve
//! t(n), seconds of one target forward over n new tokens on a fixed-length context, and each
//! draft's cost per token c (drafting time over t(1)). Every figure says where it came from —
//! measured in this process, read from the on-disk cache a previous process measured on this
//! machine, given in the speculative config, extrapolated past the measured curve, or a prior — so
//! the metrics can say when a figure is not a measurement.
//!
//! Why a disk cache: the measurements take seconds, and a user's first request must not pay them
//! inside its own latency (nor a server's first client). They depend on the model file, the device
//! and the thread count, which key the cache (`$SPECRS_CACHE_DIR/costs/`; `SPECRS_COST_CACHE=0`
//! turns it off; delete a file to measure again).
//!
//! Why measurements are screened: on a machine whose cores another process takes, the timings are
//! noise (seen here: t(1) at 50x its quiet value, v(n) below 1), and a cache would keep the noise
//! for every later process. A timing whose repeats spread more than `MAX_QUIET_SPREAD` serves the
//! process that took it but is never stored, and a curve is made non-decreasing (a forward over
//! more tokens never costs less), so v(n) >= 1 always.
//!
//! Invariant: a curve only grows. New n are appended and measured n are never measured again, so a
//! request's draft lengths (which read `[t(1), ..., t(k+1)]`) never change because a later request
//! asked for a larger k.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// Where a cost figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostSource {
    /// Timed by this process.
    Measured,
    /// Timed by this process while another took the cores (its repeats spread past
    /// `MAX_QUIET_SPREAD`): used here, never stored for later processes.
    Disturbed,
    /// Timed by an earlier process on this machine, read from the disk cache.
    Cached,
    /// Given in the speculative config (`verify_cost_ratios`, `draft_cost`).
    Config,
    /// Read past the end of a measured (or given) curve by extending its last slope.
    Extrapolated,
    /// Nothing measured and measuring not allowed here: a documented guess.
    Prior,
}

impl CostSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CostSource::Measured => "measured",
            CostSource::Disturbed => "disturbed",
            CostSource::Cached => "cached",
            CostSource::Config => "config",
            CostSource::Extrapolated => "extrapolated",
            CostSource::Prior => "prior",
        }
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

/// Repeats of one timing whose slowest took more than this times the fastest were disturbed
/// (another process had the cores): the figure is used, but not stored for later processes.
/// `SPECRS_MAX_QUIET_SPREAD` overrides it (tests that must store what they measure raise it).
pub const MAX_QUIET_SPREAD: f64 = 1.5;

fn max_quiet_spread() -> f64 {
    std::env::var("SPECRS_MAX_QUIET_SPREAD").ok().and_then(|v| v.parse().ok()).unwrap_or(MAX_QUIET_SPREAD)
}

/// The median of `samples` (seconds of repeated timings of one thing) and whether they were quiet
/// (slowest / fastest within `MAX_QUIET_SPREAD`).
pub fn median_if_quiet(samples: &[f64]) -> (f64, bool) {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let (fastest, slowest) = (sorted[0], sorted[sorted.len() - 1]);
    (sorted[sorted.len() / 2], fastest > 0.0 && slowest <= max_quiet_spread() * fastest)
}

/// One cost figure and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure<T> {
    pub value: T,
    pub source: CostSource,
}

impl<T> Figure<T> {
    /// A timing of this process: `Measured` if quiet, else `Disturbed`.
    pub fn measured(value: T, quiet: bool) -> Self {
        Self { value, source: if quiet { CostSource::Measured } else { CostSource::Disturbed } }
    }

    /// Whether later processes may reuse it (not a disturbed timing).
    fn storable(&self) -> bool {
        self.source != CostSource::Disturbed
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
    /// holds never changes), each at least the one before it.
    pub fn extend_curve(&mut self, context_len: usize, new_costs_s: &[f64], quiet: bool) {
        let curve = self.curves.entry(context_len).or_insert(Figure::measured(Vec::new(), true));
        if !quiet {
            curve.source = CostSource::Disturbed;
        }
        for &t in new_costs_s {
            let floor = curve.value.last().copied().unwrap_or(0.0);
            curve.value.push(t.max(floor));
        }
    }

    fn to_json(&self) -> String {
        let curves: Map<String, Value> = self
            .curves
            .iter()
            .filter(|(_, curve)| curve.storable())
            .map(|(len, curve)| (len.to_string(), curve.value.clone().into()))
            .collect();
        let drafts: Map<String, Value> = self
            .draft_costs
            .iter()
            .filter(|(_, c)| c.storable())
            .map(|(key, c)| (key.clone(), c.value.into()))
            .collect();
        Value::Object(Map::from_iter([("verify_costs_s".into(), curves.into()), ("draft_costs".into(), drafts.into())]))
            .to_string()
    }

    /// A table read back from `to_json`, every figure marked `Cached`; None if unreadable (a
    /// curve that is not positive, finite and non-decreasing was not written by `to_json`).
    fn from_json(text: &str) -> Option<Self> {
        let value: Value = serde_json::from_str(text).ok()?;
        let mut table = Self::default();
        for (len, costs) in value.get("verify_costs_s")?.as_object()? {
            let costs: Vec<f64> = costs.as_array()?.iter().map(Value::as_f64).collect::<Option<_>>()?;
            let valid = costs.iter().all(|t| t.is_finite() && *t > 0.0) && costs.windows(2).all(|w| w[0] <= w[1]);
            if costs.is_empty() || !valid {
                return None;
            }
            table.curves.insert(len.parse().ok()?, Figure { value: costs, source: CostSource::Cached });
        }
        for (key, c) in value.get("draft_costs")?.as_object()? {
            let c = c.as_f64().filter(|c| c.is_finite() && *c >= 0.0)?;
            table.draft_costs.insert(key.clone(), Figure { value: c, source: CostSource::Cached });
        }
        Some(table)
    }
}

/// The disk cache of one model file on one device at one thread count.
#[derive(Debug, Clone)]
pub struct DiskCache {
    path: PathBuf,
}

impl DiskCache {
    /// The cache file for `model_path` (None when the cache is off or the file cannot be
    /// stat'ed): keyed by the file's canonical path, size and mtime, the device, the thread count
    /// and the specrs version, so a changed model, machine setting or kernel measures afresh.
    pub fn for_model(cache_dir: &Path, model_path: &Path, device: &str, num_threads: usize) -> Option<Self> {
        if std::env::var("SPECRS_COST_CACHE").is_ok_and(|v| v == "0" || v.eq_ignore_ascii_case("off")) {
            return None;
        }
        let canonical = model_path.canonicalize().ok()?;
        let meta = std::fs::metadata(&canonical).ok()?;
        let mtime = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos();
        // Which CPU kernels run (the repacked AVX-512 VNNI ones or the AVX2 ones) changes every cost.
        let kernels = if crate::model::cpu::repack::available() { "vnni" } else { "avx2" };
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

    /// Stores `table` (written to a temporary file and renamed, so a concurrent reader sees the
    /// old or the new file, never half of one). A cache that cannot be written only costs the
    /// next process a measurement, so failures are not errors.
    pub fn store(&self, table: &CostTable) {
        let Some(dir) = self.path.parent() else { return };
        let tmp = self.path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&tmp, table.to_json()));
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

    #[test]
    fn a_curve_only_grows_and_never_decreases() {
        let mut table = CostTable::default();
        table.extend_curve(512, &[0.01, 0.014], true);
        table.extend_curve(512, &[0.016, 0.012], true);
        let curve = &table.curves[&512];
        assert_eq!(curve.value, vec![0.01, 0.014, 0.016, 0.016]);
        assert_eq!(curve.source, CostSource::Measured);
    }

    #[test]
    fn disturbed_timings_serve_the_process_but_are_not_stored() {
        assert_eq!(median_if_quiet(&[0.012, 0.011, 0.013, 0.012, 0.014]), (0.012, true));
        // Another process took the cores for some repeats.
        assert_eq!(median_if_quiet(&[0.012, 0.6, 0.011, 0.7, 0.013]), (0.013, false));
        let mut table = CostTable::default();
        table.extend_curve(512, &[0.01, 0.02], true);
        table.extend_curve(60, &[0.5, 0.7], false);
        assert_eq!(table.curves[&60].source, CostSource::Disturbed);
        table.draft_costs.insert("quiet".into(), Figure::measured(0.3, true));
        table.draft_costs.insert("noisy".into(), Figure::measured(9.0, false));
        let back = CostTable::from_json(&table.to_json()).unwrap();
        assert_eq!(back.curves.keys().collect::<Vec<_>>(), [&512]);
        assert_eq!(back.draft_costs.keys().collect::<Vec<_>>(), ["quiet"]);
        // Appending a disturbed segment to a stored curve stops it being stored again.
        table.extend_curve(512, &[0.9], false);
        assert!(!CostTable::from_json(&table.to_json()).unwrap().curves.contains_key(&512));
        // A decreasing curve on disk was not written by specrs (or by an older one): measured again.
        assert!(CostTable::from_json(r#"{"verify_costs_s": {"512": [0.6, 0.4]}, "draft_costs": {}}"#).is_none());
    }

    #[test]
    fn the_disk_cache_round_trips_and_is_keyed_by_the_model_file() {
        let dir = std::env::temp_dir().join(format!("specrs-costs-test-{}", std::process::id()));
        let model = dir.join("model.gguf");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&model, b"weights").unwrap();
        let cache = DiskCache::for_model(&dir, &model, "Cpu", 2).unwrap();
        assert!(cache.load().curves.is_empty());
        let mut table = CostTable::default();
        table.extend_curve(512, &[0.01, 0.02], true);
        table.draft_costs.insert("layer_skip:8".into(), Figure::measured(0.4, true));
        cache.store(&table);
        let back = cache.load();
        assert_eq!(back.curves[&512], Figure { value: vec![0.01, 0.02], source: CostSource::Cached });
        assert_eq!(back.draft_costs["layer_skip:8"].value, 0.4);
        assert_eq!(back.draft_costs["layer_skip:8"].source, CostSource::Cached);
        // Another thread count (or device) is another file.
        let other = DiskCache::for_model(&dir, &model, "Cpu", 4).unwrap();
        assert_ne!(other.path(), cache.path());
        assert!(other.load().curves.is_empty());
        // A corrupt file is ignored (measured again), not an error.
        std::fs::write(cache.path(), b"{not json").unwrap();
        assert!(cache.load().curves.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
