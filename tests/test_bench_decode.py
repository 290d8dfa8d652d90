"""scripts/bench_decode.py end to end on the tiny preset (builds a tiny target + draft LM, trains Medusa 20 steps)."""

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
    assert {"medusa-chain", "medusa-tree[default]", "draft_model", "lookup", "hf_generate",
            "hf_assisted[draft_model]", "plain"} <= set(summary)
    for name in ("medusa-chain", "medusa-tree[default]", "draft_model", "lookup"):
        row = summary[name]
        assert row["identical_to_greedy"] and row["tau"] >= 1 and row["overhead_ratio"] > 0
    assert data["machine"]["torch"] and data["target_params"] > data["draft_params"] > 0
    assert "greedy_auto_tune" in data["runs"]
    assert set(data["transfers_per_step"]) == {"medusa-chain", "medusa-tree[default]", "draft_model", "lookup"}
    assert all(0 < n <= 4 for n in data["transfers_per_step"].values()), data["transfers_per_step"]
