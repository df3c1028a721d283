"""The code workload: prompts built from functions of the running Python's standard library, in
Spec-Bench's question.jsonl shape, for the benches that take `--prompts` (spec_bench.py and the
scripts sharing its `select_prompts`, and `specrs bench`).

Code completion, editing and explanation are where speculation pays most: an edit copies most of
its input, and a completion repeats the names of its signature and docstring. Five categories,
each function used once across all of them:
- complete_function: the signature and docstring; the model writes the body (the body is absent).
- add_type_hints: a whole function without annotations; the model adds them.
- rename_variable: a whole function; the model renames one local variable throughout (the answer
  is mostly a copy of the input).
- write_docstring: a whole function, its own docstring removed; the model writes one.
- explain_code: a whole function; the model explains it.

Selection (deterministic for a given Python version; every row records it in `python_version`):
module-level functions and methods of module-level classes of the modules in MODULES, 8 to 40
lines with decorators, 4 or more of them after the docstring, sorted by (module, line), shuffled with `--seed`, then each category in
order takes the first functions that qualify for it and are not taken yet, at most
MAX_PER_MODULE per module and category. Modules missing from the running Python are skipped (and
named on stderr). Rows: question_id, category, turns (one prompt), source ("module.py:Qualname"),
python_version, and for rename_variable {"from", "to"} in `rename`.

    python benches/code_workload.py                       # writes benches/code_workload.jsonl
    python benches/code_workload.py --per-category 4 --out /tmp/code.jsonl

No specrs import: any Python runs it.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import json
import keyword
import os
import platform
import random
import sys
import sysconfig
import tokenize
from dataclasses import dataclass

# Pure-Python standard library modules present from Python 3.9 to 3.13, as paths under the stdlib
# directory (reading files, not importing, so nothing runs and nothing is missing for lack of a
# C extension).
MODULES = (
    "argparse.py", "base64.py", "bisect.py", "calendar.py", "cmd.py", "colorsys.py",
    "configparser.py", "copy.py", "csv.py", "dataclasses.py", "difflib.py", "email/_parseaddr.py",
    "email/utils.py", "fnmatch.py", "fractions.py", "functools.py", "getopt.py", "gettext.py",
    "glob.py", "heapq.py", "html/__init__.py", "http/cookies.py", "ipaddress.py", "json/decoder.py",
    "json/encoder.py", "locale.py", "logging/__init__.py", "mimetypes.py", "netrc.py", "ntpath.py",
    "optparse.py", "platform.py", "posixpath.py", "pprint.py", "queue.py", "quopri.py", "random.py",
    "reprlib.py", "sched.py", "shlex.py", "shutil.py", "statistics.py", "string.py", "tarfile.py",
    "textwrap.py", "tokenize.py", "urllib/parse.py", "uuid.py",
)
CATEGORIES = ("complete_function", "add_type_hints", "rename_variable", "write_docstring", "explain_code")
MIN_LINES, MAX_LINES = 8, 40
# Lines after the docstring: a body worth completing, documenting or explaining.
MIN_BODY_LINES = 4
# Spread each category over the modules rather than over the largest ones.
MAX_PER_MODULE = 2
# A rename needs a variable used often enough that the edit is more than one token.
MIN_RENAME_USES = 3
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_workload.jsonl")

# Descriptive new names for common short ones; any other name `x` becomes `local_x`.
RENAMES = {
    "i": "index", "j": "inner_index", "k": "key", "v": "value", "n": "count", "s": "text", "c": "char",
    "x": "item", "p": "part", "m": "match", "a": "first", "b": "second", "d": "mapping", "e": "error",
    "f": "file_obj", "l": "items", "t": "token", "w": "width", "res": "result", "ret": "retval",
    "buf": "buffer", "val": "value", "msg": "message", "idx": "index", "tmp": "temporary", "cnt": "count",
    "pos": "position", "lst": "items", "num": "number", "ch": "char", "sep": "separator",
}


@dataclass
class Function:
    module: str            # path under the stdlib directory, e.g. "json/decoder.py"
    qualname: str          # "name" or "Class.name"
    lineno: int            # first line (its first decorator's, if any)
    node: ast.FunctionDef
    lines: list[str]       # the function's source lines, dedented to column 0, without newlines

    @property
    def module_name(self) -> str:
        name = self.module[:-3].replace("/", ".")
        return name[: -len(".__init__")] if name.endswith(".__init__") else name

    @property
    def source(self) -> str:
        return f"{self.module}:{self.qualname}"

    def text(self, first: int | None = None, last: int | None = None) -> str:
        """Source lines `first`..`last` (file line numbers, inclusive), default all."""
        first = self.lineno if first is None else first
        last = self.node.end_lineno if last is None else last
        return "\n".join(self.lines[first - self.lineno: last - self.lineno + 1])

    def docstring_node(self) -> ast.Expr | None:
        return _docstring_of(self.node)


def _docstring_of(node: ast.FunctionDef) -> ast.Expr | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def read_functions(stdlib: str, modules: tuple[str, ...] = MODULES) -> tuple[list[Function], list[str]]:
    """Every function of `modules` that is MIN_LINES..MAX_LINES long, MIN_BODY_LINES or more after
    its docstring, and whose lines all carry its own indentation (so cutting it off leaves every
    line whole); and the modules not found."""
    functions, missing = [], []
    for module in modules:
        path = os.path.join(stdlib, module)
        if not os.path.isfile(path):
            missing.append(module)
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        file_lines = source.splitlines()
        tree = ast.parse(source, filename=path)
        for owner, node in _functions_of(tree):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if not MIN_LINES <= node.end_lineno - first + 1 <= MAX_LINES:
                continue
            code = node.body[1:] if _docstring_of(node) is not None else node.body
            if not code or node.end_lineno - code[0].lineno + 1 < MIN_BODY_LINES:
                continue
            indent = " " * node.col_offset
            raw = file_lines[first - 1: node.end_lineno]
            if any(line.strip() and not line.startswith(indent) for line in raw):
                continue
            lines = [line[len(indent):] if line.strip() else "" for line in raw]
            qualname = f"{owner}.{node.name}" if owner else node.name
            functions.append(Function(module, qualname, first, node, lines))
    functions.sort(key=lambda fn: (fn.module, fn.lineno))
    return functions, missing


def _functions_of(tree: ast.Module):
    """(class name or None, function) for module-level functions and methods of module-level classes."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield None, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield node.name, item


def _fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def _where(fn: Function) -> str:
    if "." in fn.qualname:
        owner, name = fn.qualname.split(".", 1)
        return f"the method `{name}` of class `{owner}` in Python's `{fn.module_name}` module"
    return f"the function `{fn.qualname}` from Python's `{fn.module_name}` module"


def complete_function(fn: Function) -> dict | None:
    """Signature and docstring, without the body; only where the docstring has lines of its own
    and does not quote a body line (that would hand the model its answer)."""
    doc = fn.docstring_node()
    if doc is None or doc.lineno == fn.node.lineno:
        return None
    body_first = fn.node.body[1].lineno
    if body_first <= doc.end_lineno:
        return None
    docstring = fn.text(doc.lineno, doc.end_lineno)
    body = fn.text(body_first)
    if any(len(line.strip()) >= 20 and line.strip() in docstring for line in body.splitlines()):
        return None
    head = fn.text(fn.lineno, doc.end_lineno)
    prompt = (f"Complete {_where(fn)}. Its signature and docstring are below; write the body so "
              "that it does what the docstring says. Reply with the whole function in one Python code "
              f"block.\n\n{_fenced(head)}")
    return {"turns": [prompt]}


def add_type_hints(fn: Function) -> dict | None:
    """A function without any annotation and with a parameter besides self/cls."""
    args = fn.node.args
    params = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    if fn.node.returns is not None or any(p.annotation is not None for p in params):
        return None
    if not [p for p in params if p.arg not in ("self", "cls")]:
        return None
    prompt = (f"Add type hints to {_where(fn)}: annotate every parameter and the return value, and "
              "change nothing else. Reply with the whole function in one Python code block.\n\n"
              f"{_fenced(fn.text())}")
    return {"turns": [prompt]}


def rename_target(fn: Function) -> tuple[str, str] | None:
    """The local variable to rename and its new name: a name the function assigns (not a
    parameter, global or nonlocal) used MIN_RENAME_USES times or more, whose every occurrence as
    an identifier in the source is that variable (no attribute, keyword argument or inner
    parameter of the same spelling), so the rename is unambiguous. The most used, then the first
    alphabetically."""
    args = fn.node.args
    params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg] if a}
    declared = {n for node in ast.walk(fn.node) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    uses: dict[str, int] = {}
    stored = set()
    for node in ast.walk(fn.node):
        if isinstance(node, ast.Name):
            uses[node.id] = uses.get(node.id, 0) + 1
            if isinstance(node.ctx, ast.Store):
                stored.add(node.id)
    identifiers = _identifier_counts(fn.text())
    candidates = sorted((-uses[name], name) for name in stored - params - declared
                        if uses[name] >= MIN_RENAME_USES and identifiers.get(name) == uses[name])
    for _, name in candidates:
        new = RENAMES.get(name, f"local_{name}")
        if new not in identifiers and not keyword.iskeyword(new) and not hasattr(builtins, new):
            return name, new
    return None


def _identifier_counts(code: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for token in tokenize.generate_tokens(io.StringIO(code + "\n").readline):
        if token.type == tokenize.NAME:
            counts[token.string] = counts.get(token.string, 0) + 1
    return counts


def rename_variable(fn: Function) -> dict | None:
    target = rename_target(fn)
    if target is None:
        return None
    old, new = target
    prompt = (f"In {_where(fn)}, rename the local variable `{old}` to `{new}` everywhere it is used. "
              "Change nothing else. Reply with the whole function in one Python code block.\n\n"
              f"{_fenced(fn.text())}")
    return {"turns": [prompt], "rename": {"from": old, "to": new}}


def write_docstring(fn: Function) -> dict | None:
    """The function with its docstring removed (whole lines only), or as it is if it has none."""
    doc = fn.docstring_node()
    if doc is None:
        code = fn.text()
    else:
        if doc.lineno == fn.node.lineno or fn.node.body[1].lineno <= doc.end_lineno:
            return None
        code = fn.text(fn.lineno, doc.lineno - 1) + "\n" + fn.text(doc.end_lineno + 1)
    prompt = (f"Write a docstring for {_where(fn)}: what it does, its parameters and what it returns "
              "or raises. Reply with the whole function, docstring included, in one Python code block."
              f"\n\n{_fenced(code)}")
    return {"turns": [prompt]}


def explain_code(fn: Function) -> dict | None:
    prompt = (f"Explain what {_where(fn)} does, step by step, and name the edge cases it handles.\n\n"
              f"{_fenced(fn.text())}")
    return {"turns": [prompt]}


BUILDERS = {
    "complete_function": complete_function,
    "add_type_hints": add_type_hints,
    "rename_variable": rename_variable,
    "write_docstring": write_docstring,
    "explain_code": explain_code,
}


def python_version() -> str:
    return platform.python_version()


def build(per_category: int, seed: int, stdlib: str | None = None) -> tuple[list[dict], list[str]]:
    """The workload's rows (CATEGORIES order, question_id from 1) and the modules not found."""
    if per_category < 1:
        raise ValueError(f"per_category must be at least 1, got {per_category}")
    functions, missing = read_functions(stdlib or stdlib_dir())
    order = list(functions)
    random.Random(seed).shuffle(order)
    taken: set[str] = set()
    rows: list[dict] = []
    version = python_version()
    for category in CATEGORIES:
        per_module: dict[str, int] = {}
        count = 0
        for fn in order:
            if count == per_category:
                break
            if fn.source in taken or per_module.get(fn.module, 0) >= MAX_PER_MODULE:
                continue
            built = BUILDERS[category](fn)
            if built is None:
                continue
            taken.add(fn.source)
            per_module[fn.module] = per_module.get(fn.module, 0) + 1
            count += 1
            rows.append({"question_id": len(rows) + 1, "category": category, "turns": built.pop("turns"),
                         "source": fn.source, "python_version": version, **built})
        if count < per_category:
            raise ValueError(f"only {count} functions qualify for {category}, {per_category} asked; "
                             "lower --per-category")
    return rows, missing


def write(rows: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSONL path (default: benches/code_workload.jsonl)")
    ap.add_argument("--per-category", type=int, default=16, help="prompts per category (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed of the function order (default 0)")
    args = ap.parse_args(argv)
    if args.per_category < 1:
        ap.error(f"--per-category must be at least 1, got {args.per_category}")
    try:
        rows, missing = build(args.per_category, args.seed)
    except ValueError as e:
        ap.error(str(e))
    if missing:
        print(f"not in this Python ({python_version()}), skipped: {', '.join(missing)}", file=sys.stderr)
    write(rows, args.out)
    print(f"{len(rows)} prompts ({args.per_category} per category: {', '.join(CATEGORIES)}) from Python "
          f"{python_version()}'s standard library -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
