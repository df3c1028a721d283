"""Every third-party import of python/specrs is declared in the extra of the command that runs it
(pyproject.toml, python/specrs/extras.py and the Makefile's DEPS agree), and each command checks
its extra before it loads a model: a missing package is a ConfigError naming the `pip install`,
not a ModuleNotFoundError after the model loaded. (tests/test_install_extras.py installs each extra
into a clean venv and runs the commands.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from specrs import cli, extras
from specrs.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "specrs"
# Which extra a source file's imports belong to (the first prefix that matches; others: the base).
OWNERS = [("serve/ray/", "ray"), ("serve/", "serve"), ("train/", "train"), ("bench.py", "plot")]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    """The distribution a requirement string names (`ray[serve]>=2.50` -> `ray`), normalized."""
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _third_party_imports(path: Path) -> set[str]:
    """The modules `path` imports that are neither the standard library nor specrs (dotted, as
    written), wherever they are imported (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] not in sys.stdlib_module_names and n.split(".")[0] != "specrs")
    return found


def _owner(path: Path) -> str | None:
    relative = path.relative_to(PACKAGE).as_posix()
    return next((extra for prefix, extra in OWNERS if relative.startswith(prefix)), None)


def test_every_import_is_declared_in_the_extra_of_the_code_that_imports_it():
    base = {_name(r) for r in _pyproject()["project"]["dependencies"]}
    undeclared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        extra = _owner(path)
        declared = {m.split(".")[0] for m in extras.MODULES[extra]} if extra else set()
        for module in _third_party_imports(path):
            top = module.split(".")[0]
            if top.replace("_", "-") not in base and top not in declared:
                undeclared.append(f"{path.relative_to(ROOT)}: {module} (extra: {extra or 'none, the base'})")
    assert not undeclared, "imports no extra declares:\n" + "\n".join(undeclared)


def test_the_scan_sees_lazy_imports():
    # Imports inside functions count: serve/__init__.py imports uvicorn only in serve(), bench.py
    # matplotlib only when plotting.
    assert "uvicorn" in _third_party_imports(PACKAGE / "serve" / "__init__.py")
    assert "matplotlib.pyplot" in _third_party_imports(PACKAGE / "bench.py")
    assert "jsonschema" in _third_party_imports(PACKAGE / "serve" / "tools.py")


def test_extras_name_what_pyproject_installs_and_the_makefile_installs_them_too():
    optional = _pyproject()["project"]["optional-dependencies"]
    makefile = (ROOT / "Makefile").read_text()
    deps = re.search(r"^DEPS := (.*?)\n\n", makefile, re.S | re.M)
    assert deps is not None, "the Makefile's DEPS"
    dev = set(re.findall(r'"([^"]+)"', deps.group(1)))
    for extra, modules in extras.MODULES.items():
        assert extra in optional, f"pyproject.toml has no `{extra}` extra"
        names = {_name(r) for r in optional[extra]}
        for module, distribution in modules.items():
            assert distribution in names, f"`{module}` ({distribution}) is not in pyproject's `{extra}` extra"
        missing = [r for r in optional[extra] if r not in dev]
        assert not missing, f"the Makefile's DEPS lacks {missing} of the `{extra}` extra"


def _hide(monkeypatch, *modules: str) -> None:
    """Makes `import module` raise ImportError, as in a Python without that package."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_a_missing_package_names_the_extra_to_install(monkeypatch):
    _hide(monkeypatch, "jsonschema")
    assert extras.missing("serve") == ["jsonschema"]
    with pytest.raises(ConfigError, match=r"specrs serve needs jsonschema.*pip install starlette uvicorn prometheus-client jsonschema"):
        extras.require("serve", "specrs serve")
    extras.require("train", "specrs train-head eagle3")  # this Python has the rest


@pytest.mark.parametrize(("argv", "hidden", "extra"), [
    (["serve", "/nonexistent/model.gguf"], ["jsonschema"], "serve"),
    (["serve", "--ray", "/nonexistent/model.gguf"], ["ray", "ray.serve"], "ray"),
    (["serve", "--ray", "/nonexistent/model.gguf"], ["jsonschema"], "ray"),
    (["train-head", "eagle3", "--features", "/nonexistent/features", "--out", "/nonexistent/head", "--target",
      "/nonexistent/model.gguf"], ["torch"], "train"),
    (["train-head", "mlp_speculator", "--features", "/nonexistent/features", "--out", "/nonexistent/head"], ["tqdm"],
     "train"),
    (["bench", "--prompts", "/nonexistent/prompts.jsonl", "--plot", "out.png"], ["matplotlib"], "plot"),
], ids=["serve", "ray-without-ray", "ray-without-jsonschema", "eagle3", "mlp_speculator", "bench-plot"])
def test_each_command_checks_its_extra_before_loading_anything(monkeypatch, capsys, argv, hidden, extra):
    """The model path (or prompts file) does not exist, so a command that got past its check would
    fail on that instead; `specrs serve` without jsonschema used to load the model and then crash."""
    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)  # `serve --ray` sets it
    # The extra's other modules imported first, whole: importing Ray with jsonschema hidden would
    # leave a half-imported Ray behind for later tests.
    for module in extras.MODULES[extra]:
        if module.split(".")[0] not in hidden:
            pytest.importorskip(module)
    _hide(monkeypatch, *hidden)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert hidden[-1] in err and extras.install_command(extra) in err, err
    assert "nonexistent" not in err, err


def test_the_cli_imports_without_any_extra():
    """`import specrs.cli` (what every command's entry point runs first) needs only the base
    packages: a module-level import of an extra's package there (serve/tools.py's jsonschema, once)
    breaks even `specrs generate` on a plain install. Checked in a fresh interpreter in which every
    extra's modules fail to import."""
    hidden = sorted({m.split(".")[0] for modules in extras.MODULES.values() for m in modules})
    code = ("import sys\n"
            f"for m in {hidden!r}: sys.modules[m] = None\n"
            "from specrs import cli\n"
            "import specrs.serve.protocol, specrs.serve.tools\n"
            "raise SystemExit(cli.main(['generate', '--help']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--prompt" in run.stdout
