"""The best held-out step's weights (``best_tau/``): checked against their digest wherever they are read, and left
as they are by a resume refused before its first step (with ``metrics.jsonl``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import functools
from dataclasses import asdict

import pytest
import torch

from distill.data import collate
from distill.losses import forward_kl
from heads.base import build_drafter
from heads.saved import WEIGHTS
from tests.test_checkpoint import DFLASH, DyingEngine, Killed, make_cfg, make_dataset
from tests.test_selection import PEAK_AT_2, PEAK_AT_4, ScriptedTau, run
from train import checkpoint
from train.engine import SingleEngine
from train.logger import MetricsLogger
from train.loop import train
from train.selection import BEST_DIR, Selection


def _flip_last_byte(path: Path) -> None:
    """Damage ``path`` in place, same size, still parseable (the last byte of tensor data)."""
    intact = path.read_bytes()
    path.write_bytes(intact[:-1] + bytes([intact[-1] ^ 1]))


def test_damaged_best_step_weights_are_refused(tiny_teacher, tmp_path):
    cfg = make_cfg(eval_every=1)
    selection, _ = run(tiny_teacher, tmp_path, cfg, PEAK_AT_2)
    assert selection.final_weights() is not None  # intact: drafter/ takes them
    _flip_last_byte(tmp_path / BEST_DIR / WEIGHTS)
    with pytest.raises(ValueError, match=rf"^\S+/{BEST_DIR}/{WEIGHTS} is damaged: its sha256 .*trainer.select=last"):
        selection.final_weights()  # never re-digested into drafter/ as if sound


def test_a_damaged_checkpoint_copy_of_the_best_weights_is_refused_on_resume(tiny_teacher, tmp_path):
    cfg = make_cfg(eval_every=1)
    with pytest.raises(Killed):  # killed in step 6: the step-3 checkpoint holds best_tau/ of step 2
        run(tiny_teacher, tmp_path, cfg, PEAK_AT_2, DyingEngine(cfg.trainer, die_at=5))
    _flip_last_byte(tmp_path / "checkpoints" / "step_0000003" / BEST_DIR / WEIGHTS)
    with pytest.raises(ValueError, match=rf"step_0000003/{BEST_DIR}/{WEIGHTS} is damaged"):
        run(tiny_teacher, tmp_path, cfg, PEAK_AT_2)


def _resume(teacher, run_dir, cfg, taus):
    """``train.run``'s resume: the metrics logger told the step the checkpoint continues from."""
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    selection = Selection(ScriptedTau(taus), "best_tau", run_dir, {"drafter_cfg": cfg.drafter,
                                                                  "target_cfg": asdict(cfg.target),
                                                                  "target_identity": teacher.identity()})
    ckpt = checkpoint.resume_point(run_dir, "auto", cfg.trainer.steps)
    logger = MetricsLogger(run_dir, cfg.logger, asdict(cfg), resumed=True, resume_step=checkpoint.step_of(ckpt))
    try:
        train(cfg, teacher, drafter, make_dataset(), collate, functools.partial(forward_kl),
              SingleEngine(cfg.trainer), run_dir, logger, selection=selection)
    finally:
        logger.close()


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("change, match", [
    ("seed", "data seed=0, this run has 1"),
    ("attention", "trainer.attention=flex needs CUDA to train"),
])
def test_a_refused_resume_leaves_metrics_and_best_weights_as_they_were(tiny_teacher, tmp_path, change, match):
    cfg = make_cfg(DFLASH, eval_every=1)
    with pytest.raises(Killed):  # killed in step 6: best_tau/ (step 4) is newer than the step-3 checkpoint's copy
        run(tiny_teacher, tmp_path, cfg, PEAK_AT_4, DyingEngine(cfg.trainer, die_at=5))
    before = _snapshot(tmp_path)
    assert before["metrics.jsonl"].count(b"\n") == 5 and f"{BEST_DIR}/{WEIGHTS}" in before
    if change == "seed":
        cfg = replace(cfg, seed=1)
    else:
        cfg = replace(cfg, trainer=replace(cfg.trainer, attention="flex"))
    with pytest.raises(ValueError, match=match):
        _resume(tiny_teacher, tmp_path, cfg, PEAK_AT_4)
    assert _snapshot(tmp_path) == before
