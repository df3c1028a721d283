"""`specrs serve --record-traffic DIR`: nothing is stored unless asked; when asked, every request
that ended normally is stored with the target's exact tokens, and the recording reads straight into
head training's feature cache (specrs.train.features)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from specrs import SamplingParams  # noqa: E402
from specrs.serve import build_app  # noqa: E402
from specrs.train import features  # noqa: E402

BODIES = [{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
          {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 12, "temperature": 0}]


def _serve(engine, **kwargs) -> None:
    with TestClient(build_app(engine, "traffic-model", **kwargs)) as http:
        assert http.post("/v1/completions", json=BODIES[0]).status_code == 200
        assert http.post("/v1/chat/completions", json=BODIES[1]).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400


def test_nothing_is_recorded_unless_asked(engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _serve(engine)
    assert os.listdir(tmp_path) == []


def test_recorded_traffic_holds_the_targets_tokens_and_reads_into_features(engine, tmp_path):
    _serve(engine, record_traffic=tmp_path / "traffic")
    rows = [json.loads(line) for line in open(tmp_path / "traffic" / "traffic.jsonl")]
    assert [r["index"] for r in rows] == [0, 1]  # the refused request is not recorded
    prompts = [engine.prompt_token_ids(BODIES[0]["prompt"]), engine.prompt_token_ids(BODIES[1]["messages"])]
    for row, prompt, body in zip(rows, prompts, BODIES):
        assert row["prompt_ids"] == prompt
        alone = engine.generate(prompt, SamplingParams(max_tokens=body["max_tokens"], temperature=0.0))
        assert row["response_ids"] == alone.token_ids and row["finish_reason"] == alone.finish_reason
    # A second server appends after what is there.
    _serve(engine, record_traffic=tmp_path / "traffic")
    assert [json.loads(line)["index"] for line in open(tmp_path / "traffic" / "traffic.jsonl")] == [0, 1, 2, 3]

    index = features.extract(engine, str(tmp_path / "traffic" / "traffic.jsonl"), str(tmp_path / "features"))
    assert index["num_conversations"] == 4
    shard = np.load(tmp_path / "features" / index["shards"][0])
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows] * 2
    assert shard["conversation_ends"].tolist() == np.cumsum(lengths).tolist()
    assert shard["taps"].shape[:2] == (sum(lengths), 3) and shard["final"].shape[0] == sum(lengths)
    assert int(shard["loss_mask"].sum()) == sum(len(r["response_ids"]) for r in rows) * 2
