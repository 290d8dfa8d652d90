"""Per-row seeds of a training batch: the randomness a drafter draws for a row (P-EAGLE's sampled chains) as a
function of the row itself, so one process and N ranks, and a resumed run, draw the same.

The training loop stores under ``ROW_SEED`` an int64 seed per row, made from the run seed, the step and the row's
index in the step's global batch (the same row gets the same index for any world size: ``train.loop`` numbers the
global micro-batches the same way). ``uniform_bits`` turns seeds into random 32-bit integers on the device, with no
generator state and no read-back: a counter-based hash, so a CPU and a GPU draw the same values. A batch built
outside the loop (a held-out evaluation, a test) has no seeds; ``batch_row_seeds`` then numbers its rows 0 .. B-1,
which draws the same every time.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from inference.hash32 import MASK32 as _MASK32
from inference.hash32 import mix32 as _mix32

ROW_SEED = "row_seed"  # batch key: [B] int64
_PRIME = 1_000_000_007


def row_seeds(seed: int, step: int, first: int, count: int) -> Tensor:
    """[count] int64: the seeds of rows ``first`` .. ``first + count - 1`` of step ``step``'s global batch."""
    base = (seed * _PRIME + step) * _PRIME
    return torch.tensor([(base + first + j) % 2**62 for j in range(count)], dtype=torch.long)


def batch_row_seeds(batch: Mapping[str, Tensor]) -> Tensor:
    """[B] int64 on the batch's device: its ``ROW_SEED`` entry, or 0 .. B-1 when it has none."""
    ids = batch["input_ids"]
    seeds = batch.get(ROW_SEED)
    return torch.arange(ids.shape[0], device=ids.device) if seeds is None else seeds.to(ids.device)


def uniform_bits(seeds_B: Tensor, length: int) -> Tensor:
    """[B, length] int64 in [0, 2^32): row b's ``length`` random integers, a pure function of ``seeds_B[b]``.
    Distinct within a row (the hash is a bijection of the position for a fixed seed), so a ranking has no ties."""
    key = _mix32((seeds_B & _MASK32) ^ _mix32((seeds_B >> 32) & _MASK32))  # [B]
    t = torch.arange(length, device=seeds_B.device)
    return _mix32(key[:, None] ^ _mix32(t)[None, :])
