"""Training conversations written by the target itself (Magpie-style self-instruct; Xu et al. 2024),
for heads trained by self-distillation: nothing downloaded, no benchmark prompt, every response the
target's own.

Recipe (deterministic given the model, the seeds and the counts; `RECIPE` is stored beside the
data so anyone can regenerate it):
1. A user turn. The chat template is rendered up to the user's text, optionally followed by one of
   `OPENINGS` (a few words written here that steer the turn toward a task type: code, math,
   summaries, translation, questions, lists); the model writes the rest of the turn, sampled
   (temperature 1.0, top_p 0.95, seed = the conversation's index), stopping at its end-of-turn.
2. Long contexts. For `long` turns (summaries and questions over a passage) the model first writes
   a passage of 200-500 tokens on a topic it picked itself, and the user turn is the opening plus
   that passage, so prompt lengths reach those of summarization and RAG traffic.
   A model without a chat template (Gemma 3 270M ships as a base model) writes its "turn" as a plain
   continuation of the opening, and answers the turn followed by a blank line.
3. The answer: the target's response to the user turn through the chat template, greedy for even
   indices and sampled at temperature 0.7 for odd ones, up to `max_answer_tokens`.
Conversations are generated in batches with continuous batching (`Engine.generate([...])`) and
appended to `conversations.jsonl` (one JSON object per line: index, opening, prompt_ids,
response_ids), so a run can be stopped and resumed: it starts after the last index written.

Invariant: the file holds prompt and response token ids exactly as the target would see and write
them; a conversation whose user turn came out empty is skipped (recorded as skipped, not retried).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..engine import Engine, SamplingParams
from ..errors import ConfigError

# Beginnings of user turns, written for this recipe; "" lets the model choose freely (pure Magpie).
# "long" openings get a model-written passage appended (step 2 of the recipe).
OPENINGS: list[tuple[str, bool]] = [
    ("", False),
    ("", False),
    ("Write a Python function that", False),
    ("Explain", False),
    ("How do I", False),
    ("What is the difference between", False),
    ("Solve this math problem step by step:", False),
    ("Translate into French:", False),
    ("Give me a list of", False),
    ("Write a short story about", False),
    ("Summarize the following text:\n\n", True),
    ("Read the passage and answer the question at the end.\n\n", True),
]

RECIPE = {
    "name": "specrs-selfinstruct-v1",
    "user_turn": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 96, "seed": "index"},
    "passage": {"temperature": 0.8, "top_p": 0.95, "max_tokens": 400, "seed": "index + 1_000_000"},
    "answer": {"even_index": "greedy", "odd_index": {"temperature": 0.7, "seed": "index + 2_000_000"}},
    "openings": OPENINGS,
}


def _user_prefix(engine: Engine) -> str | None:
    """The chat template rendered up to where the user's text begins; None for a model without a
    chat template (a base model such as Gemma 3 270M: turns and answers are then plain text)."""
    marker = "\x00USER\x00"
    try:
        rendered = engine._inner.render_chat([("user", marker)])
    except ConfigError:
        return None
    return rendered[: rendered.index(marker)]


def _as_prompt(engine: Engine, user_text: str, chat: bool) -> list[int]:
    """The answer's prompt: the user turn through the chat template, or the plain text and a blank
    line for a base model."""
    if chat:
        return engine.prompt_token_ids([{"role": "user", "content": user_text}])
    return engine.tokenizer.encode(user_text + "\n\n")


def _batch(engine: Engine, start: int, count: int, max_answer_tokens: int) -> list[dict]:
    prefix = _user_prefix(engine)
    chat = prefix is not None
    prefix = prefix or ""
    indices = list(range(start, start + count))
    openings = [OPENINGS[i % len(OPENINGS)] for i in indices]

    # Passages for the long turns: the model writes about a topic of its own choosing.
    passages: dict[int, str] = {}
    long_indices = [i for i, (_, long) in zip(indices, openings) if long]
    if long_indices:
        ask = "Write a detailed article of several paragraphs about a topic of your choice."
        asks = [_as_prompt(engine, ask, chat) for _ in long_indices]
        params = [SamplingParams(max_tokens=400, temperature=0.8, top_p=0.95, seed=1_000_000 + i) for i in long_indices]
        for i, out in zip(long_indices, engine.generate(asks, params, speculative_config=False, progress=False)):
            passages[i] = out.text.strip()

    # User turns, written by the model after the template's user prefix (and the opening).
    heads = []
    for i, (opening, long) in zip(indices, openings):
        text = opening + passages.get(i, "") + ("\n\n" if long else "")
        heads.append(engine.tokenizer.encode(prefix + text))
    params = [SamplingParams(max_tokens=96, temperature=1.0, top_p=0.95, seed=i) for i in indices]
    turns = engine.generate(heads, params, speculative_config=False, progress=False)
    users = []
    for i, (opening, long), turn in zip(indices, openings, turns):
        # The model continues the opening ("Explain" + " how ..."): keep its leading space there.
        written = turn.text.rstrip() if opening else turn.text.strip()
        users.append(None if not written.strip() else opening + passages.get(i, "") + ("\n\n" if long else "")
                     + written)

    # Answers by the target through its chat template.
    live = [(i, u) for i, u in zip(indices, users) if u is not None]
    prompts = [_as_prompt(engine, u, chat) for _, u in live]
    params = [SamplingParams(max_tokens=max_answer_tokens, temperature=0.0) if i % 2 == 0 else
              SamplingParams(max_tokens=max_answer_tokens, temperature=0.7, seed=2_000_000 + i) for i, _ in live]
    answers = engine.generate(prompts, params, speculative_config=False, progress=False)
    by_index = {i: (p, a) for (i, _), p, a in zip(live, prompts, answers)}
    rows = []
    for i, (opening, _) in zip(indices, openings):
        if i not in by_index:
            rows.append({"index": i, "opening": opening, "skipped": "empty user turn"})
            continue
        prompt_ids, answer = by_index[i]
        rows.append({"index": i, "opening": opening, "prompt_ids": prompt_ids, "response_ids": answer.token_ids,
                     "finish_reason": answer.finish_reason})
    return rows


def next_index(path: str) -> int:
    """The index after the last conversation written to `path` (0 for a new file)."""
    if not os.path.exists(path):
        return 0
    last = -1
    with open(path) as f:
        for line in f:
            if line.strip():
                last = json.loads(line)["index"]
    return last + 1


def generate(engine: Engine, out_dir: str, num_conversations: int, batch_size: int = 16,
             max_answer_tokens: int = 384, log=sys.stderr) -> dict:
    """Appends conversations to `out_dir/conversations.jsonl` until it holds `num_conversations`;
    returns counts and timings. The recipe goes to `out_dir/recipe.json`."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "recipe.json"), "w") as f:
        json.dump({**RECIPE, "model": engine.model_path, "max_answer_tokens": max_answer_tokens}, f, indent=1)
    path = os.path.join(out_dir, "conversations.jsonl")
    start = next_index(path)
    t0 = time.perf_counter()
    num_tokens = 0
    while start < num_conversations:
        count = min(batch_size, num_conversations - start)
        rows = _batch(engine, start, count, max_answer_tokens)
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        num_tokens += sum(len(r.get("prompt_ids", [])) + len(r.get("response_ids", [])) for r in rows)
        start += count
        elapsed = time.perf_counter() - t0
        print(f"selfinstruct: {start}/{num_conversations} conversations, {num_tokens} tokens this run, "
              f"{elapsed:.0f} s", file=log, flush=True)
    return {"num_conversations": start, "tokens_this_run": num_tokens, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specrs train-head data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path or named model (default SmolLM2-135M-Instruct)")
    parser.add_argument("--out", required=True, help="directory for conversations.jsonl and recipe.json")
    parser.add_argument("--num-conversations", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-answer-tokens", type=int, default=384)
    args = parser.parse_args(argv)
    engine = Engine(args.model)
    print(json.dumps(generate(engine, args.out, args.num_conversations, args.batch_size, args.max_answer_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
