"""README.md runs as written: every ```python and ```bash block in it is executed here.

A block runs as it stands unless the line before its opening fence (blank lines aside) marks it:

    <!-- readme-test: skip (why) -->    not run; the reason is required and shows as the skip reason
                                         (needs a GPU, installs packages, takes hours, your own files)
    <!-- readme-test: continues -->      a python block run in the namespace the python block before it
                                         left (the README's flow: `engine` from the block above)
    <!-- readme-test: serves -->         a bash block that starts `specrs serve`: run in the
                                         background, on a free port written over its `8000`, until
                                         /health answers; stopped after the module
    <!-- readme-test: server -->         a block that talks to that server (its `127.0.0.1:8000` and
                                         `localhost:8000` rewritten to the server's port)

Python blocks run in this process (`exec`, the traceback names README.md and the line); bash
blocks in `bash -euo pipefail` in a temporary directory, with this interpreter's bin first on
PATH (so `specrs` and `python` are this venv's). The blocks are found anew on each run, so the
test follows whatever README.md holds; an unknown mark, or a skip without a reason, fails.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = re.compile(r"^<!--\s*readme-test:\s*([a-z-]+)\s*(?:\((.*)\))?\s*-->$")
MARKS = ("skip", "continues", "serves", "server")
FENCE = re.compile(r"^```(\S*)\s*$")
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
SERVER_START_TIMEOUT_S = 300
BASH_TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    language: str  # "python", "bash", or what the fence says for blocks that are not run
    code: str
    mark: str | None
    reason: str | None
    mark_text: str | None  # the comment as written (to report a bad one)

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.language}"


def parse(text: str) -> list[Block]:
    """Every fenced block of `text` with the mark before it."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        start, language = i, opening.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before) if before.startswith("<!--") else None
        blocks.append(Block(start + 1, LANGUAGES.get(language, language), "\n".join(lines[start + 1:i]) + "\n",
                            mark.group(1) if mark else None, mark.group(2) if mark else None,
                            before if before.startswith("<!--") and "readme-test" in before else None))
        i += 1
    return blocks


BLOCKS = parse(README.read_text(encoding="utf-8"))
RUNNABLE = [b for b in BLOCKS if b.language in ("python", "bash")]


def test_the_readme_has_blocks_and_every_mark_is_known():
    assert len(RUNNABLE) >= 10, "README.md lost its examples, or the parser lost them"
    for block in BLOCKS:
        if block.mark_text is not None:
            assert block.mark in MARKS, f"README.md:{block.line}: unknown mark {block.mark_text!r}; use one of {MARKS}"
        if block.mark == "skip":
            assert block.reason, f"README.md:{block.line}: a skipped block says why: `<!-- readme-test: skip (why) -->`"
        if block.mark == "continues":
            assert block.language == "python" and _previous_python(block) is not None, \
                f"README.md:{block.line}: `continues` needs a python block before it"
        if block.mark == "serves":
            assert block.language == "bash", f"README.md:{block.line}: `serves` marks a bash block"
    assert len([b for b in BLOCKS if b.mark == "serves"]) <= 1, "one block starts the README's server"


def test_the_parser_reads_marks_and_fences():
    text = ("<!-- readme-test: skip (needs a GPU) -->\n```python\nx = 1\n```\n\n"
            "<!-- readme-test: continues -->\n\n```bash\necho hi\n```\n```\nplain\n```\n")
    gpu, bash, plain = parse(text)
    assert (gpu.line, gpu.language, gpu.code, gpu.mark, gpu.reason) == (2, "python", "x = 1\n", "skip", "needs a GPU")
    assert (bash.line, bash.language, bash.mark) == (8, "bash", "continues")
    assert (plain.language, plain.mark) == ("", None)


def _previous_python(block: Block) -> Block | None:
    earlier = [b for b in BLOCKS if b.language == "python" and b.line < block.line]
    return earlier[-1] if earlier else None


# --- the server the `server` blocks talk to ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


def _with_port(code: str, port: int | None) -> str:
    if port is None:
        return code
    for host in ("127.0.0.1", "localhost"):
        code = code.replace(f"{host}:8000", f"{host}:{port}")
    return re.sub(r"--port\s+8000\b", f"--port {port}", code)


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's own `specrs serve` block, running; yields its port."""
    import httpx

    serves = [b for b in BLOCKS if b.mark == "serves"]
    if not serves:
        pytest.fail("a block is marked `server` but none `serves`: mark the README's `specrs serve` block")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("readme-serve") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", _with_port(serves[0].code, port)],
                                cwd=log_path.parent, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.time() + SERVER_START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"README.md:{serves[0].line} did not start a server:\n{log_path.read_text()}")
        time.sleep(0.3)
    yield port
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


# --- running blocks ----------------------------------------------------------------------------

_namespaces: dict[int, dict] = {}  # python block line -> the namespace it left


def _run_python(block: Block, port: int | None) -> dict:
    """Runs a python block (and, for `continues`, the chain before it, once) and returns its namespace."""
    if block.line in _namespaces:
        return _namespaces[block.line]
    namespace: dict = {"__name__": "__readme__"}
    if block.mark == "continues":
        previous = _previous_python(block)
        assert previous is not None and previous.mark != "skip", \
            f"README.md:{block.line} continues README.md:{previous.line if previous else '?'}, which is not run"
        namespace = _run_python(previous, port)
    code = compile("\n" * (block.line) + _with_port(block.code, port), str(README), "exec")
    exec(code, namespace)
    _namespaces[block.line] = namespace
    return namespace


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.mark != "serves"], ids=lambda b: b.id)
def test_readme_block(block: Block, request, tmp_path):
    if block.mark == "skip":
        pytest.skip(f"README.md:{block.line}: {block.reason}")
    port = request.getfixturevalue("readme_server") if block.mark == "server" else None
    if block.language == "python":
        _run_python(block, port)
        return
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", _with_port(block.code, port)], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=BASH_TIMEOUT_S)
    assert done.returncode == 0, (f"README.md:{block.line} exited {done.returncode}:\n{block.code}\n"
                                  f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.mark == "serves"], ids=lambda b: b.id)
def test_readme_server_block_serves(block: Block, readme_server):
    import httpx

    assert httpx.get(f"http://127.0.0.1:{readme_server}/health", timeout=5).status_code == 200
