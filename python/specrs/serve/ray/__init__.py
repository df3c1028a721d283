"""`specrs serve --ray`: the OpenAI server of `specrs serve` as a Ray Serve application, N engine
replicas behind one HTTP endpoint.

    specrs serve --ray --num-replicas 2 [MODEL] [every `specrs serve` option]
    python -m specrs.serve.ray --num-replicas 2 ...          (the same)
    serve run specrs.serve.ray:app_builder num_replicas=2 model=PATH speculative_config='{"method":"suffix"}'

Each replica is one Engine with its own continuous batcher (deployments.py); the ingress routes a
request to the replica that served its conversation or prompt before unless that one is overloaded
(router.py); finished suffix-decoding responses reach every replica's suffix cache (suffix_share.py);
/health and /metrics cover every replica (replica_board.py); a killed replica is restarted by Ray
Serve, and its requests end with a clean error or are retried on another replica when nothing was
streamed yet. Without an address, Ray starts a local instance bound to 127.0.0.1; `--ray-address`
joins a running cluster (`ray start --head` on one node, `ray start --address=HEAD:6379` on the
others). Needs the `ray` extra's packages: `pip install 'ray[serve]' starlette uvicorn prometheus-client`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ...errors import ConfigError

RAY_INSTALL = "pip install 'ray[serve]' starlette uvicorn prometheus-client"
APP_NAME = "specrs"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise ConfigError(f"specrs serve --ray needs Ray Serve: run `{RAY_INSTALL}`") from None


def build(settings, num_replicas: int = 1, autoscaling_config: dict | None = None, replica_cpus: float | None = None,
          max_imbalance: int | None = None, retries: int | None = None, max_shared_responses: int | None = None,
          max_shared_tokens: int | None = None):
    """The bound Ray Serve application: pass it to `serve.run`. `settings`: a
    deployments.ReplicaSettings (every `specrs serve` setting). `num_replicas` engine replicas, or
    `autoscaling_config` (Ray Serve's: min_replicas, max_replicas, target_ongoing_requests, ...);
    `replica_cpus`: CPUs each replica reserves and uses for its forwards (default: this machine's
    cores shared among the replicas)."""
    require_ray()
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from . import deployments, router, suffix_share

    if num_replicas < 1:
        raise ConfigError(f"num_replicas must be at least 1 (got {num_replicas})")
    if autoscaling_config is not None and not isinstance(autoscaling_config, dict):
        raise ConfigError("autoscaling_config must be a JSON object like {\"min_replicas\": 1, \"max_replicas\": 4}")
    if replica_cpus is not None and replica_cpus <= 0:
        raise ConfigError(f"replica_cpus must be positive (got {replica_cpus})")
    expected = autoscaling_config.get("min_replicas", 1) if autoscaling_config else num_replicas
    cpus = replica_cpus if replica_cpus is not None else max(1, (os.cpu_count() or 1) // max(1, expected))
    scaling: dict[str, Any] = ({"autoscaling_config": autoscaling_config} if autoscaling_config
                               else {"num_replicas": num_replicas})
    replica = serve.deployment(deployments.EngineReplica).options(
        name="EngineReplica", **scaling,
        # The replica's own scheduler queues beyond max_num_seqs; Ray holds the rest at the router.
        max_ongoing_requests=2 * settings.max_num_seqs,
        ray_actor_options={"num_cpus": cpus,
                           "runtime_env": {"env_vars": {"RAYON_NUM_THREADS": str(max(1, int(cpus)))}}},
        request_router_config=RequestRouterConfig(
            request_router_class=router.PrefixAffinityRouter,
            request_router_kwargs={"max_imbalance": router.DEFAULT_MAX_IMBALANCE if max_imbalance is None
                                   else max_imbalance}),
        health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=30)
    coordinator = serve.deployment(deployments.Coordinator).options(
        name="Coordinator", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
    ingress = serve.deployment(deployments.Ingress).options(
        name="Ingress", num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    coordinator_app = coordinator.bind(max_shared_responses or suffix_share.DEFAULT_MAX_RESPONSES,
                                       max_shared_tokens or suffix_share.DEFAULT_MAX_TOKENS)
    return ingress.bind(replica.bind(settings, coordinator_app), coordinator_app, expected,
                        settings.max_request_body_bytes,
                        deployments.DEFAULT_RETRIES if retries is None else retries)


def app_builder(args: dict[str, str]):
    """`serve run specrs.serve.ray:app_builder key=value ...` and Ray Serve config files
    (`applications: - import_path: specrs.serve.ray:app_builder, args: {...}`): every
    deployments.ReplicaSettings field plus num_replicas, autoscaling_config (JSON),
    replica_cpus, max_imbalance, retries."""
    import json

    from .settings import ReplicaSettings

    fields = ReplicaSettings.__dataclass_fields__
    known = set(fields) | {"num_replicas", "autoscaling_config", "replica_cpus", "max_imbalance", "retries",
                           "max_shared_responses", "max_shared_tokens"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"unknown app argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")

    def value(key: str, raw: Any) -> Any:
        if not isinstance(raw, str) or key in ("model", "device", "served_model_name", "suffix_cache",
                                               "draft_budget", "speculative_config", "generation_config",
                                               "override_generation_config"):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            raise ConfigError(f"app argument {key}={raw!r} is not a JSON value (write numbers, true/false, "
                              f"null or JSON objects)") from None

    values = {key: value(key, raw) for key, raw in args.items()}
    extra = {key: values.pop(key) for key in list(values) if key not in fields}
    return build(ReplicaSettings(**values), **extra)


def run(settings, *, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
        num_replicas: int = 1, autoscaling_config: dict | None = None, replica_cpus: float | None = None,
        max_imbalance: int | None = None) -> None:
    """Starts (or joins) Ray, runs the app on http://host:port until interrupted, then shuts it down
    (each replica saves its suffix cache file)."""
    if ray_address is None:
        # Ray's local-only mode (its default on macOS and Windows): every Ray process binds to the
        # loopback address instead of this node's network address. Read when Ray is imported.
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")
    require_ray()
    import time

    import ray
    from ray import serve

    app = build(settings, num_replicas, autoscaling_config, replica_cpus, max_imbalance)
    if ray_address is None:  # a local instance, reachable from this machine only
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    else:
        ray.init(address=ray_address)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"specrs serve --ray: {num_replicas if autoscaling_config is None else autoscaling_config} replica(s) "
          f"on http://{host}:{port}/v1 (speculation: "
          f"{settings.speculative_config if settings.speculative_config else 'off'})", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


__all__ = ["APP_NAME", "RAY_INSTALL", "app_builder", "build", "require_ray", "run"]
