"""Torch's build lock for JIT-compiled extensions, checked before DeepSpeed starts.

At start-up (``deepspeed.init_distributed``) DeepSpeed builds its CPU communication op (``deepspeed_shm_comm``)
through ``torch.utils.cpp_extension``, which takes ``<extensions dir>/<op>/lock`` by creating that file, builds
(ninja runs in that directory), and deletes it. A start killed during the build (a pre-empted first job, ``kill -9``)
leaves the file behind, and every later start on the machine then polls it forever without a word.

``check_build_locks`` runs first: a lock with a build behind it (a process working in that directory) is waited for,
as torch would; a lock older than ``STALE_AFTER_S`` seconds with no build behind it is refused in one line naming the
file to remove. A build on another machine that shares the extensions dir (a home on NFS) is not seen from here: the
message says so.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

STALE_AFTER_S = 120.0  # a build writes its ninja file and starts compiling within a second of taking the lock
POLL_S = 1.0


def deepspeed_jit_ops() -> list[str]:
    """The ops DeepSpeed builds when it starts on this machine's accelerator (the CPU's shared-memory
    communication op; none where there is no such builder or it cannot build here)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []
    return [builder.NAME]


def build_dir(name: str) -> Path:
    """Where torch builds the extension ``name``: ``$TORCH_EXTENSIONS_DIR/<name>``, else under its default root
    (``~/.cache/torch_extensions/py<version>_<accelerator>/<name>``), as ``torch.utils.cpp_extension`` computes it."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _build_running(directory: Path) -> bool:
    """Whether a process of this machine works in ``directory`` (torch runs the build's ninja and compilers there)."""
    target = os.path.realpath(directory)
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == target:
                return True
        except OSError:  # gone, or another user's
            continue
    return False


def check_build_locks(names: Sequence[str], stale_after: float = STALE_AFTER_S, poll: float = POLL_S,
                      sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait while a build holds the lock of an extension in ``names``; refuse a lock nobody is building behind once
    it is ``stale_after`` seconds old (module docstring)."""
    for name in names:
        lock = build_dir(name) / "lock"
        said = False
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break
            building = _build_running(lock.parent)
            if not building and age >= stale_after:
                raise ValueError(
                    f"torch's build lock {lock} is {age:.0f} s old and no build is running in {lock.parent}: a "
                    f"DeepSpeed start killed while it built its {name} op left it, and DeepSpeed would wait for it "
                    f"forever; remove it (rm {lock}) and rerun, unless another machine sharing that directory is "
                    f"building it right now")
            if not said:
                log.warning("waiting for torch's build of %s (%s): %s", name, lock,
                            "a build is running there" if building else f"taken {age:.0f} s ago")
                said = True
            sleep(poll)
