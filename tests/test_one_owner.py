"""One owner per concept across the Rust/Python boundary: Python reads Rust's tables and keeps no
copy of them.

- Every speculative method the parser knows has a row in Rust's facts table, and Python's views
  (the engine's METHOD_FACTS, the server's methods without weights, the shipped heads' SHIPPED and
  HEAD_METHODS) are that table.
- The scheduler's defaults (max_num_seqs, max_num_batched_tokens, draft_budget) are Rust's
  `SchedulerConfig::default()` in every Python signature, setting and command-line flag.
- The server's request modules import no circle (serve/errors.py holds APIError).
"""

import ast
import inspect
import json
import re
from pathlib import Path

import pytest

import specrs
from specrs import _specrs, cli, heads
from specrs import engine as engine_module
from specrs import serve
from specrs.serve import app as serve_app
from specrs.serve import protocol
from specrs.serve import scheduler as serve_scheduler
from specrs.serve.ray.settings import ReplicaSettings

SERVE_DIR = Path(protocol.__file__).parent


def test_every_method_has_facts_and_python_reads_them():
    facts = _specrs.method_facts()
    assert list(facts) == _specrs.Engine.speculative_methods()
    assert engine_module.METHOD_FACTS == facts
    assert protocol.METHODS_WITHOUT_WEIGHTS == [
        name for name, f in facts.items() if not f["weight_keys"] and not f["needs_proposer_object"]]
    for name, f in facts.items():
        # The facts say what the parser does: a config holding every key the method owns loads
        # exactly the weights its weight_keys name.
        config = {"method": name, "num_speculative_tokens": 2}
        values = {"model": "weights.gguf", "quantization": "q8_0", "draft_method": "eagle3"}
        # "auto"'s draft-model key and its head keys exclude each other; its head form holds every
        # weight key.
        config.update({key: values.get(key, 2) for key in f["keys"]
                       if not key.startswith("suffix_decoding_") and (name, key) != ("auto", "max_model_len")})
        weights = _specrs.SpeculativeConfig.from_json(json.dumps(config)).weights()
        assert (weights is not None) == bool(f["weight_keys"]), name
        if weights is not None:
            assert sorted(weights) == sorted(["method", *f["weight_keys"]]), name
        for alias in f["aliases"]:
            aliased = _specrs.SpeculativeConfig.from_json(json.dumps({**config, "method": alias}))
            assert aliased.method == name


def test_shipped_heads_are_rusts_table_with_their_directories_in_the_package():
    table = _specrs.shipped_heads()
    assert heads.SHIPPED == table["targets"] and heads.HEAD_METHODS == table["head_methods"]
    facts = _specrs.method_facts()
    for name, entry in heads.SHIPPED.items():
        assert set(entry["match"]) == {"architecture", "vocab_size", "num_layers", "weight_bytes"}, name
        for method, relative in entry["heads"].items():
            assert "model" in facts[method]["weight_keys"], method
            assert (heads.HEADS_DIR / relative / "config.json").is_file(), relative
    for method, defaults in heads.HEAD_METHODS.items():
        assert defaults["num_speculative_tokens"] >= 1, method


def test_a_method_that_needs_a_proposer_object_is_refused_over_http_by_its_facts():
    speculation = protocol.ServerSpeculation(None)
    needs_object = [name for name, f in _specrs.method_facts().items() if f["needs_proposer_object"]]
    assert needs_object
    for method in needs_object:
        with pytest.raises(protocol.APIError, match="needs a Python proposer object") as refused:
            speculation.for_request({"method": method, "num_speculative_tokens": 2})
        assert refused.value.param == "speculative"
    with pytest.raises(protocol.APIError, match="loads weights") as refused:
        speculation.for_request({"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2})
    assert f"a method without weights ({', '.join(protocol.METHODS_WITHOUT_WEIGHTS)})" in refused.value.message


def _defaults(function) -> dict:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_scheduler_defaults_are_rusts_everywhere():
    rust = _specrs.SCHEDULER_DEFAULTS
    assert set(rust) >= {"max_num_seqs", "max_num_batched_tokens", "max_kv_tokens", "prefill_chunk", "draft_budget"}
    # The binding's own signature (its text repeats the numbers for `inspect`).
    binding = _defaults(_specrs.Scheduler)
    assert {k: binding[k] for k in rust if k in binding} == {k: rust[k] for k in rust if k in binding}
    keys = ("max_num_seqs", "max_num_batched_tokens", "draft_budget")
    for function in (specrs.Engine.generate, specrs.Engine.generate_samples, serve.build_app, serve.serve,
                     serve._check_settings, serve_app.build_app, serve_scheduler.Scheduler.__init__):
        defaults = _defaults(function)
        for key in keys:
            if key in defaults:
                assert defaults[key] == rust[key], (function.__qualname__, key)
    settings = ReplicaSettings()
    assert all(getattr(settings, key) == rust[key] for key in keys)
    args = cli.build_parser().parse_args(["serve"])
    assert all(getattr(args, key) == rust[key] for key in keys)
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert f"(default: {rust['max_num_batched_tokens']})" in " ".join(help_text.split())


def _imports(path: Path) -> set[str]:
    """The sibling modules of specrs.serve that `path` imports, anywhere in it (deferred imports too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
    return names


def test_the_serve_modules_import_no_circle():
    graph = {path.stem: _imports(path) for path in SERVE_DIR.glob("*.py")}
    graph = {module: {m for m in imported if m in graph} for module, imported in graph.items()}

    def reaches(start: str, target: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for m in graph[todo.pop()]:
                if m == target:
                    return True
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        return False

    circles = [m for m in graph if m != "__init__" and reaches(m, m)]
    assert not circles, {m: graph[m] for m in circles}


def test_prepare_batch_costs_is_public_and_checks_its_argument(engine):
    costs = engine.prepare_batch_costs(4)
    assert len(costs["verify_cost_ratios"]) >= 4 and costs["verify_cost_ratios"][0] == 1.0
    for bad in (1, 2.5, True, "8"):
        with pytest.raises(specrs.ConfigError, match="max_rows"):
            engine.prepare_batch_costs(bad)


def test_the_server_and_the_engine_check_the_context_with_one_message(engine):
    context = engine.info()["context_length"]
    speculation = protocol.ServerSpeculation(None)
    # The prompt alone fills the context: refused naming the prompt, before max_tokens is read.
    ids = [1] * context
    with pytest.raises(specrs.ContextLengthError) as by_engine:
        engine.check_context(len(ids))
    with pytest.raises(protocol.APIError) as by_server:
        protocol.parse_request("completion", {"prompt": ids, "max_tokens": 1}, engine, "m", speculation)
    assert by_server.value.message == str(by_engine.value) and "leaves no room" in str(by_engine.value)
    assert (by_server.value.param, by_server.value.code) == ("prompt", "context_length_exceeded")
    # Prompt + max_completion_tokens past it: refused naming that field, in the engine's words.
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": context}
    with pytest.raises(protocol.APIError) as by_server:
        protocol.parse_request("chat", body, engine, "m", speculation)
    assert (by_server.value.param, by_server.value.code) == ("max_completion_tokens", "context_length_exceeded")
    prompt_len = int(re.search(r"\((\d+) in the prompt", by_server.value.message).group(1))
    with pytest.raises(specrs.ContextLengthError) as by_engine:
        engine.check_context(prompt_len, context, "max_completion_tokens")
    assert by_server.value.message == str(by_engine.value)
    assert "lower max_completion_tokens" in str(by_engine.value)
    # The Python API's check is the same one.
    with pytest.raises(specrs.ContextLengthError, match=f"\\(3 in the prompt, {context} in max_tokens\\)"):
        engine.generate([1, 2, 3], specrs.SamplingParams(max_tokens=context))


def test_auto_uses_the_servers_draft_model_and_no_other_weights_over_http():
    """"auto" loads its draft as draft_model does (the core's weights say so), so a server started
    with a draft model lets requests pick it inside "auto"; "auto" without one loads nothing."""
    startup = json.loads(engine_module._config_json({"method": "draft_model", "model": "d.gguf",
                                                      "num_speculative_tokens": 4}))
    speculation = protocol.ServerSpeculation(startup)
    assert speculation.for_request({"method": "auto", "model": "d.gguf"}).method == "auto"
    assert speculation.for_request({"method": "auto"}).method == "auto"
    assert protocol.ServerSpeculation(None).for_request({"method": "auto"}).method == "auto"
    with pytest.raises(protocol.APIError, match="loads weights") as refused:
        speculation.for_request({"method": "auto", "model": "/etc/passwd"})
    assert "/etc/passwd" not in refused.value.message
