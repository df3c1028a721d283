"""Teacher-forced target features for head training, cached on disk so training never re-runs the
target: for every conversation of `conversations.jsonl` (selfinstruct.py), the target's residual
stream at EAGLE-3's three tapped layers (2, L // 2, L - 3: EAGLE-3's and vLLM's defaults) and its
final-normed hidden state (what its LM head reads: the target distribution is recomputed from it
in training), over prompt + response, from `Engine.hidden_states` (one forward per conversation).

Layout of `out_dir`: `shard-NNNNN.npz` with `tokens` `[n]` int32, `loss_mask` `[n]` bool (True on
response positions: the positions whose next token the head learns), `conversation_ends` `[c]`
int64 (exclusive end of each conversation in the shard), `conversation_lines` `[c]` int64 (its
line in the conversations file: the held-out split is by line, see loop.split), `taps`
`[n, 3, hidden]` and `final` `[n, hidden]`, float16 (float32 in a shard where a value does not fit,
see `compact`); `index.json` lists the shards and the layers. A shard is written whole (temporary
file, then rename), so a stopped run resumes after the last complete shard.

Invariant: row i of every array describes position i of its conversation, read by the target with
exactly the tokens the conversation holds (no truncation inside a conversation; conversations
longer than `max_len` are skipped and counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from ..engine import Engine


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default tapped layers for a target of `num_layers` blocks."""
    return [2, num_layers // 2, num_layers - 3]


def compact(x: np.ndarray) -> np.ndarray:
    """float16 when every value fits (half the disk), else float32: Gemma 3's residual stream
    reaches past float16's 65504. A shard mixing both is stored float32 (np.concatenate)."""
    return x.astype(np.float16) if np.abs(x).max(initial=0.0) < 65504.0 else x.astype(np.float32)


def conversations(path: str):
    """The conversations of a conversations.jsonl (self-instruct) or traffic.jsonl (a recording), in
    order: their position here is the line the held-out split reads (`split`)."""
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "prompt_ids" in row:
                yield row


def extract(engine: Engine, conversations_path: str, out_dir: str, shard_tokens: int = 65536,
            max_len: int = 2048, log=sys.stderr) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    layers = eagle3_layers(engine.info()["num_layers"])
    index_path = os.path.join(out_dir, "index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else {
        "layers": layers, "shards": [], "num_conversations": 0, "num_tokens": 0, "skipped_too_long": 0}
    done = index["num_conversations"] + index["skipped_too_long"]
    t0 = time.perf_counter()
    buffer: list[dict] = []
    buffered_tokens = 0

    def flush() -> None:
        nonlocal buffer, buffered_tokens
        if not buffer:
            return
        name = f"shard-{len(index['shards']):05d}.npz"
        tmp = os.path.join(out_dir, name + ".tmp.npz")
        np.savez(tmp,
                 tokens=np.concatenate([b["tokens"] for b in buffer]).astype(np.int32),
                 loss_mask=np.concatenate([b["loss_mask"] for b in buffer]),
                 conversation_ends=np.cumsum([len(b["tokens"]) for b in buffer]).astype(np.int64),
                 conversation_lines=np.asarray([b["line"] for b in buffer], dtype=np.int64),
                 taps=np.concatenate([b["taps"] for b in buffer]),
                 final=np.concatenate([b["final"] for b in buffer]))
        os.replace(tmp, os.path.join(out_dir, name))
        index["shards"].append(name)
        index["num_conversations"] += len(buffer)
        index["num_tokens"] += buffered_tokens
        with open(index_path + ".tmp", "w") as f:
            json.dump(index, f, indent=1)
        os.replace(index_path + ".tmp", index_path)
        print(f"features: {index['num_conversations']} conversations, {index['num_tokens']} tokens, "
              f"{time.perf_counter() - t0:.0f} s", file=log, flush=True)
        buffer, buffered_tokens = [], 0

    for i, row in enumerate(conversations(conversations_path)):
        if i < done:
            continue
        ids = row["prompt_ids"] + row["response_ids"]
        if len(ids) > max_len:
            index["skipped_too_long"] += 1
            continue
        *taps, final = engine.hidden_states(ids, layers=[*layers, "final_norm"])
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(row["prompt_ids"]) - 1 : len(ids) - 1] = True  # positions predicting a response token
        buffer.append({"tokens": np.asarray(ids), "loss_mask": mask, "line": i,
                       "taps": compact(np.stack(taps, axis=1)), "final": compact(final)})
        buffered_tokens += len(ids)
        if buffered_tokens >= shard_tokens:
            flush()
    flush()
    return index


class Shards:
    """Conversations of the feature cache: (tokens, loss_mask, taps, final) numpy arrays each."""

    def __init__(self, feature_dir: str):
        self.dir = feature_dir
        self.index = json.load(open(os.path.join(feature_dir, "index.json")))
        self.items: list[tuple[str, int, int]] = []  # (shard, start, end) of each conversation
        self.lines: list[int] = []  # each conversation's line in the conversations file it came from
        for name in self.index["shards"]:
            shard = np.load(os.path.join(feature_dir, name))
            ends = shard["conversation_ends"]
            starts = np.concatenate([[0], ends[:-1]])
            self.items += [(name, int(s), int(e)) for s, e in zip(starts, ends)]
            # Caches written before lines were stored skipped no conversation: their order is the line.
            self.lines += (shard["conversation_lines"].tolist() if "conversation_lines" in shard.files
                           else list(range(len(self.lines), len(self.lines) + len(ends))))
        self._cache: dict[str, dict] = {}

    def get(self, i: int) -> tuple[np.ndarray, ...]:
        name, s, e = self.items[i]
        if name not in self._cache:
            if len(self._cache) > 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[name] = dict(np.load(os.path.join(self.dir, name)))
        d = self._cache[name]
        return d["tokens"][s:e], d["loss_mask"][s:e], d["taps"][s:e], d["final"][s:e]

    def order(self, ids: list[int], rng: np.random.Generator) -> list[int]:
        """`ids` shuffled shard by shard (shards in random order, conversations shuffled within each):
        a shard is read once per pass instead of once per step (a shard is hundreds of MB)."""
        by_shard: dict[str, list[int]] = {}
        for i in ids:
            by_shard.setdefault(self.items[i][0], []).append(i)
        out: list[int] = []
        for name in rng.permutation(sorted(by_shard)):
            out += [by_shard[name][k] for k in rng.permutation(len(by_shard[name]))]
        return out

    def token_counts(self, vocab: int) -> np.ndarray:
        counts = np.zeros(vocab, dtype=np.int64)
        for name in self.index["shards"]:
            d = np.load(os.path.join(self.dir, name))
            np.add.at(counts, d["tokens"][np.roll(d["loss_mask"], 1)], 1)
        return counts


def split(lines: list[int], held_out: float) -> tuple[list[int], list[int]]:
    """(train, held-out) positions of conversations whose lines in their conversations file are
    `lines`: every k-th line (k = round(1 / held_out)) is held out, so `specrs advise --held-out`
    picks the same requests from a traffic recording. With held_out 0 nothing is held out."""
    every = held_out_every(held_out)
    if every is None:
        return list(range(len(lines))), []
    return ([k for k, line in enumerate(lines) if line % every != 0],
            [k for k, line in enumerate(lines) if line % every == 0])


def held_out_every(held_out: float) -> int | None:
    """Line i of a conversations file is held out when i % every == 0 (None: nothing held out)."""
    if not 0 <= held_out < 1:
        raise SystemExit(f"--held-out must be in [0, 1) (got {held_out})")
    return None if held_out == 0 else max(2, round(1 / held_out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specrs train-head features", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", required=True, help="conversations.jsonl from specrs.train.selfinstruct")
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard-tokens", type=int, default=65536)
    parser.add_argument("--max-len", type=int, default=2048)
    args = parser.parse_args(argv)
    index = extract(Engine(args.model), args.conversations, args.out, args.shard_tokens, args.max_len)
    print(json.dumps({k: v for k, v in index.items() if k != "shards"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
