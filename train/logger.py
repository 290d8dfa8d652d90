"""Metrics sink: always ``<run dir>/metrics.jsonl``; Weights & Biases too when ``logger.name=wandb``.

Only the main rank writes. wandb is imported lazily so ``logger=none`` never touches it.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, run_dir, logger_cfg: Mapping, full_cfg: Mapping, is_main: bool = True, resumed: bool = False):
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb_run = None
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if resumed else "w")
        if logger_cfg["name"] == "wandb":
            self.wandb_run = _start_wandb(run_dir, logger_cfg, full_cfg)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.is_main:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=step)

    def log_report(self, report: Mapping[str, Any]) -> None:
        if not self.is_main or self.wandb_run is None:
            return
        import wandb

        keys = ["drafter", "tau", "alpha", "speedup", "tokens_per_s", "identical_to_greedy"]
        table = wandb.Table(columns=keys, data=[[r[k] for k in keys] for r in report["results"]])
        self.wandb_run.log({"eval/results": table})
        for r in report["results"]:
            self.wandb_run.summary[f"eval/{r['drafter']}/tau"] = r["tau"]
            self.wandb_run.summary[f"eval/{r['drafter']}/speedup"] = r["speedup"]

    def close(self) -> None:
        if not self.is_main:
            return
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _start_wandb(run_dir, logger_cfg: Mapping, full_cfg: Mapping):
    try:
        import wandb
    except ImportError as e:
        raise ImportError("logger=wandb needs the wandb package: pip install wandb (or use logger=none)") from e
    if logger_cfg["mode"] not in ("online", "offline", "disabled"):
        raise ValueError(f"logger.mode={logger_cfg['mode']!r}; valid: online, offline, disabled")
    # The run id is stable per run dir so a resumed run continues the same W&B run.
    run_id_file = Path(run_dir) / "wandb_run_id"
    run_id = run_id_file.read_text().strip() if run_id_file.is_file() else uuid.uuid4().hex[:12]
    run_id_file.write_text(run_id)
    return wandb.init(
        project=logger_cfg["project"], entity=logger_cfg.get("entity"), name=logger_cfg.get("run_name"),
        group=logger_cfg.get("group"), tags=list(logger_cfg.get("tags") or []), mode=logger_cfg["mode"],
        dir=str(run_dir), config=dict(full_cfg), id=run_id, resume="allow",
    )
