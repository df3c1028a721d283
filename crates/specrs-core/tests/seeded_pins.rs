//! Pins of today's seeded end-to-end outputs: the exact token ids SmolLM2 generates on the CPU
//! backend at temperature 0.8, top_p 0.95, seeds 3 and 4, without speculation, with ngram, suffix,
//! ngram drafting trees, and a layer-skip draft model (rejection sampling with draft probabilities;
//! its costs are pinned in its config so its draft lengths do not depend on timing), and of one
//! `Scheduler` run with two requests. The same layer-skip draft in coupled form (the default) is
//! not pinned: its tokens must be plain sampling's ("off"), at any draft lengths. The identity
//! tests (continuous_batching.rs, scheduler.rs) compare two runs of one build; these compare a
//! build with the code the pins were made by, so a refactor of the verifier, the step driver or
//! the KV store must keep every token.
//!
//! Invariant: the tokens depend on the CPU kernel set (see forward_pins.rs), so pins are keyed by
//! the set that made them and a set without pins fails. Pins live in
//! tests/golden/pins/seeded_pins.txt; generate or regenerate (only for an intended change, saying
//! why in the commit) the running set's with
//! `SPECRS_WRITE_PINS=1 cargo test --release -p specrs-core --test integration seeded_pins::`;
//! on a VNNI machine add `SPECRS_CPU_KERNELS=avx2` to generate the AVX2 set's too.

use std::collections::BTreeMap;
use std::sync::Arc;

use specrs_core::{Engine, SamplingParams, Scheduler, SchedulerConfig, Speculation, SpeculativeConfig};

use crate::common;
use crate::common::pins;

const PIN_FILE: &str = "seeded_pins.txt";
const HEADER: &str = "seeded_pins.rs: today's seeded SmolLM2 token ids per CPU kernel set.\n\
    Regenerate the running set: SPECRS_WRITE_PINS=1 cargo test --release -p specrs-core --test integration seeded_pins::\n\
    (SPECRS_CPU_KERNELS=avx2 selects the AVX2 set on a VNNI machine)";

/// Repetitive enough that n-gram and suffix drafts are proposed and partly accepted.
const PROMPT: &str = "Speculative decoding verifies a draft in one forward pass. Speculative decoding verifies a \
    draft in one forward pass. Speculative decoding";
const MAX_TOKENS: usize = 24;
const SEEDS: [u64; 2] = [3, 4];

/// Each drafting config pins the costs its adaptive draft length weighs, so no draft length
/// depends on a timing (the layer-skip draft's tokens depend on its lengths).
const METHODS: [(&str, Option<&str>); 5] = [
    ("off", None),
    (
        "ngram",
        Some(r#"{"method": "ngram", "num_speculative_tokens": 4, "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3, 1.4]}"#),
    ),
    (
        "suffix",
        Some(
            r#"{"method": "suffix", "num_speculative_tokens": 5, "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]}"#,
        ),
    ),
    (
        "ngram_tree",
        Some(r#"{"method": "ngram", "num_speculative_tokens": 6, "tree": true, "adaptive_draft_length": false}"#),
    ),
    (
        "layer_skip",
        Some(
            r#"{"method": "layer_skip", "num_speculative_tokens": 3, "exit_layer": 20, "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3], "draft_cost": 0.1, "verification": "rejection"}"#,
        ),
    ),
];

/// Coupled layer-skip drafts at a fixed length and at lengths chosen by costs (the rejection
/// config's): each must emit plain sampling's tokens.
const COUPLED: [&str; 2] = [
    r#"{"method": "layer_skip", "num_speculative_tokens": 4, "exit_layer": 20, "adaptive_draft_length": false}"#,
    r#"{"method": "layer_skip", "num_speculative_tokens": 3, "exit_layer": 20, "verify_cost_ratios": [1.0, 1.1, 1.2, 1.3], "draft_cost": 0.1}"#,
];

fn params(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_p: 0.95, seed: Some(seed), ..SamplingParams::greedy(MAX_TOKENS) }
}

fn speculation(engine: &Engine, config: Option<&str>) -> Option<Speculation> {
    config.map(|c| engine.speculation(&SpeculativeConfig::from_json(c).unwrap(), None).unwrap())
}

/// SmolLM2 with every method prepared and nothing measured later.
fn load() -> Arc<Engine> {
    let engine = Engine::load(common::smollm2_path(), "cpu").unwrap();
    for (_, config) in METHODS {
        if let Some(config) = config {
            engine.prepare(&SpeculativeConfig::from_json(config).unwrap()).unwrap();
        }
    }
    assert!(engine.wait_for_costs(None), "the background thread measured what prepare queued");
    engine.set_measure_on_demand(false);
    Arc::new(engine)
}

#[test]
fn seeded_outputs_equal_the_pinned_ones_of_this_kernel_set() {
    let set = pins::kernel_set();
    let engine = load();
    let prompt = engine.tokenizer().encode(PROMPT, true).unwrap();
    let mut got = BTreeMap::new();
    for (name, config) in METHODS {
        for seed in SEEDS {
            let generation = engine.generate(prompt.clone(), params(seed), speculation(&engine, config)).unwrap();
            got.insert(format!("{set}/{name}/seed{seed}"), format!("{:?}", generation.token_ids));
        }
    }
    let mut num_coupled_accepted = 0;
    for config in COUPLED {
        for seed in SEEDS {
            let generation = engine.generate(prompt.clone(), params(seed), speculation(&engine, Some(config))).unwrap();
            assert!(generation.metrics.spec.num_drafts > 0, "{config} seed {seed} drafted");
            num_coupled_accepted += generation.metrics.spec.num_accepted_tokens;
            assert_eq!(
                format!("{:?}", generation.token_ids),
                got[&format!("{set}/off/seed{seed}")],
                "{config} seed {seed}: coupled drafts emit plain sampling's tokens"
            );
        }
    }
    assert!(num_coupled_accepted > 0, "coupled layer-skip drafts agree with the target at times");
    // One scheduler run: request 0 drafts with ngram (seed 3), request 1 decodes plainly (seed 4)
    // from another prompt, batched together.
    let mut scheduler = Scheduler::new(engine.clone(), SchedulerConfig::default()).unwrap();
    let other = engine.tokenizer().encode("List three colors: red, green,", true).unwrap();
    scheduler.add(0, prompt.clone(), params(SEEDS[0]), speculation(&engine, METHODS[1].1)).unwrap();
    scheduler.add(1, other, params(SEEDS[1]), None).unwrap();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(), Vec::new()];
    let mut steps = 0;
    while scheduler.has_unfinished() {
        let (outputs, _) = scheduler.step().unwrap();
        for o in outputs {
            assert!(o.error.is_none(), "request {} failed: {:?}", o.id, o.error);
            tokens[o.id as usize].extend(&o.token_ids);
        }
        steps += 1;
        assert!(steps < 1000, "the scheduler does not finish");
    }
    for (id, t) in tokens.iter().enumerate() {
        got.insert(format!("{set}/scheduler/request{id}"), format!("{t:?}"));
    }
    let how = format!(
        "SPECRS_WRITE_PINS=1{} cargo test --release -p specrs-core --test integration seeded_pins::",
        if set == "avx2" { " SPECRS_CPU_KERNELS=avx2" } else { "" }
    );
    pins::check(PIN_FILE, HEADER, &format!("{set}/"), &got, &how);
}
