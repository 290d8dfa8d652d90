"""Counting host<->device transfers and syncs, so a decode step's budget of them cannot silently regress.

On a GPU every value the host reads back (``int(t)``, ``t.item()``, ``t.tolist()``, ``if t.any():``), every tensor
built from Python data (``torch.tensor([...])``: a host-to-device copy) and every op whose output shape depends on
the data (``nonzero``) stalls the pipeline until the device catches up. On a CPU they cost little, which is how they
creep in; this counter sees them on any device, so a CPU test can hold the GPU budget.

``TransferCounter`` is a ``TorchDispatchMode`` (it sees every aten op under it) that counts:
- ``item``: ``aten._local_scalar_dense`` (``int()``, ``float()``, ``bool()``, ``.item()`` of a tensor);
- ``tolist``: ``Tensor.tolist()`` (which reads a CPU tensor's memory directly, below the dispatcher, so it is counted
  by wrapping the method while the counter is active). A device tensor's ``tolist`` copies it to the host through
  the dispatcher first (``toBackend(CPU)``: an ``aten._to_copy``); that copy is the same read-back, not a second one,
  and is not counted again (it was, which put every GPU step's count one over per ``tolist``);
- ``from_python``: ``aten.lift_fresh`` (a tensor built from Python data: ``torch.tensor``, ``as_tensor`` of a list,
  indexing with a Python list);
- ``sync_shape``: ops whose output size depends on the data (``nonzero``, ``masked_select``, ``unique``...), and
  indexing with a boolean mask (``x[mask]``: its ``nonzero`` runs inside the index kernel, below the dispatcher);
- ``copy``: a copy between two devices (``.to``, ``.cpu()``, ``copy_``) — none on a CPU-only run.

Ops under ``torch.inference_mode`` do not reach a dispatch mode at all: they are not counted (count such code under
``torch.no_grad`` to see its syncs).

Usage::

    with TransferCounter() as counter:
        decoder.speculative(...)
    counter.total, counter.counts
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_ITEM = {aten._local_scalar_dense.default}
_FROM_PYTHON = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_SYNC_SHAPE = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
               aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten.equal.default}
_COPIES = {aten._to_copy.default, aten.copy_.default}
_INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _bool_index(args) -> bool:
    """Whether an indexing op's indices hold a boolean mask (its output shape is the mask's count)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _devices(args, kwargs) -> set[torch.device]:
    found = set()
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.add(a.device)
        elif isinstance(a, torch.device):
            found.add(a)
        elif isinstance(a, str) and a in ("cpu", "cuda", "mps") or isinstance(a, str) and a.startswith("cuda:"):
            found.add(torch.device(a))
    return found


class TransferCounter(TorchDispatchMode):
    """Counts host<->device transfers and syncs (see the module docstring) by kind, in ``counts``."""

    KINDS = ("item", "tolist", "from_python", "sync_shape", "copy")

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self._tolist = None
        self._in_tolist = False  # inside a counted tolist: its own device-to-host copy is that read-back

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self):
        original = self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(tensor, *args, **kwargs):
            counter.counts["tolist"] += 1
            counter._in_tolist = True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._in_tolist = False

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ITEM:
            self.counts["item"] += 1
        elif func in _FROM_PYTHON:
            self.counts["from_python"] += 1
        elif func in _SYNC_SHAPE or func in _INDEX and _bool_index(args):
            self.counts["sync_shape"] += 1
        elif func in _COPIES and not self._in_tolist:
            devices = _devices(args, kwargs)
            if len(devices) > 1 and any(d.type == "cpu" for d in devices):
                self.counts["copy"] += 1
        return func(*args, **kwargs)
