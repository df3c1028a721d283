"""`specrs selftest`: is speculative decoding lossless on this model, with this config, here?

    specrs selftest [MODEL] [--speculative-config JSON ...] [--device cpu] [--num-seeds 300]
                    [--quick] [--json]

MODEL is a .gguf path, a Hugging Face directory or a name from `specrs models` ("smollm2-135m",
the default, "gemma3-270m", ...). Every
`--speculative-config` is checked; without one, the model-free methods are:
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "suffix", "num_speculative_tokens": 4}

Three checks per config, on a built-in set of plain-text prompts chosen so that prompt lookup and
suffix decoding draft (repetition, code, lists):
1. Greedy identity. Greedy output with speculation equals plain greedy output, token for token,
   on every prompt: at k = 1, 2, 4 and 8 with a fixed draft length (adaptive_draft_length off, so
   each k is really drafted), and with the config as given. Each row reports how many drafts were
   made, since an identity without drafts proves nothing: no draft at a fixed k is a FAIL, none
   with the config as given (where the adaptive length may decide drafting does not pay) a WARN.
2. Sampling distribution. The first generated token comes from the prefill and is never
   speculative, so the test is on tokens 2..4: their joint distribution over `--num-seeds` seeded
   requests at temperature 1 without speculation (seeds 0..n-1) and with the config at a fixed
   draft length (seeds 10^6..10^6+n-1, so the two samples are independent), the requests taking
   three built-in prompts in turn (drafts mostly accepted, about half, mostly rejected). Outcomes
   seen fewer than 10 times in both samples together are pooled, then a two-sample chi-square
   test of homogeneity gives a p-value (computed here, no SciPy); PASS when p >= alpha (0.001).
   Rejection sampling is exact, so a correct engine fails this with probability alpha.
3. Seeded determinism. The same seeded request twice gives the same tokens, without speculation
   and with each config as given. Suffix decoding adds every response to an engine-wide cache, so
   a repeated request gets other drafts; its one-hot drafts are verified in coupled form, which
   keeps the sample anyway, but a draft with probabilities would legitimately change it, so for
   suffix each of the two runs uses a fresh engine, with the draft length fixed (a fresh engine
   may read other costs for the adaptive length than the first). The engine's cost figures are
   waited for first (`Engine.wait_for_costs`): a figure changes once, when its background
   measurement lands, and both runs must read the same.

Exit status 1 when any check FAILs; `--json` prints the report for machines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from typing import Any, Callable, Sequence

from .bench import config_label
from .engine import Engine, SamplingParams, _config_json
from .heads import HEAD_METHODS, with_shipped_head
from .errors import ConfigError

DEFAULT_CONFIGS = (
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    {"method": "suffix", "num_speculative_tokens": 4},
)
# Fixed draft lengths of the greedy identity check, besides the config's own k.
GREEDY_KS = (1, 2, 4, 8)
# specrs' largest num_speculative_tokens (spec_config.rs MAX_SPECULATIVE_TOKENS).
MAX_SPECULATIVE_TOKENS = 64
DEFAULT_MAX_TOKENS = 48
DEFAULT_NUM_SEEDS = 300
DEFAULT_ALPHA = 0.001
DEFAULT_TEMPERATURE = 1.0
# --quick: about a third of the work (308 requests against 968 with the default configs), with less
# power in the distribution check.
QUICK_NUM_SEEDS = 80
QUICK_MAX_TOKENS = 24
# Tokens 2..DISTRIBUTION_TOKENS of each sampled request are the outcome (token 1 is never speculative).
DISTRIBUTION_TOKENS = 4
# Second sample's seeds start here, so no request of one sample shares a seed with the other.
SPECULATIVE_SEED_OFFSET = 1_000_000
# Outcomes seen fewer times in both samples together are pooled: with equal samples each side
# then expects at least 5, what the chi-square approximation needs.
MIN_CELL_COUNT = 10
DETERMINISM_SEEDS = (0, 1)
DETERMINISM_PROMPTS = 2

# Plain text (no chat template, so base models take them too) that continues by copying.
PROMPTS = {
    "list": "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday, Wednesday,",
    "code": "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\n"
    "def multiply(a, b):\n    return a * b\n\n\ndef",
    "repetition": "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the",
    "table": "| name | color |\n|---|---|\n| apple | red |\n| banana | yellow |\n| cherry | red |\n| lime |",
}
# The sampling check's prompts, taken in turn by its requests. Each drafts from the second token
# on; the target gives the drafted token a high probability in the first (so drafts are mostly
# accepted and the bonus token is sampled), a middling one in the second, and a low one in the
# third (drafts mostly rejected: the residual distribution is sampled). Accepting a draft too
# often, or sampling the wrong residual, shows in all three.
DISTRIBUTION_PROMPTS = {
    "pattern": "red, green, blue, red, green, blue, red, green, blue, red, green, blue, red,",
    "pets": "Alice has a cat. Bob has a dog. Carol has a bird. Alice has a",
    "code": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return",
}

PASS, FAIL, WARN = "PASS", "FAIL", "WARN"


# --- statistics ------------------------------------------------------------------------------


def regularized_gamma_q(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), the regularized upper incomplete gamma function: the
    power series of P = 1 - Q below x = a + 1, the continued fraction of Q above (modified Lentz),
    each where it converges fast."""
    if a <= 0 or x < 0 or math.isnan(x):
        raise ValueError(f"regularized_gamma_q needs a > 0 and x >= 0 (got a={a}, x={x})")
    if x == 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)  # log(x^a e^-x / Gamma(a))
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X chi-square distributed with df degrees of freedom."""
    if df < 1:
        raise ValueError(f"a chi-square distribution needs df >= 1 (got {df})")
    if statistic <= 0:
        return 1.0
    return regularized_gamma_q(df / 2, statistic / 2)


def pool_rare_outcomes(a: Counter, b: Counter, min_count: int = MIN_CELL_COUNT) -> tuple[Counter, Counter]:
    """The two histograms over the same cells, where outcomes seen fewer than `min_count` times in
    both together share one "other" cell; if that cell is itself too small, the next rarest
    outcomes join it."""
    totals = Counter(a) + Counter(b)
    ordered = sorted(totals, key=lambda c: (totals[c], repr(c)))  # rarest first, ties in a fixed order
    pooled = set()
    pooled_total = 0
    for cell in ordered:
        if totals[cell] >= min_count and (pooled_total == 0 or pooled_total >= min_count):
            break
        pooled.add(cell)
        pooled_total += totals[cell]
    # Everything pooled into one cell leaves nothing to compare; keep that as the one cell.
    key = lambda c: "other" if c in pooled else c  # noqa: E731
    pa, pb = Counter(), Counter()
    for c, n in a.items():
        pa[key(c)] += n
    for c, n in b.items():
        pb[key(c)] += n
    return pa, pb


def two_sample_chi_square(a: Counter, b: Counter, min_count: int = MIN_CELL_COUNT) -> dict:
    """Chi-square test that two samples of outcomes come from one distribution (homogeneity):
    the statistic, its degrees of freedom (cells - 1), the p-value and the cells compared."""
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        raise ValueError("two_sample_chi_square needs two non-empty samples")
    pa, pb = pool_rare_outcomes(a, b, min_count)
    cells = sorted(set(pa) | set(pb), key=lambda c: -(pa[c] + pb[c]))
    statistic = 0.0
    for c in cells:
        total = pa[c] + pb[c]
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        statistic += (pa[c] - ea) ** 2 / ea + (pb[c] - eb) ** 2 / eb
    df = len(cells) - 1
    return {
        "statistic": statistic,
        "df": df,
        # One cell: both samples agree trivially; there is nothing to test.
        "p_value": chi_square_sf(statistic, df) if df >= 1 else 1.0,
        "cells": [{"outcome": list(c) if isinstance(c, tuple) else c,
                   "without": pa[c], "with": pb[c]} for c in cells],
    }


def first_difference(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(expected, actual)):
        if x != y:
            return i
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


# --- configs ---------------------------------------------------------------------------------


def parse_configs(configs: Sequence[Any] | None, allow_custom: bool = False,
                  target_info: dict | None = None) -> list[dict]:
    """Each config (a dict or vLLM's --speculative-config JSON text) as the user wrote it, checked
    by the engine's parser; raises ConfigError naming the bad one. Method "custom" needs the
    engine's own Python proposer (`allow_custom`: Engine(proposer=...) through `run`). With
    `target_info` (`Engine.info()`), a head method without "model" gets the shipped head."""
    out = []
    for config in DEFAULT_CONFIGS if not configs else configs:
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config {config!r} is not valid JSON ({e}); example: "
                                  '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(config, dict):
            raise ConfigError(f"a speculative config must be a JSON object with a 'method' key (got {config!r})")
        if target_info is not None:
            config = with_shipped_head(config, target_info)
        elif config.get("method") in HEAD_METHODS and "model" not in config:
            out.append(dict(config))  # the shipped head is looked up once the model is loaded (`run`)
            continue
        full = json.loads(_config_json(config))  # the engine's checks: unknown keys, bad values
        if full["method"] == "custom" and not allow_custom:
            raise ConfigError("selftest cannot run method 'custom' without your Python proposer: call "
                              "specrs.selftest.run(specrs.Engine(model, proposer=obj), [config]) instead")
        out.append(dict(config))
    return out


def label(config: dict | None, fixed: bool = False) -> str:
    """"ngram k=4 min=2 max=4 (fixed)" for a fixed-length variant, "... (as given)" otherwise."""
    if config is None:
        return "no speculation"
    text = config_label({k: v for k, v in config.items() if k != "adaptive_draft_length"})
    return f"{text} ({'fixed' if fixed else 'as given'})"


def fixed_length(config: dict, k: int) -> dict:
    return {**config, "num_speculative_tokens": k, "adaptive_draft_length": False}


def greedy_variants(config: dict) -> list[tuple[dict, bool]]:
    """(config, fixed) pairs of the greedy identity check: k = 1, 2, 4, 8 and the config's own k at
    a fixed length (bounded by what the method drafts: suffix decoding never drafts past its tree
    depth), then the config as given."""
    full = json.loads(_config_json(config))
    limit = MAX_SPECULATIVE_TOKENS
    if full["method"] == "suffix":
        limit = min(limit, full["suffix_decoding_max_tree_depth"])
    ks = sorted({k for k in GREEDY_KS if k <= limit} | {full["num_speculative_tokens"]})
    variants = [(fixed_length(config, k), True) for k in ks]
    # The config as given, unless it is one of those (a fixed length at its own k).
    if _config_json(config) != _config_json(fixed_length(config, full["num_speculative_tokens"])):
        variants.append((config, False))
    return variants


def uses_engine_wide_drafts(config: dict) -> bool:
    """Whether drafts depend on earlier requests of the engine (suffix decoding's response cache)."""
    return json.loads(_config_json(config))["method"] == "suffix"


# --- checks ----------------------------------------------------------------------------------


def _draft_numbers(results) -> dict:
    drafts = sum(r.metrics["num_drafts"] for r in results)
    draft_tokens = sum(r.metrics["num_draft_tokens"] for r in results)
    accepted = sum(r.metrics["num_accepted_tokens"] for r in results)
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0}


def check_greedy_identity(engine, config: dict, fixed: bool, prompts: dict, baselines: dict,
                          max_tokens: int) -> dict:
    """Greedy output with `config` against plain greedy output (`baselines`: name -> token ids)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results, mismatches = [], []
    for name, prompt_ids in prompts.items():
        r = engine.generate(prompt_ids, params, speculative_config=config)
        results.append(r)
        at = first_difference(baselines[name], r.token_ids)
        if at is not None:
            expected = baselines[name][at] if at < len(baselines[name]) else None
            got = r.token_ids[at] if at < len(r.token_ids) else None
            mismatches.append({"prompt": name, "position": at, "expected": expected, "got": got})
    numbers = _draft_numbers(results)
    identical = len(prompts) - len(mismatches)
    detail = (f"{identical}/{len(prompts)} prompts identical to plain greedy; {numbers['num_drafts']} drafts, "
              f"{numbers['num_draft_tokens']} draft tokens, {numbers['num_accepted_tokens']} accepted "
              f"({numbers['acceptance_rate']:.0%})")
    if mismatches:
        status = FAIL
        detail += "; first difference: " + ", ".join(
            f"{m['prompt']!r} at token {m['position']} (plain {m['expected']}, speculative {m['got']})" for m in mismatches)
    elif numbers["num_drafts"] == 0:
        # Nothing was verified, so the identity proves nothing.
        status = FAIL if fixed else WARN
        detail += ("; no draft was made, so this proves nothing" if fixed else
                   "; no draft was made (the adaptive length may judge drafts not to pay here), so this proves nothing")
    else:
        status = PASS
    return {"check": "greedy identity", "config": config, "label": label(config, fixed), "status": status,
            "detail": detail, "prompts_identical": identical, "num_prompts": len(prompts),
            "mismatches": mismatches, **numbers}


def sample_outcomes(engine, prompts: dict, speculative_config, seeds: Sequence[int],
                    temperature: float) -> tuple[Counter, list]:
    """One seeded request per seed, taking the prompts in turn; the outcome of each is (prompt
    name, tokens 2..DISTRIBUTION_TOKENS). Returns the outcomes counted and the results."""
    outcomes, results = Counter(), []
    names = list(prompts)
    for i, seed in enumerate(seeds):
        name = names[i % len(names)]
        params = SamplingParams(max_tokens=DISTRIBUTION_TOKENS, temperature=temperature, seed=seed)
        r = engine.generate(prompts[name], params, speculative_config=speculative_config)
        outcomes[(name, *r.token_ids[1:])] += 1
        results.append(r)
    return outcomes, results


def check_distribution(engine, config: dict, prompts: dict, plain: Counter, num_seeds: int,
                       temperature: float, alpha: float) -> dict:
    """Tokens 2..4 sampled with `config` (fixed length) against `plain` (sampled without, by
    `sample_outcomes` over the same prompts and as many seeds)."""
    k = json.loads(_config_json(config))["num_speculative_tokens"]
    spec_config = fixed_length(config, k)
    seeds = range(SPECULATIVE_SEED_OFFSET, SPECULATIVE_SEED_OFFSET + num_seeds)
    speculative, results = sample_outcomes(engine, prompts, spec_config, seeds, temperature)
    test = two_sample_chi_square(plain, speculative)
    numbers = _draft_numbers(results)
    drafted = sum(r.metrics["num_drafts"] > 0 for r in results)
    detail = (f"chi2 {test['statistic']:.2f}, df {test['df']}, p {test['p_value']:.3g} "
              f"{'>=' if test['p_value'] >= alpha else '<'} alpha {alpha:g}; tokens 2-{DISTRIBUTION_TOKENS} of "
              f"{sum(plain.values())} + {num_seeds} requests at temperature {temperature:g}; "
              f"{drafted}/{num_seeds} requests drafted, acceptance {numbers['acceptance_rate']:.0%}")
    if numbers["num_drafts"] == 0:
        status = FAIL
        detail += "; no draft was made, so this proves nothing"
    elif test["df"] == 0:
        status = WARN
        detail += "; one outcome only, nothing to compare (raise --temperature or --num-seeds)"
    else:
        status = PASS if test["p_value"] >= alpha else FAIL
    return {"check": "sampling distribution", "config": spec_config, "label": label(spec_config, True),
            "status": status, "detail": detail, "alpha": alpha, "temperature": temperature,
            "num_seeds": num_seeds, "requests_drafted": drafted, **test, **numbers}


def check_determinism(engine, config: dict | None, prompts: dict, max_tokens: int, temperature: float,
                      new_engine: Callable[[], Any] | None) -> dict:
    """The same seeded requests twice; for suffix decoding, each time on a fresh engine with a
    fixed draft length (see the module docstring)."""
    fresh = config is not None and uses_engine_wide_drafts(config)
    if fresh:
        config = fixed_length(config, json.loads(_config_json(config))["num_speculative_tokens"])
        if new_engine is None:
            raise ConfigError("checking suffix decoding's determinism needs a fresh engine per run: pass new_engine")
    requests = [(name, ids, seed) for name, ids in list(prompts.items())[:DETERMINISM_PROMPTS] for seed in DETERMINISM_SEEDS]

    def run_all(on):
        return [on.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
                            speculative_config=False if config is None else config) for _, ids, seed in requests]

    first = run_all(new_engine() if fresh else engine)
    second = run_all(new_engine() if fresh else engine)
    differing = [{"prompt": name, "seed": seed, "position": first_difference(a.token_ids, b.token_ids)}
                 for (name, _, seed), a, b in zip(requests, first, second) if a.token_ids != b.token_ids]
    # Different seeds should give different samples, or the engine may be ignoring the seed.
    distinct = len({tuple(r.token_ids) for r in first})
    numbers = _draft_numbers(first + second)
    same = len(requests) - len(differing)
    detail = (f"{same}/{len(requests)} seeded requests identical when repeated ({distinct} distinct samples "
              f"over {len(requests)} prompt/seed pairs)")
    if config is not None:
        detail += f"; {numbers['num_drafts']} drafts"
    if fresh:
        detail += "; a fresh engine per run and a fixed draft length (suffix decoding's cache spans requests)"
    if differing:
        status = FAIL
        detail += "; differ: " + ", ".join(f"{d['prompt']!r} seed {d['seed']} at token {d['position']}" for d in differing)
    elif config is not None and numbers["num_drafts"] == 0:
        status = WARN
        detail += "; no draft was made, so this only checks plain sampling"
    else:
        status = PASS
    return {"check": "seeded determinism", "config": config, "label": label(config, fresh), "status": status,
            "detail": detail, "requests_identical": same, "num_requests": len(requests),
            "distinct_samples": distinct, "differing": differing, "fresh_engine_per_run": fresh, **numbers}


# --- the run ---------------------------------------------------------------------------------


def run(engine, configs: Sequence[Any] | None = None, *, num_seeds: int = DEFAULT_NUM_SEEDS,
        max_tokens: int = DEFAULT_MAX_TOKENS, temperature: float = DEFAULT_TEMPERATURE, alpha: float = DEFAULT_ALPHA,
        new_engine: Callable[[], Any] | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Runs every check on `engine` for each config (default: DEFAULT_CONFIGS) and returns the
    report: {"model", "device", "configs", "checks": [{"check", "label", "status", "detail", ...}],
    "counts", "passed"}. `new_engine()` makes a fresh engine of the same model (suffix decoding's
    determinism check needs one; by default Engine(engine.model_path, device=engine.device))."""
    if num_seeds < 1:
        raise ConfigError(f"--num-seeds must be at least 1 (got {num_seeds}); the default is {DEFAULT_NUM_SEEDS}")
    if max_tokens < 2:
        raise ConfigError(f"--max-tokens must be at least 2 (got {max_tokens}): token 1 is never speculative")
    if not temperature > 0:
        raise ConfigError(f"--temperature must be > 0 for the sampling check (got {temperature}); try 1.0")
    if not 0 < alpha < 1:
        raise ConfigError(f"--alpha must be in (0, 1) (got {alpha}); the default is {DEFAULT_ALPHA}")
    configs = parse_configs(configs, allow_custom=getattr(engine, "proposer", None) is not None,
                            target_info=engine.info())
    if new_engine is None and getattr(engine, "model_path", None) is not None:
        new_engine = lambda: Engine(engine.model_path, device=engine.device)  # noqa: E731
    say = progress or (lambda text: None)

    prompts = {name: engine.prompt_token_ids(text) for name, text in PROMPTS.items()}
    checks = []
    say("greedy identity: plain greedy decoding of the prompts")
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    baselines = {name: engine.generate(ids, greedy, speculative_config=False).token_ids for name, ids in prompts.items()}
    for config in configs:
        for variant, fixed in greedy_variants(config):
            checks.append(check_greedy_identity(engine, variant, fixed, prompts, baselines, max_tokens))
            say(f"{checks[-1]['check']} {checks[-1]['label']}: {checks[-1]['status']}")

    say(f"sampling distribution: {num_seeds} requests without speculation")
    distribution_prompts = {name: engine.prompt_token_ids(text) for name, text in DISTRIBUTION_PROMPTS.items()}
    plain, _ = sample_outcomes(engine, distribution_prompts, False, range(num_seeds), temperature)
    for config in configs:
        checks.append(check_distribution(engine, config, distribution_prompts, plain, num_seeds, temperature, alpha))
        say(f"{checks[-1]['check']} {checks[-1]['label']}: {checks[-1]['status']}")

    # The adaptive length's cost figures change once, when the engine's background measurement of
    # them lands: both runs of each request must read the same ones.
    engine.wait_for_costs()
    for config in [None, *configs]:
        checks.append(check_determinism(engine, config, prompts, max_tokens, temperature, new_engine))
        say(f"{checks[-1]['check']} {checks[-1]['label']}: {checks[-1]['status']}")

    counts = Counter(c["status"] for c in checks)
    return {
        "model": getattr(engine, "model_path", None),
        "device": getattr(engine, "device", None),
        "configs": configs,
        "num_seeds": num_seeds,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "alpha": alpha,
        "prompts": dict(PROMPTS),
        "distribution_prompts": dict(DISTRIBUTION_PROMPTS),
        "checks": checks,
        "counts": {s: counts.get(s, 0) for s in (PASS, WARN, FAIL)},
        "passed": counts.get(FAIL, 0) == 0,
    }


def exit_status(report: dict) -> int:
    """The command's exit status: 1 when any check failed, else 0 (warnings do not fail)."""
    return 0 if report["passed"] else 1


def format_report(report: dict) -> str:
    checks = report["checks"]
    name_width = max(len(c["check"]) for c in checks)
    label_width = max(len(c["label"]) for c in checks)
    lines = [f"specrs selftest: {report['model']} on {report['device']}; {len(report['configs'])} configs, "
             f"{report['max_tokens']} greedy tokens per prompt, {report['num_seeds']} seeds per sample, "
             f"alpha {report['alpha']:g}", ""]
    for c in checks:
        lines.append(f"{c['status']}  {c['check']:<{name_width}}  {c['label']:<{label_width}}  {c['detail']}")
    n = report["counts"]
    lines += ["", f"selftest {'PASS' if report['passed'] else 'FAIL'}: {n[PASS]} passed, {n[WARN]} warnings, "
                  f"{n[FAIL]} failed"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help='a .gguf path, a Hugging Face directory or a name from `specrs models` '
                             '("smollm2-135m", the default, "gemma3-270m", ...)')
    parser.add_argument("--speculative-config", action="append", default=[], metavar="JSON",
                        help="a config to check, as `vllm serve --speculative-config` takes it; repeatable "
                             "(default: ngram k=4 min=2 max=4 and suffix k=4)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-seeds", type=int, default=None,
                        help=f"requests per sample of the distribution check (default {DEFAULT_NUM_SEEDS}, "
                             f"{QUICK_NUM_SEEDS} with --quick); more seeds find smaller differences")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"greedy tokens per prompt (default {DEFAULT_MAX_TOKENS}, {QUICK_MAX_TOKENS} with --quick)")
    parser.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                        help="temperature of the sampled checks")
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                        help="significance level of the distribution check: a correct engine fails it this often")
    parser.add_argument("--quick", action="store_true",
                        help="fewer seeds and shorter outputs: about a third of the work, less power")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def run_from_args(args: argparse.Namespace) -> int:
    num_seeds = args.num_seeds if args.num_seeds is not None else QUICK_NUM_SEEDS if args.quick else DEFAULT_NUM_SEEDS
    max_tokens = args.max_tokens if args.max_tokens is not None else QUICK_MAX_TOKENS if args.quick else DEFAULT_MAX_TOKENS
    configs = parse_configs(args.speculative_config)  # bad JSON fails before the model loads
    engine = Engine(args.model, device=args.device)
    progress = None if args.no_progress else (lambda text: print(f"[selftest] {text}", file=sys.stderr, flush=True))
    report = run(engine, configs, num_seeds=num_seeds, max_tokens=max_tokens, temperature=args.temperature,
                 alpha=args.alpha, progress=progress)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return exit_status(report)
