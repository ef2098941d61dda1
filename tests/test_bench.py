"""bench.py: its arithmetic on hand-built rows, and a real run against the live test server that must append
well-formed rows to a temporary scoreboard and write the raw per-request JSON."""

from __future__ import annotations

import json

import pytest
from test_server import KEY, ServerProcess

import bench

VLLM_METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 80.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 19.0
vllm:num_requests_running{engine="0"} 1.0
"""


def test_counters_are_read_from_vllm_style_metrics():
    assert bench.parse_counters(VLLM_METRICS) == {
        "spec_decode_num_drafts": 20.0, "spec_decode_num_draft_tokens": 80.0, "spec_decode_num_accepted_tokens": 60.0}
    assert bench.parse_counters("# no spec decode here\nhttp_requests_total 3\n") is None


def test_summary_arithmetic():
    rows = [
        {"ok": True, "ttft": 0.1, "e2e": 1.1, "tokens": 11, "tpot": (1.1 - 0.1) / 10, "itl": [0.1] * 10},
        {"ok": True, "ttft": 0.3, "e2e": 2.3, "tokens": 21, "tpot": (2.3 - 0.3) / 20, "itl": [0.1] * 20},
        {"ok": False, "error": "RateLimitError: 429"},
    ]
    before = {"spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 20, "spec_decode_num_accepted_tokens": 10}
    after = {"spec_decode_num_drafts": 15, "spec_decode_num_draft_tokens": 60, "spec_decode_num_accepted_tokens": 40}
    s = bench.summarise(rows, wall=4.0, before=before, after=after)
    # float64 sums, ratios and medians of a few numbers (~1e-16 relative): approx's default rel 1e-6 is ample
    assert s["requests"] == 3 and s["failures"] == 1
    assert s["tok_s"] == pytest.approx(32 / 4.0) and s["req_s"] == pytest.approx(0.5)
    assert s["ttft_p50"] == pytest.approx(0.2) and s["tpot_p50"] == pytest.approx(0.1)
    assert s["decode_tok_s"] == pytest.approx((10 + 20) / (1.0 + 2.0))
    assert s["acceptance"] == pytest.approx(30 / 40) and s["acceptance_length"] == pytest.approx(1 + 30 / 10)
    hosted = bench.summarise(rows, wall=4.0, before=None, after=None)
    assert hosted["acceptance"] is None
    row = bench.scoreboard_row({"concurrency": 4, "summary": hosted}, {
        "date": "2026-12-02", "target": "t", "hardware": "h", "model": "m", "precision": "bf16", "method": "ngram",
        "k": "4", "change": "a | b"})
    cells = row.strip().strip("|").split(" | ")
    assert len(cells) == 17 and cells[13] == cells[14] == "—" and cells[-1].strip() == "a / b"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """With the key given as a file (--api-key-file), which the bench must then send."""
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    srv = ServerProcess("--method", "draft", "--k", "3", "--api-key-file", str(key_file), key=None)
    srv.key = KEY
    yield srv
    srv.stop()


def test_bench_against_the_live_server(server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"say {i}"}) for i in range(3)) + "\n")
    board = tmp_path / "SCOREBOARD.md"
    code = bench.main(["--base-url", f"{server.url}/v1", "--api-key", KEY, "--target", "test", "--prompts",
                       str(prompts), "--concurrency", "1,2", "--n", "3", "--max-tokens", "5", "--ignore-eos",
                       "--scoreboard", str(board), "--out", str(tmp_path / "results"), "--quiet",
                       "--change", "ci"])
    assert code == 0
    text = board.read_text()
    assert text.startswith(bench.SCOREBOARD_HEAD) and "TTFT" in text
    rows = [line for line in text[len(bench.SCOREBOARD_HEAD):].splitlines() if line]
    assert len(rows) == 2
    header = [c.strip() for c in bench.SCOREBOARD_HEAD.strip().splitlines()[-2].strip("|").split("|")]
    for row, concurrency in zip(rows, ("1", "2")):
        cells = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
        assert len(cells) == len(header) == 17
        assert cells["model"] == "tiny" and cells["method"] == "draft" and cells["K"] == "3"
        # the server's default --draft-quant auto gives the tiny draft int4 weights on a CPU; the row says so
        assert cells["precision"] == "float32, int4 draft" and cells["conc"] == concurrency and cells["fail"] == "0"
        assert 0 <= float(cells["accept"]) <= 1 and 1 <= float(cells["len"]) <= 4
        assert float(cells["TTFT p50 ms"]) > 0 and float(cells["tok/s"]) > 0
        assert cells["change"] == "p ×3; max 5 tok; ignore_eos; ci"
    raw = json.loads((tmp_path / "results" / "bench-latest.json").read_text())
    assert [level["concurrency"] for level in raw["levels"]] == [1, 2]
    for level in raw["levels"]:
        assert len(level["requests"]) == 3
        for request in level["requests"]:
            assert request["ok"] and request["tokens"] == 5 and request["e2e"] >= request["ttft"] > 0
            # float64, the same (e2e - ttft) / (tokens - 1) on the same JSON-round-tripped floats: bit-identical
            assert request["tpot"] == (request["e2e"] - request["ttft"]) / 4
    assert "api_key" not in raw["config"]


def test_sampling_fields_are_sent_only_when_given():
    args = bench.parse_args(["--presence-penalty", "1", "--logit-bias", '{"10": -100}', "--top-k", "20", "--coupled",
                             "--seed", "3"])
    assert bench.sampling_fields(args) == {"presence_penalty": 1.0, "seed": 3, "logit_bias": {"10": -100.0},
                                           "extra_body": {"top_k": 20, "coupled": True}}
    assert bench.sampling_fields(bench.parse_args([])) == {}
    with pytest.raises(SystemExit):
        bench.parse_args(["--logit-bias", "[1, 2]"])


def test_bench_scores_a_penalised_workload(server, tmp_path):
    """The scoreboard can score a workload with penalties, bias, min_p and coupled sampling: no request fails and
    the row's note names what was sent."""
    board = tmp_path / "SCOREBOARD.md"
    code = bench.main(["--base-url", f"{server.url}/v1", "--api-key", KEY, "--target", "test", "--prompts", "short",
                       "--concurrency", "1", "--n", "2", "--max-tokens", "6", "--temperature", "0.8", "--seed", "3",
                       "--presence-penalty", "1.0", "--frequency-penalty", "0.5", "--logit-bias", '{"10": -100}',
                       "--min-p", "0.05", "--coupled", "--scoreboard", str(board), "--out", str(tmp_path / "r"),
                       "--quiet"])
    assert code == 0
    row = board.read_text().splitlines()[-1]
    assert "| 0 |" in row and "presence_penalty=1.0" in row and "coupled=True" in row and "min_p=0.05" in row
