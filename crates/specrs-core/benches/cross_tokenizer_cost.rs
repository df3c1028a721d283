//! The tokenizer work of a cross-tokenizer draft per step, at growing contexts:
//! `SPECRS_SMOLLM2_GGUF=... SPECRS_GEMMA3_GGUF=... cargo bench -p specrs-core --bench cross_tokenizer_cost`.
//!
//! A step grows the context by 1 to 5 target tokens (as accepted drafts grow it), turns the context
//! into the draft's ids, and turns a 5-token draft continuation back into target tokens. "kept" is
//! the proposer's path (`DraftEncoding`, windowed decodes: O(new tokens)); "whole" is a stateless
//! reference that decodes and encodes the whole context each step, as the proposer did before.
//! Both must give the same target tokens at every step. Text: Rust sources of this crate (code,
//! long contexts), in Gemma 3's tokens, drafted by SmolLM2's tokenizer, and the other way round.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use specrs_core::gguf::GgufFile;
use specrs_core::proposer::cross_tokenizer::{drafted_target_tokens, encode_whole, DraftEncoding};
use specrs_core::tokenizer::TextTokenizer;

const CONTEXT_LENGTHS: [usize; 3] = [500, 1500, 4000];
const STEPS: usize = 200;
const RUNS: usize = 5;
/// Draft tokens per step (k = 4 plus the one the boundary rule drops).
const DRAFTED: usize = 5;

fn tokenizer(variable: &str) -> Arc<TextTokenizer> {
    let path = std::env::var(variable).unwrap_or_else(|_| panic!("set {variable} to the GGUF's path"));
    Arc::new(TextTokenizer::from_gguf(&GgufFile::open(path).expect("open the GGUF")).expect("its tokenizer"))
}

/// The stateless reference: whole-context decodes and encode each step.
fn whole_step(target: &TextTokenizer, draft: &TextTokenizer, context: &[u32], drafted: &[u32]) -> Vec<u32> {
    let draft_context = encode_whole(target, draft, context).unwrap();
    let before = draft.decode(&draft_context, false).unwrap();
    let all = draft.decode(&[&draft_context[..], drafted].concat(), false).unwrap();
    let Some(continuation) = all.strip_prefix(&before) else { return Vec::new() };
    let continuation = continuation.trim_end_matches('\u{FFFD}');
    if continuation.is_empty() {
        return Vec::new();
    }
    let cut = context.len() - 4.min(context.len());
    let text = target.decode(context, false).unwrap();
    let before = target.decode(&context[..cut], false).unwrap();
    let Some(window_text) = text.strip_prefix(&before) else { return Vec::new() };
    let ids = target.encode(&format!("{window_text}{continuation}"), false).unwrap();
    if ids.len() <= context.len() - cut || ids[..context.len() - cut] != context[cut..] {
        return Vec::new();
    }
    let mut new = ids[context.len() - cut..].to_vec();
    new.pop();
    while new.last().is_some_and(|&last| target.decode(&[last], false).unwrap().chars().all(char::is_whitespace)) {
        new.pop();
    }
    new
}

/// The proposer's path for one step: the context's draft ids from what `encoding` kept, then the
/// target tokens the draft's continuation determines.
fn kept_step(
    encoding: &mut DraftEncoding,
    target: &TextTokenizer,
    draft: &TextTokenizer,
    context: &[u32],
    drafted: &[u32],
) -> Vec<u32> {
    let draft_context = encoding.update(context).unwrap();
    drafted_target_tokens(target, draft, context, &draft_context, drafted).unwrap()
}

/// Context lengths of the steps from `start` (1 to 5 tokens a step) and each step's draft: the
/// draft's ids of the next target tokens' text, as a draft that agrees with the target writes.
fn steps(target: &TextTokenizer, draft: &TextTokenizer, body: &[u32], start: usize) -> Vec<(usize, Vec<u32>)> {
    let mut len = start;
    (0..STEPS)
        .map(|i| {
            len += i % 5 + 1;
            let next = target.decode(&body[len..len + 8], false).unwrap();
            let drafted = draft.encode(&next, false).unwrap().into_iter().take(DRAFTED).collect();
            (len, drafted)
        })
        .collect()
}

/// Median and spread (min, max) over `RUNS` of the mean time per step, in microseconds.
fn time_steps(mut run: impl FnMut() -> usize) -> (f64, f64, f64) {
    let mut times: Vec<f64> = (0..RUNS)
        .map(|_| {
            let timer = Instant::now();
            black_box(run());
            timer.elapsed().as_secs_f64() * 1e6 / STEPS as f64
        })
        .collect();
    times.sort_by(f64::total_cmp);
    (times[RUNS / 2], times[0], times[RUNS - 1])
}

fn main() {
    let smollm2 = tokenizer("SPECRS_SMOLLM2_GGUF");
    let gemma3 = tokenizer("SPECRS_GEMMA3_GGUF");
    let text = [
        include_str!("../src/engine/mod.rs"),
        include_str!("../src/proposer/draft_model.rs"),
        include_str!("../src/proposer/cross_tokenizer.rs"),
        include_str!("../src/tokenizer.rs"),
    ]
    .concat();
    println!("cross_tokenizer_cost: {STEPS} steps of 1-5 new target tokens, {DRAFTED} draft tokens each; median of {RUNS} runs (min-max)");
    println!(
        "{:>30} | {:>7} | {:>22} | {:>22} | {:>7}",
        "target <- draft", "context", "kept us/step", "whole us/step", "ratio"
    );
    for (target, draft, name) in [(&gemma3, &smollm2, "Gemma 3 <- SmolLM2"), (&smollm2, &gemma3, "SmolLM2 <- Gemma 3")]
    {
        let body = target.encode(&text, false).unwrap();
        for start in CONTEXT_LENGTHS {
            assert!(start + 6 * STEPS + 8 <= body.len(), "the text is too short for {start} tokens");
            let plan = steps(target, draft, &body, start);
            // Both paths draft the same target tokens at every step.
            let mut encoding = DraftEncoding::new(target.clone(), draft.clone());
            kept_step(&mut encoding, target, draft, &body[..start], &[]);
            let mut drafting_steps = 0;
            for (len, drafted) in &plan {
                let kept = kept_step(&mut encoding, target, draft, &body[..*len], drafted);
                assert_eq!(kept, whole_step(target, draft, &body[..*len], drafted), "{name}: step at {len} tokens");
                drafting_steps += usize::from(!kept.is_empty());
            }
            assert!(drafting_steps * 2 > STEPS, "{name}: only {drafting_steps} of {STEPS} steps drafted");
            let kept = time_steps(|| {
                let mut encoding = DraftEncoding::new(target.clone(), draft.clone());
                encoding.update(&body[..start]).unwrap();
                plan.iter()
                    .map(|(len, drafted)| kept_step(&mut encoding, target, draft, &body[..*len], drafted).len())
                    .sum()
            });
            let whole = time_steps(|| {
                plan.iter().map(|(len, drafted)| whole_step(target, draft, &body[..*len], drafted).len()).sum()
            });
            println!(
                "{name:>30} | {start:>7} | {:>8.1} ({:>5.1}-{:>5.1}) | {:>8.1} ({:>5.1}-{:>5.1}) | {:>6.0}x",
                kept.0,
                kept.1,
                kept.2,
                whole.0,
                whole.1,
                whole.2,
                whole.0 / kept.0
            );
        }
    }
}
