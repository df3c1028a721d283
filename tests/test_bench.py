"""`specrs bench` and `specrs generate --speculative-config` on the real default model, kept short:
a handful of tokens per request."""

import json
import os
import re
import sys

import pytest

from specrs import ConfigError, bench, cli, extras
from specrs.speedup import Speedup

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture
def prompts_file(tmp_path):
    rows = [
        {"question_id": 1, "category": "translation", "turns": ["Translate to German: the red house, the red car, the red door."]},
        {"question_id": 2, "category": "translation", "turns": ["Translate to French: good morning."]},
        {"question_id": 3, "category": "qa", "turns": ["What is the capital of France? What is the capital of Italy?", "ignored"]},
        {"question_id": 4, "category": "writing", "turns": ["Write a limerick."]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_writes_baseline_and_config_for_each_category(prompts_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--prompts", str(prompts_file), "--categories", "translation,qa", "--num-per-category", "1",
                   "--max-tokens", "8", "--config", NGRAM, "--json", str(out), "--no-progress", "--repeats", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "baseline" in printed and "ngram k=3" in printed and "overall" in printed

    report = json.loads(out.read_text())
    ngram = "ngram k=3 min=1 max=3"
    assert list(report["configs"]) == ["baseline", ngram]
    assert report["configs"]["baseline"] is None and report["configs"][ngram]["method"] == "ngram"
    assert [p["question_id"] for p in report["prompts"]] == [1, 3]
    assert len(report["records"]) == 8  # 2 repeats x 2 prompts x (baseline + 1 config)
    assert sorted({r["repeat"] for r in report["records"]}) == [0, 1]
    for record in report["records"]:
        assert record["metrics"]["num_generated_tokens"] > 0 and record["truncated"] is False
        # Greedy speculative decoding must give exactly the plain greedy output.
        assert record["matches_baseline"] is True
    for table in [report["overall"], *report["categories"].values()]:
        assert set(table) == {"baseline", ngram}
        assert table["baseline"]["speedup"] == 1.0 and table["baseline"]["num_drafts"] == 0
        stats = table[ngram]["speedup_stats"]
        # One figure per repeat, the tokens behind them, and the median only when it is a speedup.
        assert len(stats["runs"]) == 2 and stats["num_tokens"] > 0 and table[ngram]["decode_tokens_per_s"] > 0
        assert stats["median"] == pytest.approx(sorted(stats["runs"])[0] / 2 + sorted(stats["runs"])[1] / 2)
        assert table[ngram]["speedup"] == (stats["median"] if stats["verdict"] == "speedup" else None)
        assert len(table[ngram]["acceptance_rate_per_pos"]) == 3
    assert set(report["categories"]) == {"translation", "qa"}
    # The printed table carries each speedup's spread and tokens (or says why it is noise).
    cell = bench.format_speedup(report["overall"][ngram])
    assert f"| {ngram} | {cell} |" in printed
    assert "2 runs)" in cell or cell.startswith(("noise:", "no drafts; timing noise only")), cell
    assert report["overall"][ngram]["time_breakdown"]["propose_frac"] >= 0
    assert set(report["overall"][ngram]["expected_speedup"]) >= {"textbook", "refined"}
    assert len(report["verify_cost_ratios"]) >= 4 and report["verify_cost_ratios"][0] == pytest.approx(1.0)
    assert report["machine"]["cpu_count"] and report["versions"]["specrs"]


def test_bench_rejects_a_bad_config_before_running(prompts_file):
    with pytest.raises(ConfigError):
        bench.parse_config("{not json")
    rc = cli.main(["bench", "--prompts", str(prompts_file), "--max-tokens", "4", "--no-progress",
                   "--config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert rc == 2


def test_truncation_cuts_the_user_text_to_fit():
    def tokenize(content):  # a template of 3 tokens around one token per character
        return [0] + [ord(c) for c in content] + [1, 2]

    text, ids, cut = bench.truncate_content("abcdefghij", tokenize, max_tokens=4, max_context=12)
    assert cut and text == "abcde" and len(ids) == 8
    assert bench.truncate_content("abc", tokenize, max_tokens=4, max_context=12) == ("abc", tokenize("abc"), False)


def test_generate_with_speculative_config_prints_an_acceptance_report(capsys):
    rc = cli.main(["generate", "--chat", "--prompt", "Repeat: one two three, one two three.", "--max-tokens", "16",
                   "--speculative-config", NGRAM, "--repeats", "2"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = next(line for line in lines if "acceptance rate" in line)
    baseline = lines[-1]
    assert "ngram" in report and "k=3" in report and "per position" in report
    # Greedy speculation reproduces the no-speculation reruns exactly; the speedup carries its spread
    # (or says it is noise).
    assert "speculative speedup" in baseline and "identical output" in baseline
    assert "over 2 runs" in baseline or "noise" in baseline, baseline


def test_the_acceptance_report_of_auto_says_which_drafter_drafted_what(capsys):
    rc = cli.main(["generate", "--prompt", "one two three four, one two three four, one two three", "--max-tokens",
                   "16", "--speculative-config", '{"method": "auto"}'])
    assert rc == 0
    report = next(line for line in capsys.readouterr().out.splitlines() if "acceptance rate" in line)
    assert "speculative auto k=8" in report
    assert re.search(r"by drafter: suffix \d+ drafts \(\d+/\d+ accepted\), ngram \d+ drafts", report), report


def _run(num_generated, e2e_s, drafts=0, steps=None):
    """One request's metrics: the first token at 0.1 s, the rest evenly until `e2e_s`."""
    return {"num_generated_tokens": num_generated, "ttft_s": 0.1, "e2e_s": e2e_s, "num_drafts": drafts,
            "num_decode_steps": num_generated - 1 if steps is None else steps, "num_forward_passes": 0}


def test_a_speedup_carries_its_spread_and_tokens_and_noise_is_never_a_speedup():
    base = [[_run(33, 1.1)], [_run(33, 1.3)], [_run(33, 1.2)]]  # 32 decode tokens in 1.0, 1.2, 1.1 s
    # 32 tokens in 16 steps (2 per step) in 0.6-0.7 s: 1.67-1.83x, within the ceiling of 2 per step.
    spec = [[_run(33, 0.7, drafts=10, steps=16)], [_run(33, 0.8, drafts=10, steps=16)],
            [_run(33, 0.7, drafts=10, steps=16)]]
    good = Speedup.of(spec, base, k=4)
    assert good.verdict == "speedup" and good.ceiling == 2.0 and len(good.runs) == 3
    assert good.value == pytest.approx(sorted(good.runs)[1])
    text = good.describe()
    assert text.startswith(f"{good.value:.2f}x (min ") and "over 3 runs" in text and "96 tokens" in text
    # About 2x from a run that yielded 1.23 tokens per step is above what it can reach: noise.
    noisy = Speedup.of([[_run(33, 0.6, drafts=10, steps=26)]] * 3, base, k=4)
    assert noisy.verdict == "above_ceiling" and noisy.value is None
    assert noisy.describe().startswith("not a speedup:") and "timing noise" in noisy.describe()
    # k = 4 caps the ceiling at 5 whatever the tokens per step say.
    assert Speedup(runs=[6.5], num_tokens=80, num_drafts=5, num_steps=10, k=4).verdict == "above_ceiling"
    # No drafts: it decoded as plain decoding does, whatever its timing.
    idle = Speedup.of([[_run(33, 0.6)]] * 3, base, k=6)
    assert idle.verdict == "no_drafts" and idle.value is None
    assert idle.describe().startswith("no drafts; timing noise only")
    assert Speedup(runs=[1.2], num_tokens=10, num_drafts=3, num_steps=8).describe().startswith("1.20x (1 run, no spread")


def test_a_table_cell_shows_the_spread_or_why_the_figure_is_noise():
    base = [[_run(33, 1.1)], [_run(33, 1.3)], [_run(33, 1.2)]]
    good = Speedup.of([[_run(33, 0.7, drafts=10, steps=16)]] * 3, base, k=4)
    cell = bench.format_speedup({"speedup": good.value, "speedup_stats": good.to_dict()})
    assert cell == f"{good.median:.2f}x ({min(good.runs):.2f}-{max(good.runs):.2f}, 3 runs)"
    idle = Speedup.of([[_run(33, 0.6)]] * 3, base, k=6)
    assert bench.format_speedup({"speedup": None, "speedup_stats": idle.to_dict()}) == "no drafts; timing noise only"
    noisy = Speedup(runs=[6.5], num_tokens=80, num_drafts=5, num_steps=10, k=4)  # above k + 1 = 5
    assert bench.format_speedup({"speedup": None, "speedup_stats": noisy.to_dict()}) == "noise: 6.50x > 5.00x ceiling"


def test_bench_runs_the_prompts_specrs_ships_and_marks_each_bar_of_its_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)  # no repository path: the prompts come from the installed package
    assert os.path.dirname(os.path.dirname(bench.SHIPPED_PROMPTS)) == os.path.dirname(os.path.abspath(bench.__file__))
    assert os.path.isfile(bench.SHIPPED_PROMPTS)
    shipped = bench.load_prompts(bench.SHIPPED_PROMPTS)
    assert len(shipped) >= 16 and len({p["category"] for p in shipped}) >= 8
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--categories", "rewriting", "--num-per-category", "1", "--max-tokens", "8", "--config",
                   NGRAM, "--json", str(out), "--plot", str(plot), "--no-progress", "--repeats", "2"])
    assert rc == 0 and plot.stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["args"]["prompts"] is None and [p["category"] for p in report["prompts"]] == ["rewriting"]
    notes = bench.write_plot({"categories": report["categories"], "overall": report["overall"]}, plot)
    stats = report["overall"]["ngram k=3 min=1 max=3"]["speedup_stats"]
    assert f"n=2\n{stats['num_tokens']} tok" in notes[-1]  # the overall bar
    assert notes[-1].endswith("noise") == (stats["verdict"] != "speedup")


def test_plot_needs_the_plot_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ConfigError, match=re.escape(extras.install_command("plot"))):
        bench.write_plot({"categories": {}, "overall": {}}, "unused.png")
