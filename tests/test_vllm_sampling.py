"""`SamplingParams` as vLLM users write it, through the Python API and the CLI, on the real model:
vLLM's defaults; `stop` strings handled in the core (speculative output equals plain decoding's,
streams never show a possible beginning of a stop string, the suffix cache learns only the
emitted tokens, `stop_reason`); `include_stop_str_in_output`, `skip_special_tokens`,
`spaces_between_special_tokens`, `truncate_prompt_tokens`, `bad_words`, `allowed_token_ids`; and
vLLM's fields specrs refuses, each a ConfigError naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import specrs
from specrs import SamplingParams
from specrs.errors import ConfigError

CHAT = [{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]
REPEAT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat sat"
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "adaptive_draft_length": False, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "adaptive_draft_length": False}
METHODS = [NGRAM, SUFFIX, {**NGRAM, "num_speculative_tokens": 2}]


def greedy(max_tokens: int = 40, **settings) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **settings)


@pytest.fixture(scope="module")
def plain(engine):
    """The greedy answers to CHAT and REPEAT without stop strings (40 tokens, EOS ignored)."""
    return {name: engine.generate(prompt, greedy(ignore_eos=True), speculative_config=False)
            for name, prompt in (("chat", CHAT), ("repeat", REPEAT))}


def test_defaults_are_vllms():
    params = SamplingParams()
    assert (params.temperature, params.max_tokens, params.top_k, params.top_p) == (1.0, 16, 0, 1.0)
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (True, True)
    assert (params.stop, params.include_stop_str_in_output, params.bad_words) == ([], False, [])
    assert (params.truncate_prompt_tokens, params.allowed_token_ids) == (None, None)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    # The call vLLM users write: a string stop, as in `SamplingParams(stop="\n")`.
    assert SamplingParams(stop="\n").stop == ["\n"] and SamplingParams(stop=["\n", "."]).stop == ["\n", "."]


def test_vllms_defaults_sample_sixteen_tokens(engine):
    out = engine.generate("Once upon a time", SamplingParams(ignore_eos=True, seed=3))
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    again = engine.generate("Once upon a time", SamplingParams(ignore_eos=True, seed=3))
    other = engine.generate("Once upon a time", SamplingParams(ignore_eos=True, seed=4))
    assert out.token_ids == again.token_ids != other.token_ids  # sampled (temperature 1), seeded


@pytest.mark.parametrize("name", ["chat", "repeat"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_the_output_as_plain_decoding_does(engine, plain, name, include):
    full = plain[name]
    prompt = CHAT if name == "chat" else REPEAT
    n = len(full.text)
    for stop in (full.text[n // 2:n // 2 + 3], full.text[2 * n // 3:2 * n // 3 + 2]):
        params = greedy(stop=[stop, "never appears"], include_stop_str_in_output=include, ignore_eos=True)
        expected = engine.generate(prompt, params, speculative_config=False)
        at = full.text.index(stop)
        assert expected.text == full.text[:at + (len(stop) if include else 0)]
        assert (expected.finish_reason, expected.stop_reason) == ("stop", stop)
        assert expected.token_ids == full.token_ids[:len(expected.token_ids)] and len(expected.token_ids) < 40
        for method in METHODS:
            got = engine.generate(prompt, params, speculative_config=method)
            assert (got.token_ids, got.text, got.stop_reason) == (expected.token_ids, expected.text, stop), method
        streamed = engine.stream(prompt, params, speculative_config=NGRAM)
        assert "".join(streamed) == expected.text and streamed.result.stop_reason == stop


def test_a_stream_holds_back_what_may_begin_a_stop_string(engine, plain):
    """A stop string that never completes, whose beginnings keep appearing: after every step the
    text shown is the tokens' text but for an end that may begin the stop string, which comes out
    once the next text shows it does not (all of it at the end)."""
    stop = "the cat sat on the rug"
    stream = engine.stream(REPEAT, greedy(stop=stop, ignore_eos=True), speculative_config=NGRAM)
    shown, num_held = "", 0
    while (step := stream.step()) is not None:
        shown += step[0]
        decoded = engine.tokenizer.decode(stream.result.token_ids)
        held = decoded[len(shown):]
        assert decoded.startswith(shown)
        if not stream.finished:
            assert held == "" or stop.startswith(held), held
            assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop))), shown[-30:]
            num_held += held != ""
    assert shown == plain["repeat"].text and stream.result.finish_reason == "length"
    assert num_held > 0


def test_a_batch_runs_each_requests_own_stop_strings(engine, plain):
    full = plain["repeat"].text
    stops = [full[10:13], full[25:28], "never appears"]
    params = [greedy(stop=stop, ignore_eos=True) for stop in stops]
    results = engine.generate([REPEAT] * 3, params, speculative_config=NGRAM, progress=False)
    for stop, result in zip(stops, results):
        expected = full[:full.find(stop)] if stop in full else full
        assert result.text == expected
        assert result.stop_reason == (stop if stop in full else None)


def cut_inside_a_draft(result) -> bool:
    """Whether a stop string ended `result` inside an accepted draft: every step emits its
    accepted draft tokens and one more, so fewer tokens than that mean the step was cut short."""
    m = result.metrics
    return m["num_generated_tokens"] < 1 + m["num_decode_steps"] + m["num_accepted_tokens"]


def test_the_suffix_cache_learns_only_the_emitted_tokens(model_path, plain):
    """The suffix cache (what the next requests draft from) holds exactly each request's output,
    also when the stop string completed inside an accepted draft, whose tokens past it a request
    stopped outside the core (aborted after the step) would have committed and taught it."""
    engine = specrs.Engine(model_path, speculative_config=SUFFIX)
    full = plain["repeat"].text
    outputs = []
    for start in (30, 34, 38, 45, 52):
        out = engine.generate(REPEAT, greedy(stop=full[start:start + 4], ignore_eos=True))
        assert out.finish_reason == "stop" and len(out.token_ids) < len(plain["repeat"].token_ids)
        assert out.token_ids == plain["repeat"].token_ids[:len(out.token_ids)]
        outputs.append(out)
    assert any(cut_inside_a_draft(out) for out in outputs), [out.metrics for out in outputs]
    [(config, responses)] = engine.suffix_cache_responses()
    assert responses == [out.token_ids for out in outputs]


def test_include_stop_str_and_skip_special_tokens(engine):
    """An end-of-sequence token ends the output without its text, as in vLLM, unless
    include_stop_str_in_output; with skip_special_tokens=False the special tokens are written."""
    ended = engine.generate(CHAT, greedy(max_tokens=120), speculative_config=False)
    assert ended.finish_reason == "stop" and ended.stop_reason is None  # an EOS token: no stop_reason
    eos = engine.tokenizer.decode([ended.token_ids[-1]], skip_special_tokens=False)
    shown = engine.generate(CHAT, greedy(max_tokens=120, skip_special_tokens=False, include_stop_str_in_output=True),
                            speculative_config=NGRAM)
    assert shown.token_ids == ended.token_ids and shown.text == ended.text + eos
    hidden = engine.generate(CHAT, greedy(max_tokens=120, skip_special_tokens=False), speculative_config=False)
    assert hidden.text == ended.text  # the EOS token's text is left out
    # Past the end of sequence (ignore_eos), the special tokens are text only when not skipped.
    past = dict(max_tokens=len(ended.token_ids) + 4, ignore_eos=True)
    skipped = engine.generate(CHAT, greedy(**past), speculative_config=False)
    kept = engine.generate(CHAT, greedy(**past, skip_special_tokens=False), speculative_config=False)
    assert eos not in skipped.text and eos in kept.text
    # SmolLM2's byte-level decoder puts no space between special tokens either way.
    no_spaces = engine.generate(CHAT, greedy(**past, skip_special_tokens=False, spaces_between_special_tokens=False),
                                speculative_config=False)
    assert no_spaces.text == kept.text
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False


def test_stop_token_ids_report_the_token_and_leave_its_text_out(engine, plain):
    full = plain["repeat"]
    token = full.token_ids[8]
    out = engine.generate(REPEAT, greedy(stop_token_ids=[token], ignore_eos=True), speculative_config=NGRAM)
    cut = full.token_ids.index(token) + 1
    assert out.token_ids == full.token_ids[:cut] and out.stop_reason == token
    included = engine.generate(REPEAT, greedy(stop_token_ids=[token], ignore_eos=True, include_stop_str_in_output=True),
                               speculative_config=False)
    token_text = included.text[len(out.text):]
    assert included.token_ids == out.token_ids and token_text and full.text.startswith(out.text + token_text)


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    ids = engine.prompt_token_ids(REPEAT)
    out = engine.generate(ids, greedy(max_tokens=8, truncate_prompt_tokens=12), speculative_config=NGRAM)
    alone = engine.generate(ids[-12:], greedy(max_tokens=8), speculative_config=False)
    assert out.prompt_token_ids == ids[-12:] and out.token_ids == alone.token_ids
    assert out.metrics["num_prompt_tokens"] == 12
    whole = engine.generate(ids, greedy(max_tokens=8, truncate_prompt_tokens=-1))  # the context holds it all
    assert whole.prompt_token_ids == ids
    batch = engine.generate([ids, ids], greedy(max_tokens=8, truncate_prompt_tokens=12), progress=False)
    assert [r.token_ids for r in batch] == [alone.token_ids] * 2
    for bad in (0, -2):
        with pytest.raises(ConfigError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ConfigError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=2**70)


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


def test_bad_words_are_never_generated_and_speculation_stays_exact(engine, plain):
    full = plain["repeat"]
    assert " cat" in full.text and " on the" in full.text
    params = greedy(bad_words=["cat", "on the"], ignore_eos=True)
    out = engine.generate(REPEAT, params, speculative_config=False)
    tokenizer = engine.tokenizer
    for word in ("cat", " cat", "on the", " on the"):
        assert not _contains(out.token_ids, tokenizer.encode(word, add_special_tokens=False)), word
    assert out.token_ids != full.token_ids
    for method in METHODS:
        assert engine.generate(REPEAT, params, speculative_config=method).token_ids == out.token_ids, method
    with pytest.raises(ConfigError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_allowed_token_ids_limit_the_output_and_speculation_stays_exact(engine, plain):
    full = plain["repeat"]
    allowed = sorted(set(full.token_ids[:6]))
    out = engine.generate(REPEAT, greedy(allowed_token_ids=allowed, ignore_eos=True), speculative_config=False)
    assert set(out.token_ids) <= set(allowed) and out.token_ids != full.token_ids
    for method in METHODS:
        got = engine.generate(REPEAT, greedy(allowed_token_ids=allowed, ignore_eos=True), speculative_config=method)
        assert got.token_ids == out.token_ids, method
    with pytest.raises(ConfigError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ConfigError, match="allowed_token_ids names token id 99999"):
        engine.generate("Hi", greedy(allowed_token_ids=[1, 99999]))


@pytest.mark.parametrize("field, value", [("best_of", 2), ("detokenize", False), ("logits_processors", [len]),
                                          ("output_kind", 1), ("guided_decoding", {"json": {}}),
                                          ("structured_outputs", {"regex": "a"}), ("extra_args", {"a": 1}),
                                          ("prompt_logprobs", 1)])
def test_vllm_fields_specrs_lacks_are_config_errors_naming_them(field, value):
    with pytest.raises(ConfigError, match=f"SamplingParams field {field} is vLLM's"):
        SamplingParams(**{field: value})


def test_vllm_fields_at_their_defaults_and_unknown_names():
    SamplingParams(best_of=None, detokenize=True, logits_processors=None, prompt_logprobs=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        SamplingParams(temprature=0.5)
    with pytest.raises(ConfigError, match="stop must be a string or a list of strings"):
        SamplingParams(stop=3)
    with pytest.raises(ConfigError, match="stop strings must not be empty"):
        SamplingParams(stop=["a", ""])


def test_cli_generate_stops_at_a_stop_string(engine, plain):
    full = plain["repeat"].text
    stop = full[20:24]
    proc = subprocess.run([sys.executable, "-m", "specrs.cli", "generate", "--prompt", REPEAT, "--max-tokens", "40",
                           "--stop", "never appears", "--stop", stop, "--quiet-stats-to-stderr"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    expected = engine.generate(REPEAT, greedy(stop=stop), speculative_config=False)
    assert proc.stdout == expected.text + "\n" and expected.text == full[:full.index(stop)]
    assert "(stop)" in proc.stderr
