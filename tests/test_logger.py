import json

from train.logger import MetricsLogger


def test_metrics_jsonl_always_written(tmp_path):
    logger = MetricsLogger(tmp_path, {"name": "none"}, {"seed": 0})
    logger.log({"train/loss": 1.5}, step=0)
    logger.log({"train/loss": 1.0}, step=10)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "train/loss": 1.5}, {"step": 10, "train/loss": 1.0}]


def test_resumed_run_appends(tmp_path):
    for resumed, step in ((False, 0), (True, 5)):
        logger = MetricsLogger(tmp_path, {"name": "none"}, {}, resumed=resumed)
        logger.log({"train/loss": 1.0}, step=step)
        logger.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_non_main_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path, {"name": "none"}, {}, is_main=False)
    logger.log({"train/loss": 1.0}, step=0)
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_offline_run_keeps_its_id_across_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {"name": "wandb", "project": "specdraft-test", "entity": None, "run_name": "t", "group": None,
           "tags": ["test"], "mode": "offline"}
    logger = MetricsLogger(tmp_path, cfg, {"trainer": {"lr": 1e-3}})
    logger.log({"train/loss": 2.0}, step=1)
    logger.log_report({"results": [{"drafter": "medusa", "tau": 2.0, "alpha": 0.5, "speedup": 1.5,
                                    "tokens_per_s": 10.0, "identical_to_greedy": True}]})
    logger.close()
    run_id = (tmp_path / "wandb_run_id").read_text()
    offline_runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert offline_runs, "wandb wrote no offline run"
    logger = MetricsLogger(tmp_path, cfg, {}, resumed=True)
    assert logger.wandb_run.id == run_id
    logger.close()
