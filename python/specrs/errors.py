"""specrs exceptions. Every error raised by the engine is a SpecrsError; the Rust core picks the
class in crates/specrs-py/src/errors.rs."""


class SpecrsError(Exception):
    """Base class of every specrs error."""


class ModelLoadError(SpecrsError):
    """The model file is missing, corrupt, truncated or of an unsupported architecture."""


class TokenizerMismatchError(ModelLoadError):
    """A draft model's tokenizer differs from the target's; the message names the first differing
    token id and both strings."""


class ConfigError(SpecrsError, ValueError):
    """An invalid setting: sampling parameter, device name, config key or value."""


class ContextLengthError(SpecrsError, ValueError):
    """The prompt plus max_tokens does not fit in the model's context window."""


class DeviceError(SpecrsError):
    """The requested device is not available in this build or on this machine."""


class ProposerError(SpecrsError):
    """A proposer failed: a custom proposer raised or returned an invalid draft."""


__all__ = ["SpecrsError", "ModelLoadError", "TokenizerMismatchError", "ConfigError", "ContextLengthError", "DeviceError", "ProposerError"]
