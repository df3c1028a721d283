"""specrs: speculative-decoding LLM inference with a Rust core."""

from ._specrs import __version__
from .engine import (
    Engine,
    GenerationResult,
    SamplingParams,
    SequenceForward,
    SpeculativeConfig,
    TextStream,
    Tokenizer,
    expected_speedup,
    requantize,
)
from .errors import (
    ConfigError,
    ContextLengthError,
    DeviceError,
    ModelLoadError,
    ProposerError,
    SpecrsError,
    TokenizerMismatchError,
)
from .models import default_model_path

__all__ = [
    "Engine",
    "SamplingParams",
    "GenerationResult",
    "SequenceForward",
    "SpeculativeConfig",
    "TextStream",
    "Tokenizer",
    "SpecrsError",
    "ModelLoadError",
    "ConfigError",
    "ContextLengthError",
    "DeviceError",
    "ProposerError",
    "TokenizerMismatchError",
    "expected_speedup",
    "requantize",
    "default_model_path",
    "__version__",
]
