"""scripts/bench_context_length.py end to end on the tiny preset: train on 64-token windows, measure each context
length, render the table, resume without retraining."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_context_length.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_context_length", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow  # two short trainings in subprocesses; the measurement itself is tests/test_eval_context_lengths.py
def test_bench_context_length_tiny_rows_measure_every_length_and_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    bench = _load()
    out = tmp_path / "context.json"
    argv = ["--preset", "tiny", "--out", str(out), "--work", str(tmp_path / "work"), "--rows", "dflash",
            "dflash_window32"]
    bench.main(argv)
    results = json.loads(out.read_text())
    assert results["rows"]["dflash_window32"]["sliding_window"] == 32 and results["rows"]["dflash"]["sliding_window"] is None
    sweep = results["sweep"]
    assert sweep["lengths"] == [48, 96, 128] and set(sweep["drafters"]) == {"dflash", "dflash_window32"}
    for per_length in sweep["drafters"].values():
        for row in per_length.values():
            assert row["identical_to_greedy"] and row["tau"] >= 1.0
    assert results["rows"]["dflash"]["final"]["train/elapsed_s"] > 0

    def no_training(*args, **kwargs):
        raise AssertionError("a row already in --out was trained again")

    monkeypatch.setattr(bench, "train_row", no_training)
    bench.main([*argv, "--train-only"])
    assert "dflash: trained already" in capsys.readouterr().out
    bench.main([*argv, "--table"])
    assert "| `dflash_window32` | window 32 | 6 |" in capsys.readouterr().out


def test_every_row_composes_into_a_valid_config():
    """A misspelt override fails here, not after minutes of training."""
    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs

    bench = _load()
    register_configs()
    with initialize_config_dir(config_dir=str(SCRIPT.parents[1] / "conf"), version_base="1.3"):
        for name, (overrides, steps) in bench.ROWS.items():
            cfg = load_config(compose(config_name="config", overrides=[*overrides, *bench.PRESETS["toy"]["common"],
                                                                       *bench.TRAIN, f"trainer.steps={steps}"]))
            assert cfg.data.max_length == 64 and cfg.trainer.steps == steps
            assert cfg.drafter.get("sliding_window") == (bench.WINDOW if "window" in name else None)

