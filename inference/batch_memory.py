"""What a batch of decode rows holds on its device, checked before anything is allocated.

A batch decode keeps, per row, the target's keys and values at every position it will reach and the logits of each
verified node. A batch size the device cannot hold (``decoder.batch_sizes=[100000]``, ``regenerate.batch_size``)
would otherwise allocate until the process is killed, or die in a raw out-of-memory traceback. The estimate here is
a lower bound (the KV cache and logits alone, no activations, no rounding up to buckets), so a batch it refuses
cannot fit, and the refusal is one line naming the key, the rows, the bytes and the largest batch that could.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from inference.batch_cache import kv_shapes

_CGROUP = Path("/sys/fs/cgroup")


def free_bytes(device: torch.device | str) -> int | None:
    """Memory this process could still allocate on ``device``: a GPU's free memory; on the CPU the system's available
    memory, within this cgroup's limit (a container, a Slurm job) when there is one. None where it is unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    available = [_meminfo_available(), _cgroup_room()]
    known = [b for b in available if b is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_room() -> int | None:
    """cgroup v2's ``memory.max`` less ``memory.current``, or None without a limit."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((_CGROUP / "memory.current").read_text()), 0)
    except (OSError, ValueError):
        return None


def row_bytes(model, positions: int, logit_positions: int, vocab_size: int) -> int:
    """At least what one decode row holds: keys and values at ``positions`` cached positions, and the logits (model
    dtype) and float32 probabilities of ``logit_positions`` positions."""
    per_token = sum((math.prod(k) + math.prod(v)) * torch.empty(0, dtype=dtype).element_size()
                    for k, v, dtype in kv_shapes(model))
    itemsize = next(model.parameters()).element_size()
    return per_token * positions + logit_positions * vocab_size * (itemsize + 4)


def check_rows_fit(key: str, value, rows: int, per_row: int, device: torch.device | str,
                   free: int | None = None) -> None:
    """Refuse ``key=value``, a batch of ``rows`` rows of at least ``per_row`` bytes each, when the device has less
    free (``free``: measured now when not given)."""
    free = free_bytes(device) if free is None else free
    need = rows * per_row
    if free is None or need <= free:
        return
    most = free // per_row
    fix = f"use batches of at most {most} rows" if most else "no batch of even one row fits: free memory first"
    raise ValueError(f"{key}={value}: a batch of {rows} rows needs at least {_gib(need)} on {torch.device(device)} "
                     f"(the target's KV cache and logits, {_gib(per_row)} a row), more than the {_gib(free)} free; "
                     f"{fix} (or free memory, or use a device with more)")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def check_batch_sizes_fit(teacher, batch_sizes, max_rows: int | None, prompt_tokens: int, max_new_tokens: int,
                          num_draft: int, free: int | None = None) -> None:
    """``decoder.batch_sizes`` against the device: the largest batch (or ``decoder.max_batch_rows``, which caps the
    rows decoded at once) at ``prompt_tokens + max_new_tokens`` positions plus a verified chain of ``num_draft``."""
    if not batch_sizes:
        return
    rows = max(int(b) for b in batch_sizes)
    rows = min(rows, max_rows) if max_rows else rows
    nodes = max(int(num_draft), 0) + 1
    per_row = row_bytes(teacher.model, prompt_tokens + max_new_tokens + nodes, nodes, teacher.vocab_size)
    check_rows_fit("decoder.batch_sizes", list(batch_sizes), rows, per_row, teacher.device, free)
