"""Self-instruct training data (specrs.train.selfinstruct): conversations written by the target,
deterministic for a given model and count, resumable, and every response the target's own."""

from __future__ import annotations

import io
import json

from specrs import SamplingParams
from specrs.train import selfinstruct


def test_conversations_are_the_targets_own_and_a_run_resumes(engine, tmp_path):
    log = io.StringIO()
    selfinstruct.generate(engine, str(tmp_path / "a"), 3, batch_size=2, max_answer_tokens=12, log=log)
    selfinstruct.generate(engine, str(tmp_path / "a"), 5, batch_size=2, max_answer_tokens=12, log=log)
    rows = [json.loads(line) for line in open(tmp_path / "a" / "conversations.jsonl")]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]  # resumed after index 2, nothing repeated
    assert selfinstruct.next_index(str(tmp_path / "a" / "conversations.jsonl")) == 5
    assert json.load(open(tmp_path / "a" / "recipe.json"))["name"] == selfinstruct.RECIPE["name"]
    # The same counts in one run give the same conversations (seeded throughout).
    selfinstruct.generate(engine, str(tmp_path / "b"), 5, batch_size=5, max_answer_tokens=12, log=log)
    assert [json.loads(line) for line in open(tmp_path / "b" / "conversations.jsonl")] == rows
    for row in rows:
        if "skipped" in row:
            continue
        assert row["opening"] == selfinstruct.OPENINGS[row["index"] % len(selfinstruct.OPENINGS)][0]
        assert engine.tokenizer.decode(row["prompt_ids"]).count("user") >= 1  # through the chat template
        # Even indices are answered greedily: exactly what the target says to that prompt.
        if row["index"] % 2 == 0:
            alone = engine.generate(row["prompt_ids"], SamplingParams(max_tokens=12, temperature=0.0))
            assert row["response_ids"] == alone.token_ids
