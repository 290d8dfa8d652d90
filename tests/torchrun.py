"""Launching an entry point on CPU ranks (gloo) from a test, the way users launch it: ``python -m <module>`` for
one process, ``torchrun --standalone --nproc-per-node N -m <module>`` for several; and finding a rank's process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def command(module: str, args: list[str], ranks: int) -> list[str]:
    """``module`` run with ``args`` in one process (``ranks=1``) or under torchrun on ``ranks`` processes."""
    if ranks == 1:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
            module, *args]


def env() -> dict[str, str]:
    """This session's environment (conftest.py's isolated caches, no network), one thread per rank, this checkout."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end; a failure shows the tail of its output."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def start(cmd: list[str]) -> subprocess.Popen:
    """Start ``cmd`` in the background (its stderr kept for a failure message)."""
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank (a child of the launcher), or None while there is none."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    return None
