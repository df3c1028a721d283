"""specrs: speculative-decoding LLM inference with a Rust core."""

from ._specrs import __version__
from .engine import Engine, GenerationResult, SamplingParams, TextStream, Tokenizer
from .errors import ConfigError, ContextLengthError, DeviceError, ModelLoadError, SpecrsError
from .models import default_model_path

__all__ = [
    "Engine",
    "SamplingParams",
    "GenerationResult",
    "TextStream",
    "Tokenizer",
    "SpecrsError",
    "ModelLoadError",
    "ConfigError",
    "ContextLengthError",
    "DeviceError",
    "default_model_path",
    "__version__",
]
