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
others). Needs the `ray` extra's packages (Ray Serve and the `serve` packages, which every replica
imports): `pip install 'ray[serve]' starlette uvicorn prometheus-client jsonschema`, checked before
Ray starts (extras.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from ... import extras
from ...errors import ConfigError

RAY_INSTALL = extras.install_command("ray")
APP_NAME = "specrs"
# How long shutdown waits for the replicas' save round (`save_suffix_caches`).
SAVE_TIMEOUT_S = 30.0

logger = logging.getLogger("specrs.serve")
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray Serve gives its HTTP proxy 5 s to report ready, three times, then kills it and `serve.start`
# fails ("The actor died unexpectedly"). A loaded 2-core machine took longer (the test suite beside
# a build): a local instance waits up to a minute. Read by Ray Serve's controller, which inherits
# the environment of the Ray instance `ray.init` starts.
PROXY_READY_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_TIMEOUT_S = 60


def require_ray() -> None:
    """Every package a replica imports, checked here, before Ray starts and any replica loads a
    model (imports Ray: call it after choosing how a local Ray binds)."""
    extras.require("ray", "specrs serve --ray")


def build(settings, num_replicas: int = 1, autoscaling_config: dict | None = None, replica_cpus: float | None = None,
          max_imbalance: int | None = None, retries: int | None = None, max_shared_responses: int | None = None,
          max_shared_tokens: int | None = None):
    """The bound Ray Serve application: pass it to `serve.run`. `settings`: a
    deployments.ReplicaSettings (every `specrs serve` setting). `num_replicas` engine replicas, or
    `autoscaling_config` (Ray Serve's: min_replicas, max_replicas, target_ongoing_requests, ...);
    `replica_cpus`: CPUs each replica reserves and uses for its forwards (default: this machine's
    cores shared among the replicas). The ingress enforces `settings.api_key` (and
    `metrics_public`, `body_timeout_s`) for the whole app."""
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
                        deployments.DEFAULT_RETRIES if retries is None else retries,
                        api_key=settings.api_key, metrics_public=settings.metrics_public,
                        body_timeout_s=settings.body_timeout_s)


def app_builder(args: dict[str, str]):
    """`serve run specrs.serve.ray:app_builder key=value ...` and Ray Serve config files
    (`applications: - import_path: specrs.serve.ray:app_builder, args: {...}`): every
    deployments.ReplicaSettings field plus num_replicas, autoscaling_config (JSON),
    replica_cpus, max_imbalance, retries. Without an api_key argument, `$SPECRS_API_KEY` of this
    process is the key (none: no authentication)."""
    import json

    from ..auth import resolve_api_key
    from .settings import ReplicaSettings

    fields = ReplicaSettings.__dataclass_fields__
    known = set(fields) | {"num_replicas", "autoscaling_config", "replica_cpus", "max_imbalance", "retries",
                           "max_shared_responses", "max_shared_tokens"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ConfigError(f"unknown app argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")

    def value(key: str, raw: Any) -> Any:
        if not isinstance(raw, str) or key in ("model", "device", "served_model_name", "suffix_cache",
                                               "draft_budget", "speculative_config", "api_key",
                                               "generation_config", "override_generation_config"):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            raise ConfigError(f"app argument {key}={raw!r} is not a JSON value (write numbers, true/false, "
                              f"null or JSON objects)") from None

    values = {key: value(key, raw) for key, raw in args.items()}
    values["api_key"] = resolve_api_key(values.get("api_key"))
    extra = {key: values.pop(key) for key in list(values) if key not in fields}
    return build(ReplicaSettings(**values), **extra)


def run(settings, *, host: str = "127.0.0.1", port: int = 8000, ray_address: str | None = None,
        num_replicas: int = 1, autoscaling_config: dict | None = None, replica_cpus: float | None = None,
        max_imbalance: int | None = None) -> None:
    """Starts (or joins) Ray, runs the app on http://host:port until interrupted (Ctrl-C or
    SIGTERM), then, with `--suffix-cache`, has every replica save the file (`save_suffix_caches`)
    before it shuts the app down."""
    if ray_address is None:
        # Ray's local-only mode (its default on macOS and Windows): every Ray process binds to the
        # loopback address instead of this node's network address. Read when Ray is imported.
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")
        os.environ.setdefault(PROXY_READY_ENV, str(PROXY_READY_TIMEOUT_S))
    require_ray()
    import ray
    from ray import serve

    app = build(settings, num_replicas, autoscaling_config, replica_cpus, max_imbalance)
    if ray_address is None:  # a local instance, reachable from this machine only
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    else:
        ray.init(address=ray_address)
    # SIGTERM (a service manager's stop) shuts down like Ctrl-C instead of ending the process at once.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    serve.start(http_options={"host": host, "port": port})
    # The handle the save at shutdown goes through, taken as soon as the coordinator answers: Ctrl-C
    # may come while `serve.run` still waits for the app to be declared ready (it serves before
    # that, and on a loaded machine long before), when a handle taken only then would need Ray
    # Serve's controller, which may be the slow part.
    coordinator: dict[str, Any] = {}
    if settings.suffix_cache is not None:
        threading.Thread(target=_take_coordinator_handle, args=(coordinator,), daemon=True,
                         name="specrs-coordinator-handle").start()
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"specrs serve --ray: {num_replicas if autoscaling_config is None else autoscaling_config} replica(s) "
              f"on http://{host}:{port}/v1 (speculation: "
              f"{settings.speculative_config if settings.speculative_config else 'off'})", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if settings.suffix_cache is not None:
            save_suffix_caches(coordinator.get("handle"))
        serve.shutdown()
        ray.shutdown()


def _take_coordinator_handle(into: dict[str, Any], retry_s: float = 0.5) -> None:
    """Puts a working coordinator handle in `into["handle"]` once the coordinator answers (before
    the app exists, getting one fails: it tries again every `retry_s`), and says so on stderr."""
    while True:
        try:
            into["handle"] = coordinator_handle()
        except Exception:  # the app or its coordinator is not up yet
            time.sleep(retry_s)
            continue
        print("specrs serve --ray: the coordinator answers; a save at shutdown goes through it", file=sys.stderr,
              flush=True)
        return


def coordinator_handle(timeout_s: float = SAVE_TIMEOUT_S):
    """A handle to the app's coordinator, its routing already known (one call made): a save at
    shutdown through it needs no more from Ray Serve's controller, which shutdown takes down first
    (and which a loaded machine slows)."""
    from ray import serve

    coordinator = serve.get_deployment_handle("Coordinator", app_name=APP_NAME)
    coordinator.share_stats.remote().result(timeout_s=timeout_s)
    return coordinator


def save_suffix_caches(coordinator=None, timeout_s: float = SAVE_TIMEOUT_S) -> list[str]:
    """Has every live replica save its suffix cache file now, before the app is torn down (Ray Serve
    stops replicas and kills one slow to stop, and this process may be killed too): one save round
    through the coordinator's board (replica_board.py), waited for up to `timeout_s`. Returns the
    replicas that did not report their save in time (logged; they save again when Ray Serve stops
    them)."""
    print("specrs serve --ray: saving the suffix cache before shutting down", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    try:
        coordinator = coordinator or coordinator_handle(timeout_s)
        save_round = coordinator.board_open_save_round.remote().result(timeout_s=left())
        while True:
            waiting = coordinator.board_save_waiting_for.remote(save_round, "saved").result(timeout_s=left())
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except Exception as e:  # the app is going down anyway
        logger.warning("specrs serve --ray: the save round before shutdown failed: %r", e)
        return []
    if waiting:
        logger.warning("specrs serve --ray: replicas %s did not save the suffix cache within %.0f s", ", ".join(waiting),
                       timeout_s)
    return waiting


__all__ = ["APP_NAME", "RAY_INSTALL", "app_builder", "build", "coordinator_handle", "require_ray", "run",
           "save_suffix_caches"]
