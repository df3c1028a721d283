"""The engine-wide suffix cache saved and loaded (`Engine.save_suffix_cache` / `load_suffix_cache`,
`specrs serve --suffix-cache PATH`) on the real default model.

A restarted engine that loads the file drafts exactly as the engine that saved it; a damaged file or
another model's is refused with a ConfigError naming the path; the server refuses to start on such a
file unless told to start empty, and saves every N finished requests and at shutdown, leaving no
temporary file behind.
"""

from __future__ import annotations

import logging
import os

import pytest

import specrs
from specrs.errors import ConfigError

# A fixed draft length: the cost-aware one reads each engine's own timed cost curve, which may differ.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "adaptive_draft_length": False}
GREEDY = specrs.SamplingParams(max_tokens=24, temperature=0.0)
PROMPTS = ["List the days of the week.", "Count from one to ten in words."]
START_EMPTY_FLAG = "--suffix-cache-start-empty-on-error"


def _spec(result) -> tuple:
    m = result.metrics
    return m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, {prompt: (text, drafts)}): a cache file of two answers, and what the engine that
    saved it drafts for each prompt asked again (the answer is in its cache then)."""
    path = tmp_path_factory.mktemp("suffix") / "cache.bin"
    engine = specrs.Engine(speculative_config=SUFFIX)
    for prompt in PROMPTS:
        engine.generate(prompt, GREEDY)
    assert engine.save_suffix_cache(path) == 2
    again = {}
    for prompt in PROMPTS:
        # Each repeat adds its answer to the cache; the fresh engine below repeats the same order.
        result = engine.generate(prompt, GREEDY)
        again[prompt] = (result.text, _spec(result))
    return path, again


def test_a_restarted_engine_drafts_as_the_saved_one(saved, tmp_path):
    path, again = saved
    fresh = specrs.Engine(speculative_config=SUFFIX)
    assert fresh.load_suffix_cache(path) == 2
    cold = specrs.Engine(speculative_config=SUFFIX)
    for prompt in PROMPTS:
        result = fresh.generate(prompt, GREEDY)
        assert (result.text, _spec(result)) == again[prompt]
        # Without the file the first repeat drafts from its own prompt only: the cache mattered.
        assert _spec(cold.generate(prompt, GREEDY))[2] < _spec(result)[2]
    # os.PathLike works too, and a save of what was loaded (plus the two new answers) loads back.
    resaved = tmp_path / "resaved.bin"
    assert fresh.save_suffix_cache(resaved) == 4
    assert specrs.Engine(speculative_config=SUFFIX).load_suffix_cache(str(resaved)) == 4


def _refused(engine, path) -> str:
    with pytest.raises(ConfigError) as info:
        engine.load_suffix_cache(path)
    message = str(info.value)
    assert str(path) in message, message
    return message


def test_damaged_and_foreign_files_are_refused(saved, tmp_path):
    path, _ = saved
    good = path.read_bytes()
    checker = specrs.Engine(speculative_config=SUFFIX)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(good[: len(good) // 2])
    assert "truncated" in _refused(checker, truncated)
    flipped = tmp_path / "flipped.bin"
    middle = len(good) // 2
    flipped.write_bytes(good[:middle] + bytes([good[middle] ^ 0x01]) + good[middle + 1:])
    assert "checksum" in _refused(checker, flipped)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert "truncated" in _refused(checker, empty)
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a cache at all")
    assert "not a specrs suffix cache file" in _refused(checker, other)
    assert "cannot read" in _refused(checker, tmp_path / "missing.bin")
    # Another model's token ids mean other text: refused, whatever its vocabulary.
    tiny = specrs.Engine.random({"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
                                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2},
                                dtype="f32", speculative_config=SUFFIX)
    assert "another model" in _refused(tiny, path)
    # A refused file leaves the caches as they were: the good file still loads after.
    assert checker.load_suffix_cache(path) == 2


@pytest.fixture()
def serving_engine():
    """An engine of its own: loading a cache replaces the engine's caches."""
    return specrs.Engine(speculative_config=SUFFIX)


def _ask(http, n: int) -> None:
    for i in range(n):
        body = {"model": "m", "prompt": PROMPTS[i % 2], "max_tokens": 8, "temperature": 0}
        assert http.post("/v1/completions", json=body).status_code == 200


def test_serve_refuses_a_bad_file_unless_told_to_start_empty(serving_engine, tmp_path, caplog):
    from starlette.testclient import TestClient

    from specrs.serve import build_app

    bad = tmp_path / "cache.bin"
    bad.write_bytes(b"SPRSSUFX" + b"\x00" * 10)
    with pytest.raises(ConfigError) as info:
        build_app(serving_engine, "m", suffix_cache=bad)
    assert str(bad) in str(info.value) and START_EMPTY_FLAG in str(info.value)

    with caplog.at_level(logging.WARNING, logger="specrs.serve"):
        app = build_app(serving_engine, "m", suffix_cache=bad, suffix_cache_start_empty_on_error=True)
    assert any(str(bad) in r.getMessage() and "empty" in r.getMessage() for r in caplog.records)
    with TestClient(app) as http:
        _ask(http, 1)
    # The shutdown save replaced the bad file with a good one.
    assert specrs.Engine(speculative_config=SUFFIX).load_suffix_cache(bad) >= 1


def test_serve_saves_every_n_requests_and_at_shutdown(serving_engine, tmp_path):
    from starlette.testclient import TestClient

    from specrs.serve import build_app

    path = tmp_path / "state" / "cache.bin"  # its directory is created at the first save
    app = build_app(serving_engine, "m", suffix_cache=path, suffix_cache_save_every=2)
    store = app.state.suffix_cache_store
    with TestClient(app) as http:
        _ask(http, 1)
        store.wait()
        assert store.num_saves == 0 and not path.exists()
        _ask(http, 1)
        store.wait()
        assert store.num_saves == 1
        assert specrs.Engine(speculative_config=SUFFIX).load_suffix_cache(path) == 2
        _ask(http, 1)
    assert store.num_saves == 2  # the shutdown save
    assert specrs.Engine(speculative_config=SUFFIX).load_suffix_cache(path) == 3
    assert os.listdir(path.parent) == ["cache.bin"]  # no temporary file left

    # A restarted server picks the file up.
    restarted = specrs.Engine(speculative_config=SUFFIX)
    build_app(restarted, "m", suffix_cache=path)
    assert restarted.save_suffix_cache(tmp_path / "copy.bin") == 3


def test_shutdown_saves_before_it_stops_the_generation_loop(serving_engine, tmp_path):
    """What must persist comes first: a shutdown cut short while the generation loop stops (a
    second Ctrl-C, a Ray replica killed past its grace period) has already written every response
    that ended before it."""
    from starlette.testclient import TestClient

    from specrs.serve import build_app

    path = tmp_path / "cache.bin"
    app = build_app(serving_engine, "m", suffix_cache=path, suffix_cache_save_every=100)
    scheduler = app.state.scheduler
    stop, seen = scheduler.stop, {}

    def stop_and_look():
        seen["file"] = specrs.Engine(speculative_config=SUFFIX).load_suffix_cache(path) if path.exists() else None
        stop()

    scheduler.stop = stop_and_look
    with TestClient(app) as http:
        _ask(http, 3)
        assert not path.exists()  # no periodic save yet
    assert seen["file"] == 3


class _FailingEngine:
    """Saves always fail; loads count calls."""

    def __init__(self):
        self.saves = 0

    def save_suffix_cache(self, path):
        self.saves += 1
        raise ConfigError(f"cannot write the suffix cache file {path}: read-only file system")

    def load_suffix_cache(self, path):
        raise AssertionError("a missing file is not loaded")


def test_store_failures_are_logged_never_raised(tmp_path, caplog):
    from specrs.serve.suffix_store import SuffixCacheStore

    engine = _FailingEngine()
    store = SuffixCacheStore(engine, tmp_path / "missing.bin", save_every=3)
    with caplog.at_level(logging.INFO, logger="specrs.serve"):
        assert store.load() == 0  # no file yet: start empty
        for _ in range(6):
            store.on_request_finished("any", "arguments")
            store.wait()  # else the second save may find the first still running, and skip
        assert store.save() is False
    assert engine.saves == 3 and store.num_saves == 0
    assert sum("could not save" in r.getMessage() for r in caplog.records) == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError):
            SuffixCacheStore(engine, tmp_path / "x.bin", save_every=bad)


def test_cli_flags_reach_serve(monkeypatch):
    from specrs import cli
    import specrs.serve

    seen = {}
    monkeypatch.setattr(specrs.serve, "serve", lambda *args, **kwargs: seen.update(kwargs))
    assert cli.main(["serve", "--suffix-cache", "/tmp/c.bin", "--suffix-cache-save-every", "7",
                     START_EMPTY_FLAG]) == 0
    assert (seen["suffix_cache"], seen["suffix_cache_save_every"], seen["suffix_cache_start_empty_on_error"]) == (
        "/tmp/c.bin", 7, True)
    assert cli.main(["serve"]) == 0
    assert (seen["suffix_cache"], seen["suffix_cache_save_every"], seen["suffix_cache_start_empty_on_error"]) == (
        None, 100, False)
