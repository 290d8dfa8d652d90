"""A drafter under every data-parallel trainer on CPU with gloo, 2 ranks, against one process on the same global
batch: the shared harness of the per-kind trainer tests (``test_dflash_trainers.py``, ``test_peagle_trainers.py``).

One ``torch.multiprocessing.spawn`` of 2 ranks trains the drafter under DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 in turn
(DeepSpeed's start-up is paid once), each run uninterrupted and again killed before step ``DIE_AT`` and resumed by a
fresh launch; the single-process run is the reference. The data (``test_distributed.uneven_dataset``) gives ranks
uneven valid-token counts within a step.
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch

from heads.base import build_drafter
from tests.test_checkpoint import Killed, make_cfg
from tests.test_distributed import DIE_AT, STEPS, WORLD, _curve, _dying, _teacher, run_loop
from train.engine import build_engine

ENGINES = {"ddp": {"engine": "ddp"}, "fsdp": {"engine": "fsdp"},
           **{f"zero{s}": {"engine": "deepspeed", "zero_stage": s} for s in (1, 2, 3)}}


def config(drafter: dict, world: int, **trainer):
    # The same global batch of 4 rows per step: 2 x 2 accumulation on one process, 2 x 1 on each of two ranks.
    return make_cfg(drafter, steps=STEPS, micro_batch_size=2, grad_accum=2 // world, ckpt_every=3, **trainer)


def _worker(rank: int, port: int, out: str, drafter: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    out = Path(out)
    results = {}
    try:
        for name, options in ENGINES.items():
            cfg = config(drafter, WORLD, **options)
            weights = run_loop(cfg, out / name, build_engine(cfg.trainer))
            if rank == 0:
                torch.save(weights, out / f"{name}.pt")
            try:  # killed before step DIE_AT, then resumed by a fresh launch
                run_loop(cfg, out / f"{name}_resumed", _dying(build_engine(cfg.trainer), DIE_AT))
            except Killed:
                pass
            weights = run_loop(cfg, out / f"{name}_resumed", build_engine(cfg.trainer))
            if rank == 0:
                torch.save(weights, out / f"{name}_resumed.pt")
    except Exception:
        results["error"] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def two_ranks(out: Path, drafter: dict) -> Path:
    """Every engine's runs of ``drafter`` on 2 ranks, written under ``out``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(out), drafter), nprocs=WORLD)
    for rank in range(WORLD):
        results = json.loads((out / f"rank{rank}.json").read_text())
        assert "error" not in results, f"rank {rank} failed:\n{results['error']}"
    return out


def single(out: Path, drafter: dict) -> tuple[dict, dict]:
    """(weights, loss per step) of ``drafter`` trained in one process."""
    cfg = config(drafter, 1)
    return run_loop(cfg, out, build_engine(cfg.trainer)), _curve(out)


def _same(weights, reference, atol: float = 1e-6):
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=atol, msg=name)


def assert_matches_one_process(drafter: dict, engine: str, ranks_dir: Path, reference, atol: float = 1e-6) -> None:
    """The engine's 2-rank curve and final weights (to ``atol``) are the single-process ones, and training moved the
    weights."""
    reference_weights, reference_curve = reference
    curve = _curve(ranks_dir / engine)
    assert curve.keys() == reference_curve.keys() == set(range(STEPS))
    for step, loss in reference_curve.items():
        assert curve[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    weights = torch.load(ranks_dir / f"{engine}.pt", weights_only=True)
    _same(weights, reference_weights, atol)
    torch.manual_seed(0)  # the runs trained: the weights moved well beyond the tolerance from initialisation
    initial = build_drafter(config(drafter, 1).drafter, _teacher()).state_dict()
    assert max((initial[k] - weights[k]).abs().max() for k in initial) > 1e-3


def assert_resumed_onto_the_curve(engine: str, ranks_dir: Path, reference, atol: float = 1e-6) -> None:
    """The engine's 2-rank run killed mid-way and resumed ends on the uninterrupted single-process curve."""
    reference_weights, reference_curve = reference
    resumed = ranks_dir / f"{engine}_resumed"
    assert (resumed / "checkpoints" / "latest").read_text() == f"step_{STEPS:07d}"
    curve = _curve(resumed)
    assert set(curve) == set(range(STEPS))
    for step, loss in reference_curve.items():
        assert curve[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    _same(torch.load(ranks_dir / f"{engine}_resumed.pt", weights_only=True), reference_weights, atol)
