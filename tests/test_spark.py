"""spec.spark: the Spark projection's arithmetic on a hand-made bench_engine record."""

import json

import pytest

from spec import spark
from spec.calc import speedup


def bench(**extra) -> dict:
    # A 10 GB target (1 GB of it an untied embedding) measured at 1000 GB/s: 9 ms of bytes read + 1 ms overhead.
    # A 2 GB tied draft: 2 ms of bytes + 0.5 ms; its int4 copy 0.8 GB counted (0.3 GB read once the 0.5 GB table
    # is taken out) in 0.6 ms: 0.3 ms of bytes + 0.3 ms overhead.
    return {"bandwidth_gb_s": 1000.0, "device_name": "test GPU", "pair": "p", "dtype": "bfloat16",
            "weight_bytes": {"target": 10e9, "draft": 2e9, "draft_int4": 0.8e9},
            "embedding": {"target": {"bytes": 1e9, "tied": False}, "draft": {"bytes": 0.5e9, "tied": True}},
            "steps_ms": {"graph": {"target": {"1": 10.0, "2": 10.2, "3": 10.4}, "draft": {"1": 2.5}}},
            "draft_step_ms_int4": 0.6, **extra}


def test_read_bytes_takes_out_the_table_a_step_reads_one_row_of():
    assert spark.read_bytes(10.0, {"bytes": 1.0, "tied": False}, False) == 9.0  # untied: the head is read, not it
    assert spark.read_bytes(10.0, {"bytes": 1.0, "tied": True}, False) == 10.0  # tied: the table is the head
    assert spark.read_bytes(10.0, {"bytes": 1.0, "tied": True}, True) == 9.0  # the packed head is counted apart
    assert spark.read_bytes(10.0, None, True) == 10.0  # an older record: as counted


def test_projection_scales_bytes_and_keeps_each_overhead():
    rows = spark.project(bench(), bandwidth=100.0, alphas=[0.8], max_k=2)
    by = {r["draft"]: r for r in rows}
    assert by["bf16"]["target_ms"] == pytest.approx(9e9 / 100e9 * 1e3 + 1.0)  # 91 ms
    assert by["bf16"]["draft_ms"] == pytest.approx(20.0 + 0.5)
    assert by["int4"]["draft_ms"] == pytest.approx(3.0 + 0.3)  # its own overhead, not bf16's
    target = by["bf16"]["target_ms"]
    verify = {1: (target + 0.2) / target, 2: (target + 0.4) / target}  # the extra of verify(n) carried in ms
    for row in rows:
        expected = max(speedup(0.8, k, row["c"], verify) for k in (1, 2))
        assert row["speedup"] == pytest.approx(expected)
        assert row["best_k"] == 2 and row["tok_s"] == pytest.approx(1e3 / target * expected)


def test_cli_writes_rows_and_refuses_a_record_without_graph_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    good, bad = tmp_path / "b.json", tmp_path / "bad.json"
    good.write_text(json.dumps(bench()))
    bad.write_text(json.dumps({**bench(), "steps_ms": {"eager": {}}}))
    out = spark.main([str(good), "--alphas", "0.7"])
    assert [r["draft"] for r in out["rows"]] == ["bf16", "int4"] and "PROJECTION" in capsys.readouterr().out
    assert list((tmp_path / "results").glob("spark-*.json"))
    with pytest.raises(SystemExit):
        spark.main([str(bad)])
    with pytest.raises(SystemExit):
        spark.main([str(good), "--alphas", "1.2"])


def test_an_older_llama_random_record_gets_its_known_embedding_tables():
    table = spark.known_embedding({"pair": "llama-random", "dtype": "bfloat16"})
    assert table["target"] == {"bytes": 128256 * 4096 * 2, "tied": False}  # Llama 3.1 8B: its own head
    assert table["draft"] == {"bytes": 128256 * 2048 * 2, "tied": True}  # Llama 3.2 1B: the head is the table
    assert spark.known_embedding({"pair": "qwen-coder"}) == {}
