"""DFlash under every data-parallel trainer on CPU with gloo, 2 ranks: DDP, FSDP2 and DeepSpeed ZeRO-1/2/3 train it to
the same loss curve and weights as one process on the same global batch (uneven valid-token counts per rank), and a
2-rank run killed mid-way resumes onto the uninterrupted curve.

Every candidate anchor is drawn (``num_anchors`` above the row length), so the blocks a row trains do not depend on
how rows are split over ranks. All engines run in one ``torch.multiprocessing.spawn`` (DeepSpeed's start-up is paid
once); slow, as the other kinds' distributed runs in ``test_distributed.py``.
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

pytestmark = pytest.mark.slow

DFLASH = {"_target_": "heads.dflash.DFlashDrafter", "block_size": 4, "num_layers": 1, "num_anchors": 64}
ENGINES = {"ddp": {"engine": "ddp"}, "fsdp": {"engine": "fsdp"},
           **{f"zero{s}": {"engine": "deepspeed", "zero_stage": s} for s in (1, 2, 3)}}


def config(world: int, **trainer):
    # The same global batch of 4 rows per step: 2 x 2 accumulation on one process, 2 x 1 on each of two ranks.
    return make_cfg(DFLASH, steps=STEPS, micro_batch_size=2, grad_accum=2 // world, ckpt_every=3, **trainer)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    out = Path(out)
    results = {}
    try:
        for name, options in ENGINES.items():
            cfg = config(WORLD, **options)
            weights = run_loop(cfg, out / name, build_engine(cfg.trainer))
            if rank == 0:
                torch.save(weights, out / f"{name}.pt")
            try:  # killed before step 4, then resumed by a fresh launch
                run_loop(cfg, out / f"{name}_resumed", _dying(build_engine(cfg.trainer), DIE_AT))
            except Killed:
                pass
            weights = run_loop(cfg, out / f"{name}_resumed", build_engine(cfg.trainer))
            if rank == 0:
                torch.save(weights, out / f"{name}_resumed.pt")
    except Exception:
        results["error"] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(out)), nprocs=WORLD)
    for rank in range(WORLD):
        results = json.loads((out / f"rank{rank}.json").read_text())
        assert "error" not in results, f"rank {rank} failed:\n{results['error']}"
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    cfg = config(1)
    return run_loop(cfg, out, build_engine(cfg.trainer)), _curve(out)


def _same(weights, reference):
    assert weights.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_ranks_match_one_process(engine, two_ranks, single):
    reference_weights, reference_curve = single
    curve = _curve(two_ranks / engine)
    assert curve.keys() == reference_curve.keys() == set(range(STEPS))
    for step, loss in reference_curve.items():
        assert curve[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    weights = torch.load(two_ranks / f"{engine}.pt", weights_only=True)
    _same(weights, reference_weights)
    torch.manual_seed(0)  # the runs trained: the weights moved well beyond the tolerance from initialisation
    initial = build_drafter(config(1).drafter, _teacher()).state_dict()
    assert max((initial[k] - weights[k]).abs().max() for k in initial) > 1e-3


@pytest.mark.parametrize("engine", list(ENGINES))
def test_two_ranks_killed_and_resumed_follow_the_uninterrupted_curve(engine, two_ranks, single):
    reference_weights, reference_curve = single
    resumed = two_ranks / f"{engine}_resumed"
    assert (resumed / "checkpoints" / "latest").read_text() == f"step_{STEPS:07d}"
    curve = _curve(resumed)
    assert set(curve) == set(range(STEPS))
    for step, loss in reference_curve.items():
        assert curve[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    _same(torch.load(two_ranks / f"{engine}_resumed.pt", weights_only=True), reference_weights)
