"""Writers that meet each other: a DeepSpeed start behind the build lock a killed start left, and two regenerations
of the same data at once. One test per case of docs/reliability.md."""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys
import time

import pytest

from tests.test_reliability_cluster import ROOT

# --- torch's extension build lock ---------------------------------------------------------------------------------


def _plant_lock(extensions: Path, age_s: float) -> Path:
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_deepspeed_start_behind_a_killed_builds_lock_is_one_line_naming_it(tmp_path):
    """A lock a killed build left (an hour old, nothing building): the DeepSpeed engine refuses at once, naming
    the file, where DeepSpeed would poll it forever."""
    lock = _plant_lock(tmp_path / "ext", age_s=3600)
    code = ("from distill.environment import one_line_errors\n"  # as the entry points wrap their work
            "from train.engine import TrainerConfig, build_engine\n"
            "one_line_errors(build_engine)(TrainerConfig(engine='deepspeed', device='cpu'))\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the DeepSpeed start waited on {lock} for 120 s")
    error = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and len(error) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"torch's build lock {lock} is 36" in error[0] and "s old and no build is running" in error[0]
    assert f"remove it (rm {lock})" in error[0] and lock.exists()  # named, never removed behind a user's back


def test_a_build_lock_with_a_build_behind_it_is_waited_for(tmp_path, monkeypatch):
    from train.extensions import check_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = _plant_lock(tmp_path / "ext", age_s=3600)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    slept = []

    def sleep(seconds):  # the build finishes after a few polls: it removes its lock
        slept.append(seconds)
        if len(slept) == 3:
            lock.unlink()
        time.sleep(0.05)

    try:
        check_build_locks(["deepspeed_shm_comm"], sleep=sleep)  # an old lock, but a build works behind it
    finally:
        builder.kill()
        builder.wait()
    assert len(slept) == 3
    young = _plant_lock(tmp_path / "young", age_s=0)  # just taken, its compiler not started yet: waited, bounded
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "young"))
    with pytest.raises(ValueError, match=rf"torch's build lock {young} is \d+ s old and no build is running"):
        check_build_locks(["deepspeed_shm_comm"], stale_after=0.3, poll=0.05)
