"""trainer.select=best_tau on 2 DDP ranks (torchrun, gloo): drafter/ gets the best held-out τ's weights, the ranks
agree on every choice, and a run killed after a checkpoint and rerun selects and writes the same weights.

Each rank runs this file as its entry point (``-m tests.test_selection_ranks``): ``run_training`` of a smoke run, with
the held-out evaluation wrapped so that the real one still runs (and is recorded) on every rank, while the figure the
selection gets is scripted by step, and different on rank 1: ranks can only agree by taking rank 0's.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from heads.saved import WEIGHTS
from tests import torchrun
from train import checkpoint
from train.selection import BEST_DIR

RANK0_TAU = {1: 1.0, 2: 1.5, 3: 1.2, 4: 2.0, 5: 1.9, 6: 1.1}  # best at step 4: after the step-3 checkpoint
RANK1_TAU = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4, 6: 3.0}  # what rank 1 would choose alone: step 6
RUNNING_BEST = [1, 2, 2, 4, 4, 4]


def worker(run_dir: str, record_dir: str, die_at: str) -> None:
    """One rank: 6 steps, a checkpoint every 3, the held-out evaluation after every step; with ``die_at`` >= 0,
    rank 1 kills itself (SIGKILL) as step ``die_at`` (0-based) starts."""
    import train.loop
    import train.run
    from tests.test_reliability_run import compose_cfg
    from train.selection import HeldoutTau, Selection

    rank, records = int(os.environ["RANK"]), Path(record_dir)
    records.mkdir(parents=True, exist_ok=True)

    def record(entry: dict) -> None:
        with (records / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")

    class ScriptedTau:
        def __init__(self, *args, **kwargs):
            self.real = HeldoutTau(*args, **kwargs)

        def __call__(self, step, model, drafter, loss_fn, engine):
            record({"step": step, "real_tau": self.real(step, model, drafter, loss_fn, engine)})
            if engine.is_main:
                save_file({k: v.contiguous() for k, v in engine.module.state_dict().items()},
                          str(records / f"step{step}.safetensors"))
            return (RANK0_TAU if rank == 0 else RANK1_TAU)[step]

    evaluate, lr_at = Selection.evaluate, train.loop.lr_at

    def recorded_evaluate(self, step, *args):
        out = evaluate(self, step, *args)
        record({"step": step, "selection": out})
        return out

    def dying_lr_at(step, trainer_cfg):
        if step == int(die_at) and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return lr_at(step, trainer_cfg)

    train.run.HeldoutTau, Selection.evaluate, train.loop.lr_at = ScriptedTau, recorded_evaluate, dying_lr_at
    cfg = compose_cfg(os.environ["SPECDRAFT_CACHE"], "trainer=ddp", "trainer.steps=6", "trainer.ckpt_every=3",
                      "trainer.eval_every=1", "trainer.eval_rows=2", "trainer.select=best_tau")
    train.run.run_training(cfg, run_dir)


def launch(run_dir: Path, record_dir: Path, die_at: int = -1):
    cmd = torchrun.command("tests.test_selection_ranks", [str(run_dir), str(record_dir), str(die_at)], 2)
    if die_at < 0:
        return torchrun.run(cmd)
    launcher = torchrun.start(cmd)
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode != 0, err[-3000:]
    return launcher


def records(record_dir: Path, rank: int, key: str) -> list:
    lines = [json.loads(line) for line in (record_dir / f"rank{rank}.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in lines if key in r]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_best_tau_under_ddp_is_rank0s_choice_written_and_kept_by_a_resume(tmp_path, tiny_toy_target):
    whole, rec = tmp_path / "whole", tmp_path / "rec-whole"
    launch(whole, rec)
    selections = [records(rec, rank, "selection") for rank in (0, 1)]
    assert selections[0] == selections[1]  # every rank made every choice rank 0 made
    assert [(s, r["eval/best_step"]) for s, r in selections[0]] == list(zip(range(1, 7), RUNNING_BEST))
    assert [r["eval/heldout_sim_tau"] for _, r in selections[1]] == [RANK0_TAU[s] for s in range(1, 7)]
    real = [records(rec, rank, "real_tau") for rank in (0, 1)]
    assert len(real[0]) == 6 and real[0] == real[1]  # the real evaluation: the same figure on both ranks
    drafter = weights(whole / "drafter" / WEIGHTS)
    assert same(drafter, weights(rec / "step4.safetensors")) and not same(drafter, weights(rec / "step6.safetensors"))
    assert json.loads((whole / BEST_DIR / "config.json").read_text())["step"] == 4
    final = json.loads((whole / "drafter" / "config.json").read_text())["training"]["final"]
    assert (final["selected_step"], final["selected_heldout_sim_tau"]) == (4, RANK0_TAU[4])

    # Killed as step 5 starts: the run dir's best_tau/ is step 4's, newer than the step-3 checkpoint's selection.
    cut = tmp_path / "cut"
    launch(cut, tmp_path / "rec-cut", die_at=4)
    assert not (cut / "drafter").exists()
    assert checkpoint.saved_selection(cut / "checkpoints" / "step_0000003")["best_step"] == 2
    assert json.loads((cut / BEST_DIR / "config.json").read_text())["step"] == 4
    launch(cut, tmp_path / "rec-resume")
    assert [s for s, _ in records(tmp_path / "rec-resume", 1, "selection")] == [4, 5, 6]  # resumed after step 3
    assert json.loads((cut / BEST_DIR / "config.json").read_text())["step"] == 4
    assert same(weights(cut / "drafter" / WEIGHTS), drafter)


if __name__ == "__main__":  # one rank of the launch above
    worker(*sys.argv[1:])
