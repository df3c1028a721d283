"""benches/code_workload.py: the code workload's generator (prompts from the standard library's
functions) and the committed benches/code_workload.jsonl it writes. No model: the prompts are
checked against the stdlib source, parsed independently here."""

import ast
import importlib.util
import io
import json
import os
import platform
import re
import sys
import sysconfig
import tokenize

import pytest

BENCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benches")
COMMITTED = os.path.join(BENCHES, "code_workload.jsonl")
PER_CATEGORY = 4


def load_benches_module(name):
    if BENCHES not in sys.path:
        sys.path.insert(0, BENCHES)  # spec_bench and its importers find each other this way
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator():
    return load_benches_module("code_workload")


@pytest.fixture(scope="module")
def generated(generator, tmp_path_factory):
    out = tmp_path_factory.mktemp("code") / "code.jsonl"
    assert generator.main(["--per-category", str(PER_CATEGORY), "--out", str(out)]) == 0
    return out


def rows_of(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def code_block(prompt):
    blocks = re.findall(r"```python\n(.*?)\n```", prompt, re.S)
    assert len(blocks) == 1, prompt
    return blocks[0]


def stdlib_function(source):
    """The ast node and source lines of "module.py:Qualname" in the running Python's stdlib."""
    module, qualname = source.split(":")
    text = open(os.path.join(sysconfig.get_paths()["stdlib"], module), encoding="utf-8").read()
    scope = ast.parse(text).body
    *owners, name = qualname.split(".")
    for owner in owners:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    return node, text.splitlines()


def identifiers(code):
    return [t.string for t in tokenize.generate_tokens(io.StringIO(code + "\n").readline) if t.type == tokenize.NAME]


def test_every_category_has_its_prompts_in_spec_bench_shape(generator, generated):
    rows = rows_of(generated)
    assert [r["category"] for r in rows] == [c for c in generator.CATEGORIES for _ in range(PER_CATEGORY)]
    assert set(generator.CATEGORIES) == {"complete_function", "add_type_hints", "rename_variable",
                                         "write_docstring", "explain_code"}
    assert [r["question_id"] for r in rows] == list(range(1, len(rows) + 1))
    assert len({r["source"] for r in rows}) == len(rows), "each function is used once"
    for row in rows:
        assert row["python_version"] == platform.python_version()
        assert len(row["turns"]) == 1 and row["turns"][0].strip()
        code = code_block(row["turns"][0])
        tree = ast.parse(code)  # every prompt's code is valid Python
        assert len(tree.body) == 1 and isinstance(tree.body[0], ast.FunctionDef)
        assert tree.body[0].name == row["source"].split(":")[1].split(".")[-1]


def test_complete_function_gives_signature_and_docstring_but_not_the_body(generated):
    rows = [r for r in rows_of(generated) if r["category"] == "complete_function"]
    assert len(rows) == PER_CATEGORY
    for row in rows:
        prompt = row["turns"][0]
        node, lines = stdlib_function(row["source"])
        doc, body = node.body[0], node.body[1:]
        assert ast.get_docstring(node) is not None and body
        assert lines[node.lineno - 1].strip() in prompt  # the `def` line
        for line in lines[doc.lineno - 1: doc.end_lineno]:
            assert line.strip() in prompt  # the docstring, every line
        prompt_lines = {line.strip() for line in prompt.splitlines()}
        body_lines = [line.strip() for line in lines[body[0].lineno - 1: node.end_lineno] if line.strip()]
        assert body_lines[0] not in prompt_lines
        assert not [line for line in body_lines if len(line) >= 20 and line in prompt_lines]
        # The code block is the function up to its docstring: nothing after it.
        assert len(ast.parse(code_block(prompt)).body[0].body) == 1


def test_rename_variable_names_a_local_variable_of_the_function(generated):
    rows = [r for r in rows_of(generated) if r["category"] == "rename_variable"]
    assert len(rows) == PER_CATEGORY
    for row in rows:
        old, new = row["rename"]["from"], row["rename"]["to"]
        prompt = row["turns"][0]
        assert f"`{old}`" in prompt and f"`{new}`" in prompt
        code = code_block(prompt)
        fn = ast.parse(code).body[0]
        stored = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        params = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        assert old in stored and old not in params
        names = identifiers(code)
        assert names.count(old) >= 3 and new not in names
        # Every occurrence of the identifier is the variable: the rename is unambiguous.
        assert names.count(old) == sum(1 for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == old)


def test_add_type_hints_and_write_docstring_start_without_them(generated):
    rows = rows_of(generated)
    for row in rows:
        fn = ast.parse(code_block(row["turns"][0])).body[0]
        if row["category"] == "add_type_hints":
            args = [a for a in ast.walk(fn.args) if isinstance(a, ast.arg)]
            assert fn.returns is None and all(a.annotation is None for a in args)
            assert [a for a in args if a.arg not in ("self", "cls")]
        elif row["category"] == "write_docstring":
            assert ast.get_docstring(fn) is None
            node, _ = stdlib_function(row["source"])
            assert len(fn.body) == len(node.body) - (ast.get_docstring(node) is not None)


def test_two_runs_write_the_same_file(generator, generated, tmp_path):
    again = tmp_path / "again.jsonl"
    assert generator.main(["--per-category", str(PER_CATEGORY), "--out", str(again)]) == 0
    assert again.read_bytes() == generated.read_bytes()
    other_seed = tmp_path / "seed1.jsonl"
    assert generator.main(["--per-category", str(PER_CATEGORY), "--seed", "1", "--out", str(other_seed)]) == 0
    assert {r["source"] for r in rows_of(other_seed)} != {r["source"] for r in rows_of(generated)}


def test_committed_file_is_the_generators_output(generator, tmp_path):
    committed = rows_of(COMMITTED)
    version = committed[0]["python_version"]
    if version != platform.python_version():
        pytest.skip(f"benches/code_workload.jsonl was generated by Python {version}, this is "
                    f"{platform.python_version()}: its stdlib source differs")
    out = tmp_path / "default.jsonl"
    assert generator.main(["--out", str(out)]) == 0  # the defaults wrote the committed file
    assert out.read_bytes() == open(COMMITTED, "rb").read()


def test_bad_per_category_is_refused(generator, tmp_path, capsys):
    for value in ("0", "100000"):
        with pytest.raises(SystemExit) as exc:
            generator.main(["--per-category", value, "--out", str(tmp_path / "x.jsonl")])
        assert exc.value.code == 2
        assert "--per-category" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_spec_bench_selects_the_code_workloads_own_categories(generator, generated):
    """spec_bench.select_prompts (shared by draft, tree, heads and head_cost benches) takes a file
    without Spec-Bench's categories by its own categories, not as an empty selection."""
    spec_bench = load_benches_module("spec_bench")
    prompts = spec_bench.select_prompts(str(generated), 2, "group")
    assert [p["category"] for p in prompts] == [c for c in generator.CATEGORIES for _ in range(2)]
    rows = {r["question_id"]: r for r in rows_of(generated)}
    assert all(p["content"] == rows[p["question_id"]]["turns"][0] for p in prompts)
