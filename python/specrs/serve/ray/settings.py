"""What every engine replica of `specrs serve --ray` runs: `specrs serve`'s settings, plus how
often it exchanges suffix responses and reports to the coordinator. Importing it needs no Ray, so
the command line can check a configuration before Ray starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...engine import (DEFAULT_CUDA_GRAPH_MEMORY_MB, DEFAULT_DRAFT_BUDGET, DEFAULT_KV_BLOCK_SIZE,
                       DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS)
from ..connections import DEFAULT_BODY_TIMEOUT_S
from ..protocol import DEFAULT_CHAT_MAX_TOKENS

# How often a replica publishes and pulls shared suffix responses (suffix_share.py), and reports its
# health and metrics (replica_board.py).
DEFAULT_SHARE_INTERVAL_S = 1.0
DEFAULT_REPORT_INTERVAL_S = 1.0


@dataclass
class ReplicaSettings:
    """What every engine replica runs: `specrs serve`'s settings (the HTTP ones are the ingress's)."""

    model: str | None = None
    speculative_config: Any = None
    device: str = "cpu"
    max_model_len: int | None = None
    generation_config: str = "auto"
    override_generation_config: Any = None
    served_model_name: str | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_kv_tokens: int | None = None
    prefill_chunk: int | None = 64
    draft_budget: str = DEFAULT_DRAFT_BUDGET
    max_request_body_bytes: int = 8 * 1024 * 1024
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    suffix_cache: str | None = None
    suffix_cache_save_every: int = 100
    suffix_cache_start_empty_on_error: bool = False
    share_suffix_cache: bool = True
    share_interval_s: float = DEFAULT_SHARE_INTERVAL_S
    report_interval_s: float = DEFAULT_REPORT_INTERVAL_S
    # Enforced by the ingress (deployments.Ingress), the one HTTP entry point; replicas are reached
    # through it only.
    api_key: str | None = None
    metrics_public: bool = False
    body_timeout_s: float | None = DEFAULT_BODY_TIMEOUT_S
    allow_special_tokens_in_content: bool = False
    kv_layout: str = "auto"
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    enforce_eager: bool = False
    cuda_graph_memory_mb: int = DEFAULT_CUDA_GRAPH_MEMORY_MB


__all__ = ["DEFAULT_REPORT_INTERVAL_S", "DEFAULT_SHARE_INTERVAL_S", "ReplicaSettings"]
