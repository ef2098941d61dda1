"""The sweep: aggregation on hand-built rows, and a whole tiny run (JSON rows, summary, plot)."""

import json
import math

import pytest

from spec import calc, sweep

COSTS = {"verify_factor": {1: 1.1, 2: 1.2}, "c": 0.1}


def row(rep, prompt, method, k, tokens, rounds, decode_s, drafted=0, kept=0, rejected=0, draft_s=0.0, mode="greedy"):
    return {"rep": rep, "prompt": prompt, "mode": mode, "method": method, "k": k, "tokens": tokens, "rounds": rounds,
            "drafted": drafted, "accepted": kept, "rejected": rejected, "prefill_s": 0.5, "decode_s": decode_s,
            "draft_s": draft_s, "verify_s": decode_s - draft_s, "e2e_s": 0.5 + decode_s}


@pytest.fixture
def rows():
    out = []
    for rep in (0, 1):
        for prompt in ("a", "b"):
            out.append(row(rep, prompt, "plain", 0, 100, 100, 10.0))  # 0.1 s per round
            # K = 2: 40 rounds, 60 kept of 80 drafted, 20 rejections; draft steps 0.01 s each -> c = 0.1.
            out.append(row(rep, prompt, "draft", 2, 100, 40, 5.0 + rep, 80, 60, 20, 0.8))
            out.append(row(rep, prompt, "draft", 1, 100, 60, 8.0, 60, 40, 20, 0.6))
    out.append(row(0, "a", "draft", 2, 100, 50, 9.0, 100, 50, 30, 1.0, mode="sample"))
    return out


def test_alpha_hat_counts_judged_drafts_not_proposed_ones(rows):
    greedy_k2 = [r for r in rows if r["method"] == "draft" and r["k"] == 2 and r["mode"] == "greedy"]
    # float64 ratios of small counts (~1e-16 relative): approx's default rel 1e-6 is ample, here and below
    assert sweep.alpha_hat(greedy_k2) == pytest.approx(60 / 80)  # 60 kept, 60 + 20 judged
    assert sweep.alpha_hat([row(0, "a", "draft", 4, 5, 1, 1.0, 4, 4, 0)]) == 1.0  # all kept, none rejected


def test_summary_speedups_spread_and_fits(rows):
    summary = sweep.summarize(rows, COSTS, [1, 2])
    # float64 sums and ratios of a few numbers and calc's formulas (~1e-15 relative): approx's default rel 1e-6 ample
    by = {(r["method"], r["k"]): r for r in summary["rows"]}
    assert by[("plain", 0)]["x"] == pytest.approx(1.0)
    k2 = by[("draft", 2)]
    assert k2["x"] == pytest.approx(40 / 22)  # 400 tokens in 22 s vs 400 in 40 s
    assert (k2["x_lo"], k2["x_hi"]) == (pytest.approx(20 / 12), pytest.approx(2.0))  # rep 1 vs rep 0
    assert k2["tokens_per_round"] == pytest.approx(2.5)
    assert k2["alpha_sample"] == pytest.approx(50 / 80)
    assert k2["x_e2e"] == pytest.approx(42 / 24)
    fit = summary["fits"]["draft"]
    assert fit["alpha"] == pytest.approx(400 / 560)  # all greedy draft rows pooled
    assert fit["c"] == pytest.approx((5.6 / 560) / 0.1)
    assert k2["predicted_tokens_per_round"] == pytest.approx(calc.expected_tokens(fit["alpha"], 2))
    assert k2["predicted_x_v"] == pytest.approx(calc.speedup(fit["alpha"], 2, fit["c"], 1.2))
    assert summary["best"]["measured"] == {"k": 2, "x": pytest.approx(40 / 22)}
    assert summary["best"]["predicted"]["k"] == calc.best_k(fit["alpha"], fit["c"], 2, COSTS["verify_factor"])[0]


def test_plain_decoding_is_the_best_k_when_every_k_loses():
    rows = [row(0, "a", "plain", 0, 100, 100, 10.0), row(0, "a", "draft", 1, 100, 90, 20.0, 90, 10, 80, 9.0)]
    best = sweep.summarize(rows, COSTS, [1])["best"]
    assert best["measured"]["k"] == 0 and best["predicted"]["k"] == 0


def test_printable_rows_hide_nan_and_show_the_spread():
    [out] = sweep.printable([{"method": "hf", "k": None, "x": 1.2, "x_lo": 1.0, "x_hi": 1.5, "alpha": math.nan}])
    assert out["spread"] == "1.00..1.50" and "alpha" not in out and "k" not in out


@pytest.mark.parametrize("argv, message", [
    (["--k", "0,2"], "every K >= 1"),
    (["--k", "two"], "comma-separated"),
    (["--methods", "draft,magic"], "unknown method"),
    (["--alpha", "2"], "--alpha must be in [0, 1]"),
])
def test_bad_arguments_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--pair", "tiny", *argv])
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "two.jsonl"
    path.write_text('{"id": "p1", "prompt": "Write a haiku about caches."}\n{"id": "p2", "prompt": "abcabcabc"}\n')
    return path


def test_a_tiny_sweep_writes_rows_summary_and_plot(prompts, tmp_path, capsys):
    data = sweep.main(["--pair", "tiny", "--prompts", str(prompts), "--max-new-tokens", "8", "--k", "1,3",
                       "--reps", "2", "--trials", "2", "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert "best K measured = " in out and "auto: " in out and "not independent" in out
    saved = json.loads((tmp_path / "sweep-latest.json").read_text())
    assert saved["mode"] == "full" and saved["setup"]["ks"] == [1, 3]
    greedy = [r for r in saved["rows"] if r["mode"] == "greedy"]
    # one row per repetition x prompt x configuration: plain, draft x 2, lookup x 2, auto, hf, hf-assisted
    assert len(greedy) == 2 * 2 * 8
    assert len([r for r in saved["rows"] if r["mode"] == "sample"]) == 2 * 2
    keys = {"rep", "prompt", "mode", "method", "k", "tokens", "rounds", "drafted", "accepted", "rejected", "prefill_s",
            "decode_s", "draft_s", "verify_s", "e2e_s", "round_counts", "round_times", "policy"}
    assert all(set(r) == keys for r in saved["rows"])
    for r in saved["rows"]:
        if r["rounds"] is not None:  # the loop's rows: one (draft, total) time pair per round, draft within total
            assert len(r["round_times"]) == r["rounds"] and all(0 <= d <= t for d, t in r["round_times"])
            assert abs(sum(t for _, t in r["round_times"]) - r["decode_s"]) < 1e-6 * r["rounds"]  # 7-digit rounding
        auto = r["method"] == "auto"
        assert (r["policy"] is not None) == auto
        if auto:
            assert r["policy"]["k"] in range(4) and r["policy"]["c"] > 0 and 0 <= r["policy"]["alpha"] <= 1
    loop_rows = [r for r in greedy if not r["method"].startswith("hf")]
    plain = {(r["rep"], r["prompt"]): r["tokens"] for r in loop_rows if r["method"] == "plain"}
    assert all(r["tokens"] == plain[(r["rep"], r["prompt"])] for r in loop_rows)  # greedy: the same text every time
    assert all(r["accepted"] + r["rejected"] <= r["drafted"] for r in greedy if r["drafted"])
    methods = [(r["method"], r["k"]) for r in saved["summary"]["rows"]]
    assert methods == [("plain", 0), ("draft", 1), ("draft", 3), ("lookup", 1), ("lookup", 3), ("auto", "auto"),
                       ("hf", None), ("hf-assisted", None)]
    assert set(saved["costs"]["verify_factor"]) == {"1", "3"} and saved["costs"]["c"] > 0
    pngs = list(tmp_path.glob("sweep-2*.png"))
    assert len(pngs) == 1 and pngs[0].stat().st_size > 10_000
    assert data["summary"]["best"]["measured"]["k"] in (0, 1, 3)
    replayed = {r["k"]: r["replayed_tokens_per_round"] for r in saved["summary"]["rows"] if r["method"] == "draft"}
    assert 1 <= replayed[1] <= 2 and 1 <= replayed[3] <= 4 and replayed[3] >= replayed[1]
    assert data["summary"]["best"]["predicted_replayed"]["k"] in (0, 1, 3)


def test_cost_only_mode_predicts_at_the_given_alpha(prompts, tmp_path, capsys):
    data = sweep.main(["--pair", "tiny", "--prompts", str(prompts), "--limit", "1", "--k", "1,2,4", "--alpha",
                       "0.8", "--trials", "2", "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert "best K predicted at alpha 0.8 = " in out
    assert data["mode"] == "cost-only" and [r["k"] for r in data["summary"]] == [1, 2, 4]
    c, v = data["costs"]["c"], data["costs"]["verify_factor"]
    # float64, calc.speedup on the same c and v (~1e-15 relative): approx's default rel 1e-6 is ample
    assert data["summary"][2]["predicted_x_v"] == pytest.approx(calc.speedup(0.8, 4, c, v[4]))
    assert list(tmp_path.glob("sweep-2*.png"))


def test_costs_feed_an_other_family_draft_its_own_ids(tiny):
    """With a remapped draft (--allow-other-family) the cost measurement must give the draft the prompt in the
    draft's own ids: the target's ids can lie outside its vocabulary (an IndexError before this was fixed)."""
    from types import SimpleNamespace

    import torch

    from spec.models import chat_ids

    class TenIdModel:  # a draft of 10 ids that records what it is fed
        device = torch.device("cpu")

        def __init__(self):
            self.length, self.fed = 0, []

        def reset(self):
            self.length = 0

        def rollback(self, length):
            self.length = length

        def forward(self, ids, keep=None):
            ids = [int(i) for i in ids]
            assert max(ids) < 10, "fed an id outside the draft's vocabulary"
            self.fed += ids
            self.length += len(ids)
            return torch.zeros(keep or len(ids), 10)

    class TenIdTokenizer:
        def __call__(self, text):
            return SimpleNamespace(input_ids=[ord(ch) % 10 for ch in text])

    pair = SimpleNamespace(target=tiny.target, draft=TenIdModel(), tokenizer=tiny.tokenizer,
                           draft_tokenizer=TenIdTokenizer())
    ids = chat_ids(tiny.tokenizer, "hello there")
    assert max(ids) >= 10
    costs = sweep.measure_costs(pair, ids, [1, 2], trials=1)
    assert costs["c"] > 0 and pair.draft.fed
