import json
import sys

import pytest
from PIL import Image

from train.logger import LoggerConfig, MetricsLogger


def test_metrics_jsonl_always_written(tmp_path):
    logger = MetricsLogger(tmp_path, LoggerConfig(name="none"), {"seed": 0})
    logger.log({"train/loss": 1.5}, step=0)
    logger.log({"train/loss": 1.0}, step=10)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "train/loss": 1.5}, {"step": 10, "train/loss": 1.0}]


def test_resumed_run_appends(tmp_path):
    for resumed, step in ((False, 0), (True, 5)):
        logger = MetricsLogger(tmp_path, LoggerConfig(name="none"), {}, resumed=resumed)
        logger.log({"train/loss": 1.0}, step=step)
        logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_non_main_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path, LoggerConfig(name="none"), {}, is_main=False)
    logger.log({"train/loss": 1.0}, step=0)
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_offline_run_keeps_its_id_across_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggerConfig(name="wandb", project="specdraft-test", run_name="t", tags=["test"], mode="offline")
    logger = MetricsLogger(tmp_path, cfg, {"trainer": {"lr": 1e-3}})
    logger.log({"train/loss": 2.0}, step=1)
    _png(tmp_path / "speedup.png")
    (tmp_path / "summary.md").write_text("| drafter | tau |\n|---|---|\n| medusa | 2.00 |\n")
    # The real wandb run, so the Table / chart / Image / Html types must serialise, not just construct.
    logger.log_report({"results": [{"drafter": "medusa", "tau": 2.0, "alpha": 0.5, "speedup": 1.5,
                                    "tokens_per_s": 10.0, "identical_to_greedy": True,
                                    "alpha_per_position": [0.6, None]}]}, tmp_path)
    assert logger.wandb_run.summary["eval/medusa/tau"] == 2.0
    logger.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    offline_runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline_runs, "wandb wrote no offline run"
    logger = MetricsLogger(tmp_path, cfg, {}, resumed=True)
    assert logger.wandb_run.id == run_id
    logger.close()


class _FakeRun:
    """Records what MetricsLogger sends to W&B, so tests assert exactly what was logged."""

    def __init__(self):
        self.logged: list[dict] = []
        self.summary: dict = {}

    def log(self, data, step=None):
        self.logged.append(dict(data))

    def finish(self):
        pass


def _fake_logger(tmp_path) -> tuple[MetricsLogger, _FakeRun]:
    logger = MetricsLogger(tmp_path, LoggerConfig(name="none"), {})
    logger.wandb_run = run = _FakeRun()
    return logger, run


def _png(path):
    Image.new("RGB", (4, 4), "white").save(path)


REPORT = {
    "num_prompts": 2,
    "results": [
        {"drafter": "medusa", "label": "medusa", "tau": 2.5, "alpha": 0.6, "speedup": 1.8, "identical_to_greedy": True,
         "tokens_per_s": 40.0, "alpha_per_position": [0.8, 0.5, None], "accept_counts": [1, 2, 3],
         "cost": {"overhead_ratio": 1.1}},
        {"drafter": "lookup", "tau": 1.2, "alpha": 0.1, "speedup": None, "identical_to_greedy": None,
         "sim_tau": 1.4, "alpha_per_position": [0.1]},
    ],
}


def test_log_report_results_table(tmp_path):
    logger, run = _fake_logger(tmp_path)
    logger.log_report(REPORT)
    table = run.logged[0]["eval/results"]
    # Scalars only (accept_counts / cost stay in report.json); extra keys in first-seen order; alpha as JSON last.
    assert table.columns == ["drafter", "tau", "alpha", "speedup", "identical_to_greedy", "label", "tokens_per_s",
                             "sim_tau", "alpha_per_position"]
    assert table.data == [
        ["medusa", 2.5, 0.6, 1.8, True, "medusa", 40.0, None, "[0.8, 0.5, null]"],
        ["lookup", 1.2, 0.1, None, None, None, None, 1.4, "[0.1]"],
    ]


def test_log_report_summary_keys_and_acceptance_chart(tmp_path):
    logger, run = _fake_logger(tmp_path)
    logger.log_report(REPORT)
    # lookup's speedup is None: no key rather than a None summary value.
    assert run.summary == {"eval/medusa/tau": 2.5, "eval/medusa/alpha": 0.6, "eval/medusa/speedup": 1.8,
                           "eval/lookup/tau": 1.2, "eval/lookup/alpha": 0.1}
    chart = run.logged[0]["eval/alpha_per_position"]
    assert chart.spec.fields == {"x": "position", "y": "alpha", "stroke": "drafter"}
    # The unreached position (None) is dropped, not drawn as 0.
    assert chart.table.data == [["medusa", 1, 0.8], ["medusa", 2, 0.5], ["lookup", 1, 0.1]]


def test_log_report_logs_eval_pngs_and_summary_md(tmp_path):
    import wandb

    for name in ("acceptance_per_position.png", "speedup.png", "stale.png"):
        _png(tmp_path / name)
    (tmp_path / "summary.md").write_text("| a < b |\n")
    logger, run = _fake_logger(tmp_path)
    logger.log_report({**REPORT, "plots": ["acceptance_per_position.png", "speedup.png", "batch_sweep.png"]}, tmp_path)
    logged = run.logged[0]
    # Only the figures this evaluation listed and that exist: not stale.png, not the missing batch_sweep.png.
    assert sorted(k for k in logged if k.startswith("eval/plots/")) == ["eval/plots/acceptance_per_position",
                                                                        "eval/plots/speedup"]
    assert isinstance(logged["eval/plots/speedup"], wandb.Image)
    assert isinstance(logged["eval/summary"], wandb.Html)
    assert "| a &lt; b |" in logged["eval/summary"].html


def test_log_report_without_plots_key_globs_pngs(tmp_path):
    _png(tmp_path / "speedup.png")
    logger, run = _fake_logger(tmp_path)
    logger.log_report(REPORT, tmp_path)
    assert "eval/plots/speedup" in run.logged[0]
    assert "eval/summary" not in run.logged[0]  # no summary.md written


@pytest.mark.parametrize("results", [[], [{}], [{"drafter": "x", "tau": None, "alpha_per_position": None}]])
def test_log_report_tolerates_missing_and_none(tmp_path, results):
    logger, run = _fake_logger(tmp_path)
    logger.log_report({"results": results}, tmp_path / "no_such_dir")
    table = run.logged[0]["eval/results"]
    assert table.columns == ["drafter", "tau", "alpha", "speedup", "identical_to_greedy", "alpha_per_position"]
    assert table.data == [[r.get("drafter"), r.get("tau"), None, None, None, None] for r in results]
    assert "eval/alpha_per_position" not in run.logged[0]  # nothing to plot
    assert run.summary == {}


@pytest.mark.parametrize("is_main", [True, False])
def test_log_report_is_a_no_op_without_wandb(tmp_path, monkeypatch, is_main):
    # With wandb made unimportable, any import inside log_report would raise.
    monkeypatch.setitem(sys.modules, "wandb", None)
    _png(tmp_path / "speedup.png")
    before = sorted(tmp_path.iterdir())
    logger = MetricsLogger(tmp_path, LoggerConfig(name="none"), {}, is_main=is_main)
    logger.log_report(REPORT, tmp_path)
    logger.close()
    assert logger.wandb_run is None
    after = sorted(p for p in tmp_path.iterdir() if p.name != "metrics.jsonl")
    assert after == before
