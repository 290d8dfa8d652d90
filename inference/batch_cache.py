"""The static-address KV cache of the decoder: any Hugging Face causal LM fills it through its own forward, for the R
rows of a batch bucket (batch 1: one row), and a step over it can be recorded once (a CUDA graph,
``torch.compile(fullgraph=True)``) and replayed at every later context length.

Row b's committed tokens sit in columns ``0 .. length[b] - 1`` in position order (its accepted path is compacted
right behind its own committed past each step), so a column's position is its index in every row: no holes, no
padding columns, and the sliding-window masks of ``inference.masks`` read positions straight from column indices
(every layer is kept whole, sliding-window layers included: their window lives in the mask).
Everything a step touches stays where it was allocated, with the same shape:
- per attention layer one key and one value buffer ``[R, h, C + 1, hd]`` (R rows: the batch bucket; one spare
  column, see ``BatchKV``), allocated when the cache is built (from the shapes one probe forward reports,
  ``kv_shapes``), never inside a forward or a capture, and marked static;
- ``length`` ``[R]`` long on the device (the host mirror ``host_lengths`` serves bucket choice only);
- the write positions of each step width n (``positions(n)``, a preallocated ``[R, n]`` long the step fills with
  ``length[b] + offsets``): ``update`` scatters the new keys and values there, row by row in one op.
Attention reads the first ``bucket`` columns (``BatchKV.bucket``: one recording per capacity bucket, one compilation
for all of them) under the step's own 4D mask; columns at or past a row's length hold stale but finite values (the
buffers start zeroed) that the mask hides. Dropping rejected nodes needs nothing (``length`` does not cover them);
keeping a tree's accepted path is one fixed-size gather per layer (``keep_path``). Buckets double from 256 columns
where steps are recorded or compiled; uncompiled steps (``fine``) read the columns needed, rounded up to ``FINE``
(on a CPU attention over a whole bucket costs more than it saves).

Depends on transformers' cache only through ``Cache`` / ``CacheLayerMixin``, the layer's ``update`` and
``get_mask_sizes`` (whatever arguments a version passes) and ``get_seq_length``.

Shapes: R rows, h KV heads, C capacity, hd head dim, n tokens fed per row by one forward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from inference.generation import cache_kwarg
from inference.static_draft import mark_static

BUCKET = 256  # capacity buckets are multiples of this many columns (the attention's key length per recording)
FINE = 32  # uncompiled steps read the columns they need, rounded up to a multiple of this


def capacity_buckets(capacity: int, step: int = BUCKET) -> list[int]:
    """The key lengths attention runs at for a cache of ``capacity`` columns: 256, 512, 1024, ... (doubling), the
    last one ``capacity`` itself."""
    out, b = [], step
    while b < capacity:
        out.append(b)
        b *= 2
    return out + [capacity]


def kv_shapes(model) -> list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """Per attention layer (keys shape, values shape, dtype) of one cached token at batch 1: ``[1, h, 1, hd]``,
    from one 1-token probe forward through a ``DynamicCache`` (families differ in head counts and sizes per layer)."""
    device = next(model.parameters()).device
    probe = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True,
              **{cache_kwarg(model): probe})
    return [(tuple(layer.keys.shape), tuple(layer.values.shape), layer.keys.dtype) for layer in probe.layers]


def capacity_of(columns: int) -> int:
    """Cache capacities are powers of two from ``BUCKET`` up, so a decoder reuses one cache across prompts."""
    c = BUCKET
    while c < columns:
        c *= 2
    return c


class BatchKVLayer(CacheLayerMixin):
    """One attention layer's keys and values for R rows, in buffers of fixed address, a write position per row."""

    is_compileable = True
    is_sliding = False  # kept whole; the window is in the mask
    is_croppable = False

    def __init__(self, owner: "BatchKV", keys: Tensor, values: Tensor):
        super().__init__()
        self._owner = owner
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # allocated at construction

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self._owner.bucket, 0  # the whole bucket, from column 0 (the step's 4D mask decides visibility)

    def reset(self) -> None:
        self._owner.reset()

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        R, h, n, hd = key_states.shape
        where = self._owner.positions(n)
        if R == 1:  # one row: a copy along the columns (cheaper than a scatter)
            self.keys.index_copy_(2, where[0], key_states.to(self.dtype))
            self.values.index_copy_(2, where[0], value_states.to(self.dtype))
        else:
            where = where[:, None, :, None]
            self.keys.scatter_(2, where.expand(R, h, n, hd), key_states.to(self.dtype))
            self.values.scatter_(2, where.expand(R, value_states.shape[1], n, value_states.shape[3]),
                                 value_states.to(self.dtype))
        b = self._owner.bucket
        return self.keys[:, :, :b], self.values[:, :, :b]

    def get_seq_length(self, *args, **kwargs) -> int:
        return max(self._owner.host_lengths, default=0)

    def get_max_length(self) -> int:
        return self._owner.capacity


class BatchKV(Cache):
    """A transformers ``Cache`` of ``BatchKVLayer``s for ``rows`` sequences, every buffer allocated here.
    ``shapes``: ``kv_shapes`` (one cached token at batch 1, per layer)."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]], rows: int, capacity: int,
                 device: torch.device | str, fine: bool = False):
        if rows < 1 or capacity < 1:
            raise ValueError(f"BatchKV rows={rows}, capacity={capacity}: both must be >= 1")
        if not shapes:
            raise ValueError("BatchKV needs the shapes of at least one attention layer (kv_shapes(model))")
        self.rows, self.capacity, self.device = int(rows), int(capacity), torch.device(device)
        self.fine = fine
        layers = []
        # One spare column past the capacity, never read: a bucket's view of the keys is then never contiguous, the
        # last bucket's included, so the compiled step every bucket shares does not branch (and recompile) on it.
        for k_shape, v_shape, dtype in shapes:
            keys = torch.zeros(rows, k_shape[1], capacity + 1, k_shape[3], dtype=dtype, device=self.device)
            values = torch.zeros(rows, v_shape[1], capacity + 1, v_shape[3], dtype=dtype, device=self.device)
            layers.append(BatchKVLayer(self, keys, values))
        super().__init__(layers=layers)
        self.length = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.host_lengths = [0] * rows
        self._arange = torch.arange(self.capacity, device=self.device)
        self._columns: dict[int, Tensor] = {}
        self.bucket = self.capacity
        self._positions: dict[int, Tensor] = {}
        self._scratch: Tensor | None = None
        for t in (self.length, self._arange, *(x for layer in layers for x in (layer.keys, layer.values))):
            mark_static(t)

    @property
    def bucket(self) -> int:
        """Key columns attention reads: the length of ``columns``, a view of ``arange(capacity)`` per bucket. A step
        reads the bucket as that view's size, which a compiled step takes as a symbolic size (the view is marked
        dynamic), so one compilation serves every capacity bucket; a CUDA graph still records one per bucket."""
        return self.columns.shape[0]

    @bucket.setter
    def bucket(self, columns: int) -> None:
        view = self._columns.get(columns)
        if view is None:
            view = self._columns[columns] = self._arange[:columns]
            torch._dynamo.maybe_mark_dynamic(view, 0)
        self.columns = view

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.bucket, 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    @property
    def is_compileable(self) -> bool:
        return True

    def buffers(self) -> list[Tensor]:
        """Every tensor the cache owns (for address checks)."""
        return [self.length, self._arange, *self._positions.values(),
                *(x for layer in self.layers for x in (layer.keys, layer.values))]

    def declare(self, n: int) -> Tensor:
        """Allocate (once) the ``[R, n]`` write positions of a step width, before any recording that uses it."""
        buf = self._positions.get(n)
        if buf is None:
            if n > self.capacity:
                raise ValueError(f"a forward of {n} tokens per row does not fit a BatchKV of capacity "
                                 f"{self.capacity}")
            buf = self._positions[n] = torch.zeros(self.rows, n, dtype=torch.long, device=self.device)
            mark_static(buf)
        return buf

    def positions(self, n: int) -> Tensor:
        """The ``[R, n]`` positions the next forward of n tokens per row writes at: a declared width's buffer, else
        (an eager prefill of any length) a scratch one kept until the next undeclared width."""
        buf = self._positions.get(n)
        if buf is not None:
            return buf
        if self._scratch is None or self._scratch.shape[1] != n:
            if n > self.capacity:
                raise ValueError(f"a forward of {n} tokens per row does not fit a BatchKV of capacity "
                                 f"{self.capacity}")
            self._scratch = torch.zeros(self.rows, n, dtype=torch.long, device=self.device)
        return self._scratch

    def place(self, n: int, start: Tensor | None = None) -> Tensor:
        """Capture-safe: row b's next forward of n tokens writes at ``start[b] + arange(n)`` (default: behind
        ``length[b]``); returns ``[R, n]``."""
        buf = self.positions(n)
        buf.copy_((self.length if start is None else start.reshape(-1))[:, None] + self._arange[:n][None, :])
        return buf

    def use_bucket(self, columns: int) -> int:
        """Host: attention reads the smallest capacity bucket holding ``columns`` columns from now on."""
        if columns > self.capacity:
            raise ValueError(f"the decode needs {columns} cache columns, more than the BatchKV capacity "
                             f"{self.capacity}; build the cache for prompt + max_new_tokens + the widest step")
        if self.fine:
            self.bucket = min(self.capacity, -(-columns // FINE) * FINE)
        else:
            self.bucket = next(b for b in capacity_buckets(self.capacity) if b >= columns)
        return self.bucket

    def set_lengths(self, lengths: list[int]) -> None:
        """Host (outside any recording): every row's committed length, on the device and in the mirror."""
        self.length.copy_(torch.tensor(lengths, dtype=torch.long), non_blocking=False)
        self.host_lengths = [int(n) for n in lengths]

    def reset(self) -> None:
        self.set_lengths([0] * self.rows)

    def keep_path(self, start_R: Tensor, index_RK: Tensor) -> None:
        """Capture-safe, every layer: row b's columns ``start[b] + index[b]`` move to ``start[b] + arange(K)`` (a
        fixed-size gather; entries past a row's real path land past its length and are never read)."""
        R, K = index_RK.shape
        if R == 1:  # one row: a gather along the columns
            src, dst = start_R[0] + index_RK[0], start_R[0] + self._arange[:K]
            for layer in self.layers:
                for buf in (layer.keys, layer.values):
                    buf.index_copy_(2, dst, buf.index_select(2, src))
            return
        src = (start_R[:, None] + index_RK)[:, None, :, None]
        dst = (start_R[:, None] + self._arange[:K][None, :])[:, None, :, None]
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                shape = (R, buf.shape[1], K, buf.shape[3])
                buf.scatter_(2, dst.expand(shape), buf.gather(2, src.expand(shape)))

    def copy_rows(self, other: "BatchKV", rows: list[int], columns: int) -> None:
        """Host: this cache's rows 0 .. len(rows) - 1 become ``other``'s ``rows`` (their first ``columns``
        columns); the rest are emptied (length 0). Moving a batch to a smaller bucket."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        n = len(rows)
        for mine, theirs in zip(self.layers, other.layers):
            mine.keys[:n, :, :columns].copy_(theirs.keys.index_select(0, index)[:, :, :columns])
            mine.values[:n, :, :columns].copy_(theirs.values.index_select(0, index)[:, :, :columns])
        self.set_lengths([other.host_lengths[r] for r in rows] + [0] * (self.rows - n))

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return max(self.host_lengths, default=0)
