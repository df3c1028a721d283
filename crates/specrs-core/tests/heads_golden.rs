//! Every hidden-state head against its reference implementation, on tiny targets of several
//! families: `scripts/make_head_golden.py` writes each head in its published format beside the
//! draft tokens and logits the defining library (or an independent torch implementation, where
//! none installs) computes for it (`tests/golden/heads/<case>/reference.json`); specrs loads the
//! same files, drafts greedily from the same prompt, and must give the same tokens and the same
//! logits at every draft step within `TOLERANCE`.
//!
//! Block drafters (DFlash) also carry the reference's block logits at two later steps of the same
//! request (`later_steps`: the context grown by accepted drafts and a target token), where the
//! head's cache must carry the earlier context.
//!
//! Then the losslessness every head must keep: greedy speculative decoding with each head, at
//! several k and several requests stepped together, gives plain greedy decoding's tokens.

use std::path::{Path, PathBuf};

use serde_json::Value;
use specrs_core::engine::Speculation;
use specrs_core::{step_together, Engine, SamplingParams, SpeculativeConfig};

/// Largest allowed |specrs - reference| over a step's logits, relative to that step's largest
/// |reference logit| (at least 1). Both sides compute the head in f32, so for f32 targets the
/// differences are summation order (measured up to about 1e-6: see the test's output).
/// (The tiny Qwen2 is stored in bf16; its heads' cases use an f32 copy, so both sides read the
/// same hidden states.)
const TOLERANCE: f32 = 1e-4;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Case {
    name: String,
    method: String,
    target: PathBuf,
    model: Option<PathBuf>,
    prompt_ids: Vec<u32>,
    draft_token_ids: Vec<u32>,
    /// `[steps][vocab]`, None outside a draft vocabulary.
    logits: Vec<Vec<Option<f32>>>,
    /// Later steps of the same request: context, draft tokens, logits.
    later_steps: Vec<(Vec<u32>, Vec<u32>, Vec<Vec<Option<f32>>>)>,
    /// DSpark's confidence head: each drafted row's confidence at the first step.
    confidences: Vec<f32>,
}

fn u32_list(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn logit_rows(v: &Value) -> Vec<Vec<Option<f32>>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().map(|f| f as f32)).collect())
        .collect()
}

fn cases() -> Vec<Case> {
    let dir = repo_root().join("tests/golden/heads");
    let mut cases: Vec<Case> = std::fs::read_dir(&dir)
        .expect("tests/golden/heads exists (scripts/make_head_golden.py writes it)")
        .filter_map(|e| e.ok().map(|e| e.path().join("reference.json")))
        .filter(|p| p.exists())
        .map(|path| {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            Case {
                name: v["case"].as_str().unwrap().to_string(),
                method: v["method"].as_str().unwrap().to_string(),
                target: repo_root().join(v["target"].as_str().unwrap()),
                model: v["model"].as_str().map(|m| repo_root().join(m)),
                prompt_ids: u32_list(&v["prompt_ids"]),
                draft_token_ids: u32_list(&v["draft_token_ids"]),
                logits: logit_rows(&v["logits"]),
                later_steps: v["later_steps"]
                    .as_array()
                    .map(|steps| {
                        steps
                            .iter()
                            .map(|s| {
                                (u32_list(&s["context_ids"]), u32_list(&s["draft_token_ids"]), logit_rows(&s["logits"]))
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                confidences: v["confidences"]
                    .as_array()
                    .map(|c| c.iter().map(|x| x.as_f64().unwrap() as f32).collect())
                    .unwrap_or_default(),
            }
        })
        .collect();
    cases.sort_by(|a, b| a.name.cmp(&b.name));
    cases
}

fn config(case: &Case, k: usize) -> SpeculativeConfig {
    config_with(case, k, serde_json::json!({}))
}

fn config_with(case: &Case, k: usize, extra: Value) -> SpeculativeConfig {
    let mut json =
        serde_json::json!({"method": case.method, "num_speculative_tokens": k, "adaptive_draft_length": false});
    if let Some(model) = &case.model {
        json["model"] = model.display().to_string().into();
    }
    json.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    SpeculativeConfig::from_json(&json.to_string()).unwrap()
}

/// Largest |logit - reference| over a draft's steps, relative to each step's largest |reference|.
fn max_relative_difference(logits: &[Vec<f32>], reference: &[Vec<Option<f32>>]) -> f32 {
    let mut worst = 0.0f32;
    for (ours, reference) in logits.iter().zip(reference) {
        let scale = reference.iter().flatten().fold(1.0f32, |m, x| m.max(x.abs()));
        for (&a, b) in ours.iter().zip(reference) {
            match b {
                Some(b) => worst = worst.max((a - b).abs() / scale),
                // Outside a draft vocabulary: exactly -inf, or the difference is infinite.
                None if a != f32::NEG_INFINITY => worst = f32::INFINITY,
                None => {}
            }
        }
    }
    worst
}

#[test]
fn every_head_drafts_the_reference_logits() {
    let cases = cases();
    let methods: std::collections::BTreeSet<&str> = cases.iter().map(|c| c.method.as_str()).collect();
    assert_eq!(
        methods.into_iter().collect::<Vec<_>>(),
        ["dflash", "dspark", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp"],
        "every head method has golden cases"
    );
    for case in &cases {
        let engine = Engine::load(&case.target, "cpu").unwrap();
        let steps = case.logits.len();
        let (tokens, logits) = engine
            .head_draft(&config(case, steps), &case.prompt_ids, steps)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(tokens, case.draft_token_ids, "{}: draft tokens", case.name);
        assert_eq!(logits.len(), steps, "{}", case.name);
        let worst = max_relative_difference(&logits, &case.logits);
        assert!(worst <= TOLERANCE, "{}: max relative logit difference {worst}", case.name);
        println!("{:<36} {:<15} {steps} steps, max relative logit difference {worst:.2e}", case.name, case.method);
    }
}

/// A block drafter's later steps: the same request's context grown twice, its cache carried over.
#[test]
fn block_drafters_draft_the_reference_logits_at_later_steps() {
    let cases: Vec<Case> = cases().into_iter().filter(|c| !c.later_steps.is_empty()).collect();
    assert!(cases.len() >= 2, "the DFlash cases carry later steps");
    for case in &cases {
        let engine = Engine::load(&case.target, "cpu").unwrap();
        let k = case.logits.len();
        let mut contexts = vec![case.prompt_ids.clone()];
        contexts.extend(case.later_steps.iter().map(|(context, _, _)| context.clone()));
        let steps = engine.head_draft_steps(&config(case, k), &contexts, k).unwrap();
        for (i, ((tokens, logits), (_, want_tokens, want_logits))) in
            steps[1..].iter().zip(&case.later_steps).enumerate()
        {
            assert_eq!(tokens, want_tokens, "{} step {}: draft tokens", case.name, i + 2);
            let worst = max_relative_difference(logits, want_logits);
            assert!(worst <= TOLERANCE, "{} step {}: max relative logit difference {worst}", case.name, i + 2);
            println!("{:<36} step {}: max relative logit difference {worst:.2e}", case.name, i + 2);
        }
    }
}

/// DSpark's confidence head ends a draft by its rule: the leading rows whose running product of
/// confidences reaches `draft_confidence_threshold`, at least one. Thresholds between the
/// reference's running products give every length from 1 to the whole block.
#[test]
fn the_dspark_confidence_head_cuts_drafts_where_the_running_product_falls_below_the_threshold() {
    let case = cases().into_iter().find(|c| !c.confidences.is_empty()).expect("the dspark case has confidences");
    let engine = Engine::load(&case.target, "cpu").unwrap();
    let products: Vec<f32> = case
        .confidences
        .iter()
        .scan(1.0f32, |p, &c| {
            *p *= c;
            Some(*p)
        })
        .collect();
    let k = case.logits.len();
    let mut lengths = Vec::new();
    for j in 0..=k {
        // Just below product j - 1 (keeps j rows) or, for j = 0, above the first (keeps one).
        let threshold = match j {
            0 => (products[0] * 1.5).min(0.999),
            _ => products[j - 1] * 0.999,
        };
        let config = config_with(&case, k, serde_json::json!({"draft_confidence_threshold": threshold}));
        let (tokens, _) = engine.head_draft(&config, &case.prompt_ids, k).unwrap();
        let want = products.iter().take_while(|&&p| p >= threshold).count().max(1);
        assert_eq!(tokens.len(), want, "threshold {threshold}: products {products:?}");
        assert_eq!(tokens, case.draft_token_ids[..want], "a cut draft is the whole draft's prefix");
        lengths.push(tokens.len());
    }
    println!("dspark: running confidence products {products:?}, draft lengths {lengths:?}");
}

/// `"quantization": "q8_0"` quantizes a head's linear weights at load: its first step's logits
/// stay within 3% of the f32 reference's largest logit (measured: see the output), 4% for a
/// DFlash block, whose every layer reads keys and values of the quantized `fc` output over the
/// whole context (measured 2.0-3.1%; a two-layer MTP head reaches 2.2%).
#[test]
fn q8_0_heads_stay_close_to_the_reference() {
    for case in cases() {
        let engine = Engine::load(&case.target, "cpu").unwrap();
        let quantized = config_with(&case, 1, serde_json::json!({"quantization": "q8_0"}));
        let (_, logits) = engine.head_draft(&quantized, &case.prompt_ids, 1).unwrap();
        let worst = max_relative_difference(&logits, &case.logits[..1]);
        println!("{:<36} q8_0: max relative logit difference {worst:.2e}", case.name);
        let bound = if case.method == "dflash" { 0.04 } else { 0.03 };
        assert!(worst < bound, "{}: {worst}", case.name);
    }
}

/// vLLM's `logit_scale` in a head's config multiplies its logits (EAGLE-3 and Medusa carry it).
#[test]
fn logit_scale_multiplies_the_heads_logits() {
    for name in ["eagle3_llama_speculators", "medusa_qwen2_vllm"] {
        let case = cases().into_iter().find(|c| c.name == name).unwrap();
        let src = case.model.clone().unwrap();
        let dir = std::env::temp_dir().join(format!("specrs-logit-scale-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "safetensors") {
                std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
            }
        }
        let mut head_config: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        head_config["logit_scale"] = 0.5.into();
        std::fs::write(dir.join("config.json"), head_config.to_string()).unwrap();
        let engine = Engine::load(&case.target, "cpu").unwrap();
        let scaled_case = Case { model: Some(dir.clone()), ..case };
        let (_, logits) = engine.head_draft(&config(&scaled_case, 1), &scaled_case.prompt_ids, 1).unwrap();
        let halved: Vec<Vec<Option<f32>>> =
            scaled_case.logits[..1].iter().map(|row| row.iter().map(|x| x.map(|v| v * 0.5)).collect()).collect();
        let worst = max_relative_difference(&logits, &halved);
        assert!(worst <= TOLERANCE, "{name}: {worst}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Greedy tokens of a request on `engine`, with `speculation` or without.
fn greedy(engine: &Engine, prompt: &[u32], speculation: Option<Speculation>) -> Vec<u32> {
    let params = SamplingParams { max_tokens: 24, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() };
    engine.generate(prompt.to_vec(), params, speculation).unwrap().token_ids
}

#[test]
fn greedy_speculation_with_every_head_is_plain_greedy_decoding() {
    for case in cases() {
        let engine = Engine::load(&case.target, "cpu").unwrap();
        let plain = greedy(&engine, &case.prompt_ids, None);
        // Parallel heads draft one token per sub-head, a block drafter its block.
        let max_k = if matches!(case.method.as_str(), "medusa" | "mlp_speculator" | "dflash" | "dspark") {
            case.logits.len()
        } else {
            5
        };
        for k in [1, max_k] {
            let speculation = engine.speculation(&config(&case, k), None).unwrap();
            let spec = greedy(&engine, &case.prompt_ids, Some(speculation));
            assert_eq!(spec, plain, "{} k={k}", case.name);
        }
        // Three requests stepped together (one forward per step) against each alone.
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| case.prompt_ids[i..].to_vec()).collect();
        let params = SamplingParams { max_tokens: 16, temperature: 0.0, ignore_eos: true, ..SamplingParams::default() };
        let mut sessions: Vec<_> = prompts
            .iter()
            .map(|p| {
                engine
                    .start(
                        p.clone(),
                        params.clone(),
                        Some(engine.speculation(&config(&case, 3.min(max_k)), None).unwrap()),
                    )
                    .unwrap()
            })
            .collect();
        while sessions.iter().any(|s| !s.is_finished()) {
            let mut refs: Vec<_> = sessions.iter_mut().collect();
            for result in step_together(&mut refs).unwrap() {
                result.unwrap();
            }
        }
        for (session, prompt) in sessions.iter().zip(&prompts) {
            let alone = engine.generate(prompt.clone(), params.clone(), None).unwrap().token_ids;
            assert_eq!(session.generated_ids(), alone.as_slice(), "{} batched", case.name);
        }
        // A prompt read in chunks of 4 hands the head every chunk's hidden rows.
        let speculation = engine.speculation(&config(&case, 3.min(max_k)), None).unwrap();
        let mut session = engine.start(case.prompt_ids.clone(), params.clone(), Some(speculation)).unwrap();
        session.set_prefill_chunk(Some(4)).unwrap();
        while !session.is_finished() {
            session.step().unwrap();
        }
        let alone = engine.generate(case.prompt_ids.clone(), params.clone(), None).unwrap().token_ids;
        assert_eq!(session.generated_ids(), alone.as_slice(), "{} chunked prefill", case.name);
    }
}
