//! Golden pins: values today's code computes, committed as text, so a refactor can be checked
//! bitwise against the code before it (verify_pins.rs, forward_pins.rs, seeded_pins.rs).
//!
//! A pin file under `tests/golden/pins/` has one `key: value` line per case, sorted by key. A test
//! computes every case, then either compares them with the file (the default: a changed, missing
//! or extra case fails, naming the case) or, with `SPECRS_WRITE_PINS=1`, writes them into it.
//! Values that depend on the CPU kernels are keyed `<kernel set>/...`; writing replaces only the
//! running set's lines, and a set without lines in the file fails, saying how to generate them.
//!
//! Invariant: a check never passes without comparing at least one case with a committed value.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// The environment variable that turns a pin test into the writer of its pins.
pub const WRITE_ENV: &str = "SPECRS_WRITE_PINS";

pub fn pin_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/pins").join(name)
}

/// The CPU kernel set the CPU backend runs here (`model::kernels`), the key of kernel-dependent
/// pins: "vnni" (the repacked AVX-512 VNNI matmuls), "avx2" (the AVX2 kernels, also what
/// `SPECRS_CPU_KERNELS=avx2` forces on a VNNI machine) or "scalar" (the reference set).
pub fn kernel_set() -> &'static str {
    match specrs_core::model::kernels::kernels().name {
        "x86_avx512_vnni" => "vnni",
        "x86_avx2" => "avx2",
        _ => "scalar",
    }
}

/// FNV-1a 64 over the bits of `values`, little-endian.
pub fn fnv1a_f32(values: &[f32]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for v in values {
        for byte in v.to_bits().to_le_bytes() {
            hash ^= byte as u64;
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

fn read(name: &str) -> BTreeMap<String, String> {
    let path = pin_file(name);
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once(": ").unwrap_or_else(|| panic!("{}: malformed line {l:?}", path.display()));
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn write(name: &str, header: &str, pins: &BTreeMap<String, String>) {
    let path = pin_file(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut text = String::new();
    for line in header.lines() {
        text.push_str(&format!("# {line}\n"));
    }
    for (k, v) in pins {
        text.push_str(&format!("{k}: {v}\n"));
    }
    std::fs::write(&path, text).unwrap();
    eprintln!("wrote {} pins to {}", pins.len(), path.display());
}

fn writing() -> bool {
    std::env::var(WRITE_ENV).is_ok_and(|v| v == "1")
}

/// Compares `got` (every case of `name`'s prefix `scope`, "" for all) with the committed pins of
/// that scope, or writes them (keeping the file's other scopes) under `SPECRS_WRITE_PINS=1`.
/// `how` says how to generate missing pins (the command), for the failure message.
pub fn check(name: &str, header: &str, scope: &str, got: &BTreeMap<String, String>, how: &str) {
    assert!(!got.is_empty(), "no cases computed for {name} {scope}");
    assert!(got.keys().all(|k| k.starts_with(scope)), "a case outside scope {scope:?}");
    let mut all = read(name);
    if writing() {
        all.retain(|k, _| !k.starts_with(scope));
        all.extend(got.iter().map(|(k, v)| (k.clone(), v.clone())));
        write(name, header, &all);
        return;
    }
    let expected: BTreeMap<&String, &String> = all.iter().filter(|(k, _)| k.starts_with(scope)).collect();
    assert!(
        !expected.is_empty(),
        "no pin for {scope:?} in {}: generate it with `{how}` (on code that is known good), review the diff and \
         commit it",
        pin_file(name).display()
    );
    let mut problems = Vec::new();
    for (k, v) in got {
        match expected.get(k) {
            None => problems.push(format!("{k}: not pinned (got {v})")),
            Some(e) if *e != v => problems.push(format!("{k}: pinned {e}, got {v}")),
            Some(_) => {}
        }
    }
    for k in expected.keys().filter(|k| !got.contains_key(**k)) {
        problems.push(format!("{k}: pinned but no longer computed"));
    }
    let shown: Vec<&String> = problems.iter().take(20).collect();
    assert!(
        problems.is_empty(),
        "{} of {} pinned cases of {} changed (first {}):\n{}\n(if the change is intended, regenerate with `{how}` \
         and say why in the commit)",
        problems.len(),
        got.len(),
        pin_file(name).display(),
        shown.len(),
        shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
}
