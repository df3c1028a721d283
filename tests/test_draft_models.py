"""Model-based drafts on the real default model: draft_model (a requantized copy of SmolLM2
written to its own GGUF file and loaded as a separate model), layer_skip, quantized_self and PARD.
Greedy identity for every method and k, the sampled distribution with draft probabilities,
tokenizer compatibility, cache rollback, memory, and the dynamic draft length settings."""

import json

import pytest
from gguf_writer import write_metadata_only
from test_speculative import PROMPTS, assert_same_distribution, chat, sample_with_and_without

import specrs
from specrs import SamplingParams, _specrs

MAX_TOKENS = 24
KS = [1, 4, 8]
# Any id works mechanically; a PARD-trained draft defines its own mask token.
MASK_TOKEN_ID = 0


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tmp_path_factory):
    """quantized_self writes its requantized copy under SPECRS_CACHE_DIR."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRS_CACHE_DIR", str(tmp_path_factory.mktemp("specrs-cache")))
        yield


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory, model_path):
    """The target requantized to Q8_0: a separate file and model with the same tokenizer."""
    path = tmp_path_factory.mktemp("draft") / "smollm2-q8_0.gguf"
    report = specrs.requantize(model_path, str(path), "q8_0")
    assert {to for name, _, to in report if name.endswith("_q.weight")} == {"q8_0"}
    assert {to for name, _, to in report if "norm" in name} == {"f32"}
    return str(path)


CONFIGS = {
    "draft_model": lambda k, draft: {"method": "draft_model", "model": draft},
    "draft_alias": lambda k, draft: {"method": "draft", "model": draft},
    "layer_skip": lambda k, draft: {"method": "layer_skip", "exit_layer": 8},
    "quantized_self": lambda k, draft: {"method": "quantized_self", "quantization": "q4_0"},
    "pard": lambda k, draft: {"method": "pard", "model": draft, "mask_token_id": MASK_TOKEN_ID},
}


def config(method, k, draft, **extra):
    # Fixed length by default, so every draft position 1..k gets verified.
    return {**CONFIGS[method](k, draft), "num_speculative_tokens": k, "adaptive_draft_length": False, **extra}


@pytest.fixture(scope="module")
def baselines(engine):
    out = {}
    for name, text in PROMPTS.items():
        r = engine.generate(chat(text), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative_config=False)
        out[name] = r.token_ids
    return out


def check_identity(engine, baselines, spec, require_drafts=True):
    num_drafts = num_accepted = 0
    for name, text in PROMPTS.items():
        r = engine.generate(chat(text), SamplingParams(temperature=0, max_tokens=MAX_TOKENS), speculative_config=spec)
        assert r.token_ids == baselines[name], f"{spec} diverged on {name}"
        num_drafts += r.metrics["num_drafts"]
        num_accepted += r.metrics["num_accepted_tokens"]
    assert num_drafts > 0 or not require_drafts
    return num_accepted


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("method", ["draft_model", "layer_skip", "quantized_self", "pard"])
def test_greedy_identity(engine, baselines, draft_path, method, k):
    num_accepted = check_identity(engine, baselines, config(method, k, draft_path))
    if method in ("draft_model", "quantized_self"):
        assert num_accepted > 0, "a requantized copy of the target agrees with it on some tokens"


@pytest.mark.parametrize(
    "extra",
    [
        {"exit_layer": 4},
        {"exit_layer": 12},
        # Costs pinned so the policy drafts whatever this machine measures (a Q8_0 copy may
        # rightly measure too costly to draft at all), and the identity is tested with drafts.
        {"adaptive_draft_length": True, "verify_cost_ratios": [1.0, 1.05, 1.1, 1.15, 1.2], "draft_cost": 0.05},
        {"num_speculative_tokens_schedule": "heuristic"},
        {"draft_confidence_threshold": 0.4},
    ],
)
def test_greedy_identity_with_other_settings(engine, baselines, draft_path, extra):
    method = "layer_skip" if "exit_layer" in extra else "draft_model"
    check_identity(engine, baselines, config(method, 4, draft_path, **extra))


def test_pard_drafts_are_costed_per_draft(model_path, draft_path, monkeypatch):
    """PARD drafts its whole block in one forward, so the draft-length policy charges it c per
    draft, whatever its length: its prior is one forward of the draft (the draft's weight bytes
    over the target's) at every k, where a draft model's is that per token; its measured figure
    is timed per draft and cached under its own key."""
    monkeypatch.setenv("SPECRS_COST_CACHE", "0")
    engine = specrs.Engine(model_path)
    engine.set_measure_on_demand(False)
    adaptive = {"adaptive_draft_length": True}
    per_token = engine.prepare(config("draft_model", 4, draft_path, **adaptive))
    per_draft = [engine.prepare(config("pard", k, draft_path, **adaptive)) for k in (2, 4)]
    assert (per_token["draft_cost_unit"], per_token["draft_cost_source"]) == ("token", "prior")
    assert [(c["draft_cost_unit"], c["draft_cost_source"]) for c in per_draft] == [("draft", "prior")] * 2
    assert per_draft[0]["draft_cost"] == per_draft[1]["draft_cost"] == per_token["draft_cost"] > 0
    # A pinned c is read in the method's unit.
    pinned = engine.prepare(config("pard", 4, draft_path, draft_cost=0.7, **adaptive))
    assert (pinned["draft_cost"], pinned["draft_cost_unit"], pinned["draft_cost_source"]) == (0.7, "draft", "config")
    engine.set_measure_on_demand(True)
    engine.prepare(config("pard", 4, draft_path, **adaptive))
    assert engine.wait_for_costs()
    measured = engine.prepare(config("pard", 4, draft_path, **adaptive))
    assert (measured["draft_cost_unit"], measured["draft_cost_source"]) == ("draft", "measured")
    assert measured["draft_cost"] > 0
    figures = [f["what"] for f in engine.cost_status()["figures"]]
    assert any(what.startswith("draft cost of pard:") and what.endswith(":k=4:per_draft") for what in figures), figures


def test_a_costly_drafts_acceptance_is_measured_from_its_first_requests(model_path, draft_path, baselines):
    """Costs pinned as Qwen2.5-Coder-0.5B drafting for 1.5B measured on this CPU (c = 0.37 per
    token): at the uninformed a = 0.5 no draft length pays, so before the engine knew better a
    request never drafted and the draft's acceptance was never learned. Now each request tries
    its first draft until the engine has seen 32 of this draft's; their acceptance (the Q8_0 copy
    agrees with its target almost always) is then where every later request starts: drafting
    from its first step. Output stays the plain output throughout."""
    engine = specrs.Engine(model_path)
    costly = config("draft_model", 4, draft_path, adaptive_draft_length=True,
                    verify_cost_ratios=[1.0, 1.14, 1.22, 1.33, 1.57], draft_cost=0.37)
    assert engine.prepare(costly)["draft_acceptance"] is None
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    seen = 0
    for name in PROMPTS:
        r = engine.generate(chat(PROMPTS[name]), greedy, speculative_config=costly)
        assert r.token_ids == baselines[name], name
        assert r.metrics["num_drafts"] > 0, f"{name}: the unmeasured draft was not tried"
        seen += r.metrics["num_drafts"]
        if engine.prepare(costly)["draft_acceptance"] is not None:
            break
    acceptance = engine.prepare(costly)["draft_acceptance"]
    assert seen >= 32 and acceptance is not None and acceptance > 0.8, (seen, acceptance)
    # A later request starts from it (a = 0.9 pays at these costs: draft_length.rs's test) and drafts.
    r = engine.generate(chat(PROMPTS["writing"]), greedy, speculative_config=costly)
    assert r.token_ids == baselines["writing"] and r.metrics["num_drafts"] > 0
    # Before its first draft the draft reads the prompt: 0.37 x 0.1425 (the curve's slope) = 0.053
    # target steps a token, 21 for 400. At a >= 0.8 a token left saves 0.2-0.39 steps, so 16
    # tokens never win that back and 200 always do.
    long_prompt = chat("Summarize: " + "The quick brown fox jumps over the lazy dog. " * 40)
    assert 380 <= len(engine.prompt_token_ids(long_prompt)) <= 480
    short = engine.generate(long_prompt, SamplingParams(temperature=0, max_tokens=16), speculative_config=costly)
    m = short.metrics
    assert m["num_drafts"] == 0 and m["idle_steps"]["cost"] > 0, m
    assert "would not win back" in m["idle_reason"] and "context tokens it has not read" in m["idle_reason"], m
    plain = engine.generate(long_prompt, SamplingParams(temperature=0, max_tokens=16), speculative_config=False)
    assert short.token_ids == plain.token_ids
    long = engine.generate(long_prompt, SamplingParams(temperature=0, max_tokens=200), speculative_config=costly)
    assert long.metrics["num_drafts"] > 0 and long.token_ids[:16] == plain.token_ids
    # Another engine has its own figure.
    assert specrs.Engine(model_path).prepare(costly)["draft_acceptance"] is None


def test_draft_of_the_target_itself_accepts_everything(engine, model_path):
    """The target as its own draft: every greedy draft token must pass, so any slip in the draft
    cache (a missed rollback, an off-by-one position) shows up as a rejection."""
    r = engine.generate(
        chat(PROMPTS["writing"]), SamplingParams(temperature=0, max_tokens=32),
        speculative_config=config("draft_alias", 3, model_path),
    )
    assert r.metrics["num_draft_tokens"] > 0
    assert r.metrics["num_accepted_tokens"] == r.metrics["num_draft_tokens"]


@pytest.mark.parametrize("method", ["draft_model", "layer_skip", "pard"])
def test_sampling_with_draft_probabilities_matches_plain_sampling(engine, draft_path, method):
    """Tokens 2 and 3 (both decided by one k=2 draft) have the same joint distribution with and
    without speculation, under rejection sampling with the draft's q. layer_skip's q is far from
    p, so recovery from max(0, p - q) carries the test; the requantized draft's q is close to p,
    so acceptance does."""
    prompt = engine.tokenizer.encode("My favorite color is")
    params = lambda seed: SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=seed)  # noqa: E731
    spec = config(method, 2, draft_path, verification="rejection")
    n = 400
    plain, speculative, num_drafts = sample_with_and_without(
        engine, prompt, params, n, lambda seed: {"speculative_config": spec}
    )
    assert num_drafts >= n
    assert_same_distribution(plain, speculative)


def test_a_batch_drafts_its_draft_model_chains_together(engine, baselines, draft_path):
    """The requests of one scheduler draft their chains in shared draft forwards, one per depth
    (not one per request and token), and yield the tokens each yields alone."""
    scheduler = _specrs.Scheduler(engine._inner, draft_budget="off")
    spec = json.dumps(config("draft_model", 4, draft_path))
    names = list(PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for request_id, name in enumerate(names):
        scheduler.add(request_id, engine.prompt_token_ids(chat(PROMPTS[name])), params, spec, None)
    tokens: list[list[int]] = [[] for _ in names]
    while scheduler.has_unfinished:
        outputs, report = scheduler.step()
        assert report["num_shared_draft_forwards"] <= 4, report  # k = 4, however many chains
        for output in outputs:
            assert output["error"] is None
            tokens[output["request_id"]] += output["token_ids"]
    assert tokens == [baselines[name] for name in names]
    totals = scheduler.totals()
    assert totals["num_chains_drafted_together"] >= 2 * len(names), totals
    assert totals["num_shared_draft_forwards"] < totals["num_chains_drafted_together"] * 4, totals


@pytest.mark.parametrize("method", ["draft_model", "layer_skip", "quantized_self", "pard"])
def test_coupled_drafts_emit_plain_samplings_tokens_at_every_draft_length(engine, draft_path, method):
    """A seeded sampled request drafting from a model, verified in coupled form (the default),
    emits plain sampling's tokens, token for token, at every fixed k and at the lengths its costs
    choose; and its drafts are accepted (each draft token is drawn with the uniform the target
    samples its position with, so a close draft agrees with the target)."""
    prompt = chat(PROMPTS["writing"])
    params = lambda seed: SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=seed)  # noqa: E731
    accepted = 0
    for seed in (1, 2):
        plain = engine.generate(prompt, params(seed), speculative_config=False).token_ids
        for k in (1, 3, 8):
            r = engine.generate(prompt, params(seed), speculative_config=config(method, k, draft_path))
            assert r.token_ids == plain, (seed, k)
            accepted += r.metrics["num_accepted_tokens"]
        adaptive = {**CONFIGS[method](4, draft_path), "num_speculative_tokens": 4}
        assert engine.generate(prompt, params(seed), speculative_config=adaptive).token_ids == plain, seed
    assert accepted > 0


def test_rejection_sampled_tokens_follow_the_draft_lengths(engine, draft_path):
    """What coupled verification removes: with "verification": "rejection" the same seed gives
    other tokens at other draft lengths (each length reads the sequential stream differently)."""
    prompt = chat(PROMPTS["writing"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=1)
    outputs = {tuple(engine.generate(prompt, params, speculative_config=config(
        "quantized_self", k, draft_path, verification="rejection")).token_ids) for k in (1, 2, 3, 8)}
    assert len(outputs) > 1


def test_sampled_draft_model_is_seeded(engine, draft_path):
    spec = config("draft_model", 4, draft_path)
    run = lambda seed: engine.generate(  # noqa: E731
        chat(PROMPTS["writing"]), SamplingParams(max_tokens=24, temperature=0.8, seed=seed), speculative_config=spec
    ).token_ids
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_rollback_keeps_draft_and_target_caches_on_the_kept_prefix(engine, draft_path):
    """After every step that rejected part of its draft, both caches hold exactly the prompt plus
    every token but the newest: the accepted prefix."""
    spec = config("quantized_self", 4, draft_path)  # ~50% acceptance: plenty of partial rejections
    stream = engine.stream(chat(PROMPTS["stem"]), SamplingParams(temperature=0, max_tokens=48), speculative_config=spec)
    inner = stream._inner
    checked = 0
    while not inner.finished:
        before = inner.result()["metrics"]
        if next(inner, None) is None:
            break
        after = inner.result()["metrics"]
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        if inner.finished or not 0 < drafted or accepted == drafted:
            continue
        r = inner.result()
        target_len, draft_len = inner.kv_lens()
        assert target_len == len(r["prompt_token_ids"]) + len(r["token_ids"]) - 1
        assert draft_len == target_len
        checked += 1
    assert checked >= 3


def test_memory_reports_weights_and_kv(model_path, draft_path):
    e = specrs.Engine(model_path)
    assert e.memory()["draft_weight_bytes"] == 0
    spec = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": 4, "max_model_len": 256,
            "adaptive_draft_length": False}
    stream = e.stream(chat(PROMPTS["qa"]), SamplingParams(temperature=0, max_tokens=16), speculative_config=spec)
    next(stream)
    live = e.memory()
    assert live["target_weight_bytes"] == e.info()["weight_bytes"]
    assert live["draft_weight_bytes"] > live["target_weight_bytes"]  # Q8_0 is larger than Q4_1
    assert live["target_kv_bytes"] > 0 and live["draft_kv_bytes"] > 0
    list(stream)
    done = e.memory()
    assert done["target_kv_bytes"] == 0 and done["draft_kv_bytes"] == 0
    assert done["peak_draft_kv_bytes"] == live["draft_kv_bytes"]


def test_draft_max_model_len_bounds_the_draft_cache(engine, draft_path):
    """Past the draft's max_model_len the request continues without drafts, output unchanged."""
    prompt = chat(PROMPTS["summarization"])
    plain = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=24), speculative_config=False)
    limit = len(plain.prompt_token_ids) + 8
    spec = config("draft_model", 4, draft_path, max_model_len=limit)
    r = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=24), speculative_config=spec)
    assert r.token_ids == plain.token_ids
    assert 0 < r.metrics["num_draft_tokens"] <= 8


def test_heuristic_schedule_shrinks_k_when_drafts_fail(engine, draft_path):
    """layer_skip at exit 4 is almost never right: the heuristic schedule walks k down to 1."""
    fixed = engine.generate(
        chat(PROMPTS["writing"]), SamplingParams(temperature=0, max_tokens=24), speculative_config=config("layer_skip", 8, None, exit_layer=4)
    )
    heuristic = engine.generate(
        chat(PROMPTS["writing"]),
        SamplingParams(temperature=0, max_tokens=24),
        speculative_config=config("layer_skip", 8, None, exit_layer=4, num_speculative_tokens_schedule="heuristic"),
    )
    assert heuristic.token_ids == fixed.token_ids
    # Drafts near max_tokens are capped at the tokens left, hence > 6 rather than 8.
    assert fixed.metrics["num_draft_tokens"] > 6 * fixed.metrics["num_drafts"]
    # k walks 8, 7, ..., 1 and stays at 1: 36 tokens for the first 8 drafts, then 1 per draft.
    assert heuristic.metrics["num_draft_tokens"] <= 36 + (heuristic.metrics["num_drafts"] - 8)


def test_confidence_threshold_stops_drafts_early(engine, draft_path):
    run = lambda threshold: engine.generate(  # noqa: E731
        chat(PROMPTS["writing"]),
        SamplingParams(temperature=0, max_tokens=24),
        speculative_config=config("layer_skip", 8, None, draft_confidence_threshold=threshold),
    ).metrics
    off, strict = run(0.0), run(0.99)
    assert off["num_draft_tokens"] > 6 * off["num_drafts"]
    assert strict["num_draft_tokens"] < 2 * strict["num_drafts"]


def tiny_tokenizer_gguf(path, tokens):
    write_metadata_only(
        path,
        {
            "general.architecture": "llama",
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [],
        },
    )
    return str(path)


def first_target_tokens(engine, n):
    """SmolLM2's first tokens are special tokens, whose text is their vocabulary string."""
    tokens = [engine.tokenizer.decode([i], False) for i in range(n)]
    assert all(t.startswith("<") for t in tokens), tokens
    return tokens


def test_mismatched_draft_tokenizer_names_the_first_differing_token(engine, tmp_path):
    """For the methods that need the target's tokenizer (PARD, quantized_self's copy); a
    draft_model with another tokenizer drafts text instead (test_cross_tokenizer.py)."""
    path = tiny_tokenizer_gguf(tmp_path / "tiny.gguf", first_target_tokens(engine, 2) + ["zzz-not-in-target"])
    spec = {"method": "pard", "model": path, "mask_token_id": MASK_TOKEN_ID, "num_speculative_tokens": 4}
    with pytest.raises(specrs.TokenizerMismatchError, match=r"token id 2 is \"zzz-not-in-target\" in the draft"):
        engine.generate("Hi", SamplingParams(temperature=0, max_tokens=4), speculative_config=spec)
    assert issubclass(specrs.TokenizerMismatchError, specrs.ModelLoadError)


def test_draft_vocabulary_that_is_a_prefix_of_the_targets_passes_the_check(engine, tmp_path):
    """A draft with the target's first tokens is compatible: the load gets past the tokenizer
    check and fails only because this file has no weights."""
    path = tiny_tokenizer_gguf(tmp_path / "prefix.gguf", first_target_tokens(engine, 3))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 4}
    with pytest.raises(specrs.ModelLoadError) as info:
        engine.generate("Hi", SamplingParams(temperature=0, max_tokens=4), speculative_config=spec)
    assert not isinstance(info.value, specrs.TokenizerMismatchError), info.value


@pytest.mark.parametrize(
    "spec, fix",
    [
        ({"method": "draft_model", "num_speculative_tokens": 4}, 'needs "model"'),
        ({"method": "draft_model", "model": "/nonexistent/draft.gguf", "num_speculative_tokens": 4}, "not found"),
        ({"method": "layer_skip", "exit_layer": 30, "num_speculative_tokens": 4}, "exit_layer must be in 1..30"),
        ({"method": "pard", "model": "MODEL", "mask_token_id": 10**6, "num_speculative_tokens": 4}, "mask_token_id"),
        ({"method": "quantized_self", "quantization": "q9_9", "num_speculative_tokens": 4}, "q4_0"),
        ({"method": "layer_skip", "exit_layer": 4, "num_speculative_tokens": 4, "model": "x.gguf"},
         "applies to method draft_model / pard / auto / eagle / eagle3 / mtp / mlp_speculator / medusa / dflash / dspark only"),
    ],
)
def test_bad_draft_configs_name_the_fix(engine, model_path, spec, fix):
    spec = {k: (model_path if v == "MODEL" else v) for k, v in spec.items()}
    with pytest.raises(specrs.SpecrsError, match=fix):
        engine.generate("Hi", SamplingParams(temperature=0, max_tokens=4), speculative_config=spec)


def test_requantize_cli_writes_a_loadable_model(model_path, tmp_path, capsys):
    from specrs.cli import main

    dst = tmp_path / "q4_0.gguf"
    assert main(["requantize", model_path, str(dst), "--type", "q4_0"]) == 0
    assert "-> q4_0" in capsys.readouterr().out
    draft = specrs.Engine(str(dst))
    assert draft.info()["weight_bytes"] < specrs.Engine(model_path).info()["weight_bytes"]
    assert main(["requantize", model_path, str(tmp_path / "x.gguf"), "--type", "q1"]) == 2
