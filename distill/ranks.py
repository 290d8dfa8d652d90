"""The ranks of a data job (regeneration, feature capture) launched by torchrun or Slurm: which share this process
takes and a barrier to wait for the others. The training engine (``train.engine``) owns the training job's process
group; a data job needs only a gloo group to wait on, whatever its device."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Ranks finish their shares at different times and the main rank's merge waits for the slowest one: far longer
# than a collective's default timeout.
BARRIER_TIMEOUT = datetime.timedelta(hours=72)


@dataclass(frozen=True)
class Ranks:
    """This process among the job's ``world`` ranks; ``barrier()`` waits for all of them."""

    rank: int
    world: int
    barrier: Callable[[], None]
    broadcast: Callable[[Any], Any] | None = None  # rank 0's picklable value, returned on every rank


    @property
    def is_main(self) -> bool:
        return self.rank == 0


def job_ranks(split_target: bool = False) -> Ranks | None:
    """This process's place in a torchrun launch (``RANK`` / ``WORLD_SIZE``), joined to a gloo group; None for
    one process. Ranks other than 0 log warnings only. ``split_target``: the ranks also run a tensor-parallel
    target's collectives, which on GPUs need NCCL beside gloo (each rank then on its ``LOCAL_RANK`` GPU)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return None
    if not dist.is_initialized():
        backend = "gloo"
        if split_target and torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, timeout=BARRIER_TIMEOUT)
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    return Ranks(rank=rank, world=world, barrier=dist.barrier, broadcast=_broadcast)


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def leave(ranks: Ranks | None) -> None:
    if ranks is not None and dist.is_initialized():
        dist.destroy_process_group()
