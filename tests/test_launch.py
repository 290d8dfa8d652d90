"""The launchers users type, end to end on CPU with 2 processes: scripts/train.sh (torchrun, one shared run dir,
rank-0 writing) and plain torchrun without a run dir (every rank adopts rank 0's)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from train.checkpoint import STATE

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["experiment=smoke", "trainer.device=cpu", "trainer.steps=4", "trainer.log_every=1", "trainer.ckpt_every=2",
         "trainer.num_threads=1", "eval.enabled=false"]


def launch(cmd, cwd, **env):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_train_sh_runs_two_ranks_in_one_run_dir(tmp_path, tiny_toy_target):
    run_dir = tmp_path / "run"
    launch([str(ROOT / "scripts" / "train.sh"), *QUICK], ROOT, NPROC="2", SPECDRAFT_RUN_DIR=str(run_dir),
           PYTHON=sys.executable)
    state = torch.load(run_dir / "checkpoints" / "step_0000004" / STATE, weights_only=True)
    assert (state["engine"], state["world_size"], state["data"]["global_batch"]) == ("ddp", 2, 8)  # ddp by default
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # one writer: no step twice
    assert (run_dir / "drafter" / "model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_0000004"


def test_plain_torchrun_ranks_adopt_rank0_run_dir(tmp_path, tiny_toy_target):
    # No hydra.run.dir: Hydra's timestamped default, which ranks may compute a second apart.
    launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
            "trainer=ddp", *QUICK], tmp_path)
    dirs = [p.parent for p in tmp_path.glob("runs/*/*/metrics.jsonl")]
    assert len(dirs) == 1 and (dirs[0] / "drafter").is_dir()
