"""Metrics sink: always ``<run dir>/metrics.jsonl``; Weights & Biases too when ``logger.name=wandb``.

Only the main rank writes. wandb is imported lazily so ``logger=none`` never touches it.
"""

from __future__ import annotations

import html
import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional

log = logging.getLogger(__name__)


@dataclass
class LoggerConfig:
    name: str = "none"  # none (metrics.jsonl only) | wandb (metrics.jsonl + W&B)
    project: str = "specdraft"
    entity: Optional[str] = None
    run_name: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    mode: str = "offline"  # online | offline | disabled


class MetricsLogger:
    def __init__(self, run_dir, logger_cfg: LoggerConfig, full_cfg: Mapping, is_main: bool = True, resumed: bool = False,
                 resume_step: int | None = None):
        """``resume_step``: the step a resumed run continues from; rows logged at or after it (by the run that was
        killed after its last checkpoint) are dropped, since the resumed run logs them again: each step once. The
        file is cut and opened at the first row logged, not here: a resume refused before its first step (another
        seed, loss, attention kernel) leaves ``metrics.jsonl`` as it found it."""
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb_run = None
        self._file = None
        self._resume_step, self._append = resume_step, resumed or resume_step is not None
        if not is_main:
            return
        if logger_cfg.name == "wandb":
            self.wandb_run = _start_wandb(run_dir, logger_cfg, full_cfg)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.is_main:
            return
        if self._file is None:
            self._open()
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=step)

    def log_report(self, report: Mapping[str, Any], run_dir=None) -> None:
        """Log an evaluation report (the dict eval writes to ``report.json``) to W&B: an ``eval/results`` table,
        ``eval/<drafter>/{tau,alpha,speedup}`` summary keys, an ``eval/alpha_per_position`` chart and, from ``run_dir``,
        eval's PNGs (``eval/plots/<stem>``) and ``summary.md`` (``eval/summary``). A no-op without W&B."""
        if not self.is_main or self.wandb_run is None:
            return
        import wandb

        results = list(report.get("results") or [])
        names = [str(r.get("drafter") or f"result{i}") for i, r in enumerate(results)]  # a key even if drafter is absent
        payload: dict[str, Any] = {"eval/results": _results_table(wandb, results)}
        points = [[name, i, a] for name, r in zip(names, results)
                  for i, a in enumerate(r.get("alpha_per_position") or [], 1) if a is not None]
        if points:  # None marks a position never reached: no evidence, so no point (as eval/plots.py draws it)
            table = wandb.Table(columns=["drafter", "position", "alpha"], data=points)
            payload["eval/alpha_per_position"] = wandb.plot.line(
                table, "position", "alpha", stroke="drafter", title="Acceptance per draft position")
        if run_dir is not None:
            payload.update(_report_files(wandb, report, Path(run_dir)))
        self.wandb_run.log(payload)
        for name, r in zip(names, results):
            for key in ("tau", "alpha", "speedup"):
                if r.get(key) is not None:
                    self.wandb_run.summary[f"eval/{name}/{key}"] = r[key]

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._resume_step is not None:
            keep_rows_before(self.path, self._resume_step)
        self._file = self.path.open("a" if self._append else "w")

    def close(self) -> None:
        if not self.is_main:
            return
        if self._file is not None:
            self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def keep_rows_before(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the rows logged at ``step`` or later; a torn last line (a kill mid-write)
    goes too."""
    if not path.is_file():
        return
    kept, lines = [], path.read_text(encoding="utf-8", errors="replace").splitlines()
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
            kept.append(line + "\n")
    if len(kept) == len(lines):  # nothing to drop: leave the file untouched
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def _start_wandb(run_dir, logger_cfg: LoggerConfig, full_cfg: Mapping):
    try:
        import wandb
    except ImportError as e:
        raise ImportError("logger=wandb needs the wandb package: pip install wandb (or use logger=none)") from e
    if logger_cfg.mode not in ("online", "offline", "disabled"):
        raise ValueError(f"logger.mode={logger_cfg.mode!r}; valid: online, offline, disabled")
    # The run id is stable per run dir so a resumed run continues the same W&B run.
    run_id_file = Path(run_dir) / "wandb_run_id"
    run_id = run_id_file.read_text().strip() if run_id_file.is_file() else uuid.uuid4().hex[:12]
    run_id_file.write_text(run_id)
    return wandb.init(
        project=logger_cfg.project, entity=logger_cfg.entity, name=logger_cfg.run_name,
        group=logger_cfg.group, tags=list(logger_cfg.tags), mode=logger_cfg.mode,
        dir=str(run_dir), config=dict(full_cfg), id=run_id, resume="allow",
    )


_LEADING_COLUMNS = ("drafter", "tau", "alpha", "speedup", "identical_to_greedy")
_SCALAR = (int, float, str, bool, type(None))


def _results_table(wandb, results: list[Mapping[str, Any]]):
    """One row per result: the leading columns, every other scalar key any result has (missing -> None), and
    ``alpha_per_position`` as JSON. Nested values (``cost``, ``categories``) stay in report.json."""
    extra: list[str] = []
    for r in results:
        extra += [k for k, v in r.items()
                  if isinstance(v, _SCALAR) and k not in (*_LEADING_COLUMNS, "alpha_per_position", *extra)]
    keys = [*_LEADING_COLUMNS, *extra]

    def cell(value):  # a key scalar in one result may be nested in another: keep the row loggable
        return value if isinstance(value, _SCALAR) else json.dumps(value)

    rows = [[cell(r.get(k)) for k in keys]
            + [None if r.get("alpha_per_position") is None else json.dumps(r["alpha_per_position"])] for r in results]
    # Mixed types: a column may be None in one row and a number (or a JSON string) in another.
    return wandb.Table(columns=[*keys, "alpha_per_position"], data=rows, allow_mixed_types=True)


def _report_files(wandb, report: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    # report["plots"] names the figures this evaluation wrote; a glob could pick up stale ones from an earlier eval.
    names = report["plots"] if "plots" in report else sorted(p.name for p in run_dir.glob("*.png"))
    out: dict[str, Any] = {f"eval/plots/{Path(n).stem}": wandb.Image(str(run_dir / n))
                           for n in names if (run_dir / n).is_file()}
    summary = run_dir / "summary.md"
    if summary.is_file():  # W&B renders HTML, not Markdown: a <pre> block keeps the tables aligned
        out["eval/summary"] = wandb.Html(f"<pre>{html.escape(summary.read_text())}</pre>")
    return out
