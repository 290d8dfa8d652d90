"""The training loop's input pipeline, off the critical path: the next step's micro-batches are read from the dataset,
collated and (on CUDA) pinned on a background thread while the current step computes; the loop then copies them to
the device without blocking (``non_blocking=True`` from pinned memory) and records how long it waited for them
(``perf/data_wait_s``: near zero whenever collation is faster than a step).

The order is ``train.loop.BatchOrder``'s, a pure function of (seed, micro-batch number): the thread only runs ahead
of the loop, never changes which rows a step gets, so a resumed run and any world size see the same rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor


class StepFeed:
    """``get(step)`` -> this rank's micro-batches of ``step`` on ``device``, and the seconds spent waiting for them.

    ``micro_batches(step)``: the global micro-batch numbers this rank takes at ``step`` (the loop's slice of the
    step's global batch); ``indices(number)``: the dataset rows of micro-batch ``number`` (``BatchOrder.indices``,
    only ever called from the feed's one thread, so its cached permutation needs no lock)."""

    def __init__(self, dataset, collate: Callable, indices: Callable[[int], list[int]],
                 micro_batches: Callable[[int], Sequence[int]], device: torch.device, last_step: int):
        self.dataset, self.collate, self.indices, self.micro_batches = dataset, collate, indices, micro_batches
        self.device, self.last_step = device, last_step
        self.pin = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdraft-feed")
        self._pending: dict[int, Future] = {}

    def _collate_step(self, step: int) -> list[dict[str, Tensor]]:
        out = []
        for number in self.micro_batches(step):
            batch = self.collate([self.dataset[i] for i in self.indices(number)])
            out.append({k: v.pin_memory() if self.pin else v for k, v in batch.items()})
        return out

    def _request(self, step: int) -> None:
        if step < self.last_step and step not in self._pending:
            self._pending[step] = self._pool.submit(self._collate_step, step)

    def get(self, step: int) -> tuple[list[dict[str, Tensor]], float]:
        """Step ``step``'s micro-batches on the device (the next step's are requested before returning), and the
        seconds this call waited for the background thread."""
        self._request(step)
        start = time.perf_counter()
        host = self._pending.pop(step).result()  # re-raises whatever collation raised, here on the loop's thread
        waited = time.perf_counter() - start
        self._request(step + 1)
        return [{k: v.to(self.device, non_blocking=self.pin) for k, v in b.items()} for b in host], waited

    def upload(self, tensor: Tensor) -> Tensor:
        """A host tensor made on the loop's thread (per-row seeds) on the device without a blocking copy: a copy from
        pageable memory would wait for the device's queue to drain."""
        return tensor.pin_memory().to(self.device, non_blocking=True) if self.pin else tensor.to(self.device)

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "StepFeed":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
