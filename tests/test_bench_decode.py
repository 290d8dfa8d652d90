"""scripts/bench_decode.py end to end on the tiny preset (builds a tiny target + draft LM, trains Medusa, EAGLE-1,
EAGLE-3 and DFlash 20 steps each)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"


@pytest.mark.slow
def test_bench_decode_tiny_writes_every_figure(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["--preset", "tiny", "--out", str(out), "eval.num_prompts=2"])
    data = json.loads(out.read_text())
    summary = data["runs"]["greedy"]["summary"]
    methods = ("medusa-chain", "medusa-tree[default]", "draft_model", "lookup", "eagle1", "eagle3", "dflash", "peagle",
               "dspark", "dspark_nomarkov", "dspark[conf=0.3]", "dspark[conf=0.5]", "dspark_nomarkov[conf=0.3]",
               "dspark_nomarkov[conf=0.5]")
    assert {*methods, "hf_generate", "hf_assisted[draft_model]", "plain"} <= set(summary)
    best = max(summary["plain"]["tokens_per_s"], summary["hf_generate"]["tokens_per_s"])
    for name in methods:
        row = summary[name]
        assert row["identical_to_greedy"] and row["tau"] >= 1 and row["overhead_ratio"] > 0
        assert row["over_best_baseline"] == pytest.approx(row["tokens_per_s"] / best)
    assert data["machine"]["torch"] and data["target_params"] > data["draft_params"] > 0
    assert "greedy_auto_tune" in data["runs"]
    assert set(data["transfers_per_step"]) == set(methods)
    assert all(0 < n <= 4 for n in data["transfers_per_step"].values()), data["transfers_per_step"]
    assert summary["dflash"]["num_draft"] == summary["dspark"]["num_draft"] == 7  # the recipes' whole block (8 - 1)
    assert set(methods) <= set(data["offered_per_token"])
    assert data["offered_per_token"]["dspark[conf=0.5]"] <= data["offered_per_token"]["dspark"]
    assert summary["dspark[conf=0.5]"]["verified_per_token"] <= summary["dspark"]["verified_per_token"]


def test_bench_decode_refuses_unknown_methods(capsys):
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit):
        bench.main(["--methods", "eagle1,eagle9"])
    assert "unknown ['eagle9']" in capsys.readouterr().err
