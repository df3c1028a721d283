"""`specrs bench` and `specrs generate --speculative-config` on the real default model, kept short:
a handful of tokens per request."""

import json

import pytest

from specrs import ConfigError, bench, cli

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
                   "--max-tokens", "8", "--config", NGRAM, "--json", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "baseline" in printed and "ngram k=3" in printed and "overall" in printed

    report = json.loads(out.read_text())
    ngram = "ngram k=3 min=1 max=3"
    assert list(report["configs"]) == ["baseline", ngram]
    assert report["configs"]["baseline"] is None and report["configs"][ngram]["method"] == "ngram"
    assert [p["question_id"] for p in report["prompts"]] == [1, 3]
    assert len(report["records"]) == 4  # 2 prompts x (baseline + 1 config)
    for record in report["records"]:
        assert record["metrics"]["num_generated_tokens"] > 0 and record["truncated"] is False
        # Greedy speculative decoding must give exactly the plain greedy output.
        assert record["matches_baseline"] is True
    for table in [report["overall"], *report["categories"].values()]:
        assert set(table) == {"baseline", ngram}
        assert table["baseline"]["speedup"] == 1.0 and table["baseline"]["num_drafts"] == 0
        assert table[ngram]["speedup"] > 0 and table[ngram]["decode_tokens_per_s"] > 0
        assert len(table[ngram]["acceptance_rate_per_pos"]) == 3
    assert set(report["categories"]) == {"translation", "qa"}
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
                   "--speculative-config", NGRAM])
    assert rc == 0
    report, baseline = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "ngram" in report and "k=3" in report and "acceptance rate" in report and "per position" in report
    # Greedy speculation reproduces the no-speculation rerun exactly.
    assert "speculative speedup" in baseline and "identical output" in baseline
