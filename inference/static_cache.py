"""A static-address KV cache for the step decoder: any Hugging Face causal LM fills it through its own forward, and
a decode step over it can be recorded once (a CUDA graph, ``torch.compile(fullgraph=True)``) and replayed at every
later context length.

Everything a step touches stays where it was allocated, with the same shape:
- per attention layer one key and one value buffer ``[1, h, C + 1, hd]`` (a spare column, see ``StaticKV``),
  allocated when the cache is built (from the shapes one probe forward reports, ``kv_shapes``), never inside a
  forward or a capture, and marked static;
- the committed length ``length``, a 0-dim long on the device (a host mirror, ``host_length``, serves bucket choice
  and termination only);
- the write positions of each forward width n (``positions(n)``, a preallocated ``[n]`` long the step fills with
  ``length + arange(n)``): ``update`` writes the new keys and values there with ``index_copy_``.
Attention always reads the first ``bucket`` columns (a capacity bucket: one recording per bucket, one compilation
for all of them, ``StaticKV.bucket``) under the step's own 4D mask; columns at or past ``length`` hold stale but
finite values (the buffers start zeroed) that the mask hides. Dropping rejected nodes needs nothing (``length`` does
not cover them); keeping a tree's accepted path is one fixed-size gather per layer (``keep_path``).

Every layer is kept whole, sliding-window layers included: their window lives in the mask (``inference.masks``),
where a column's position is its index (batch 1: the accepted path is compacted right behind the committed past).

Depends on transformers' cache only through ``Cache`` / ``CacheLayerMixin``, the layer's ``update`` and
``get_mask_sizes`` (whatever arguments a version passes) and ``get_seq_length``.

Shapes: h KV heads, C capacity, hd head dim, n tokens fed by one forward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from inference.generation import cache_kwarg

BUCKET = 256  # capacity buckets are multiples of this many columns (the attention's key length per recording)


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


class StaticKVLayer(CacheLayerMixin):
    """One attention layer's keys and values in buffers of fixed address (see the module docstring)."""

    is_compileable = True
    is_sliding = False  # kept whole; the window is in the mask
    is_croppable = False

    def __init__(self, owner: "StaticKV", keys: Tensor, values: Tensor):
        super().__init__()
        self._owner = owner
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # allocated at construction

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        where = self._owner.positions(key_states.shape[-2])
        self.keys.index_copy_(2, where, key_states.to(self.dtype))
        self.values.index_copy_(2, where, value_states.to(self.dtype))
        b = self._owner.bucket
        return self.keys[:, :, :b], self.values[:, :, :b]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self._owner.bucket, 0  # the whole bucket, from column 0 (the step's 4D mask decides visibility)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self._owner.host_length

    def get_max_length(self) -> int:
        return self._owner.capacity

    def reset(self) -> None:
        self._owner.reset()


class FixedBuffers:
    """What transformers asks of a cache whose buffers never move (``StaticKV``, the batched
    ``inference.batch_cache.BatchKV``): attention over the bucket's columns, the capacity, compilable."""

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


class StaticKV(FixedBuffers, Cache):
    """A transformers ``Cache`` of ``StaticKVLayer``s for one sequence (batch 1), every buffer allocated here."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]], capacity: int,
                 device: torch.device | str, widths: tuple[int, ...] = ()):
        if capacity < 1:
            raise ValueError(f"StaticKV capacity={capacity} must be >= 1 (columns to preallocate)")
        if not shapes:
            raise ValueError("StaticKV needs the shapes of at least one attention layer (kv_shapes(model))")
        for k_shape, v_shape, _ in shapes:
            if k_shape[0] != 1 or v_shape[0] != 1:
                raise ValueError(f"StaticKV holds one sequence (batch 1); a layer reported keys {k_shape}")
        self.capacity = int(capacity)
        self.device = torch.device(device)
        layers = []
        # One spare column past the capacity, never read: a bucket's view of the keys is then never contiguous, the
        # last bucket's included, so the compiled step every bucket shares does not branch (and recompile) on it.
        columns = capacity + 1
        for k_shape, v_shape, dtype in shapes:
            keys = torch.zeros(1, k_shape[1], columns, k_shape[3], dtype=dtype, device=self.device)
            values = torch.zeros(1, v_shape[1], columns, v_shape[3], dtype=dtype, device=self.device)
            layers.append(StaticKVLayer(self, keys, values))
        super().__init__(layers=layers)
        self.length = torch.zeros((), dtype=torch.long, device=self.device)  # committed columns, on the device
        self.host_length = 0  # its host mirror (updated from the step's read-back)
        self._arange = torch.arange(self.capacity, device=self.device)
        self._columns: dict[int, Tensor] = {}
        self.bucket = self.capacity  # key columns attention reads
        self._positions: dict[int, Tensor] = {}
        self._scratch: Tensor | None = None
        for n in widths:
            self.declare(n)
        for t in (self.length, self._arange, *(x for layer in layers for x in (layer.keys, layer.values))):
            _mark_static(t)

    # --- positions and lengths -------------------------------------------------------------------------------------
    def declare(self, n: int) -> Tensor:
        """Allocate (once) the ``[n]`` write positions of a step width: every width a recorded step uses must be
        declared before its recording (at construction, or here)."""
        buf = self._positions.get(n)
        if buf is None:
            if n > self.capacity:
                raise ValueError(f"a forward of {n} tokens does not fit a StaticKV of capacity {self.capacity}")
            buf = self._positions[n] = torch.arange(n, device=self.device)
            _mark_static(buf)
        return buf

    def positions(self, n: int) -> Tensor:
        """The ``[n]`` positions the next forward of n tokens writes at: a declared width's buffer, else (an eager
        prefill of any length) a scratch one kept until the next undeclared width."""
        buf = self._positions.get(n)
        if buf is not None:
            return buf
        if self._scratch is None or self._scratch.shape[0] != n:
            if n > self.capacity:
                raise ValueError(f"a forward of {n} tokens does not fit a StaticKV of capacity {self.capacity}")
            self._scratch = torch.arange(n, device=self.device)
        return self._scratch

    def place(self, n: int, start: Tensor | None = None) -> Tensor:
        """Capture-safe: the next forward of n tokens writes at ``start + arange(n)`` (default: behind ``length``);
        returns those positions."""
        buf = self.positions(n)
        buf.copy_(self._arange[:n] + (self.length if start is None else start))
        return buf

    def use_bucket(self, columns: int) -> int:
        """Host: attention reads the smallest capacity bucket holding ``columns`` columns from now on."""
        if columns > self.capacity:
            raise ValueError(f"the decode needs {columns} cache columns, more than the StaticKV capacity "
                             f"{self.capacity}; build the cache for prompt + max_new_tokens + the widest step")
        self.bucket = next(b for b in capacity_buckets(self.capacity) if b >= columns)
        return self.bucket

    def set_length(self, length: int) -> None:
        """Host (outside any recording): ``length`` committed columns, on the device and in the mirror."""
        self.length.fill_(length)
        self.host_length = int(length)

    def reset(self) -> None:
        self.set_length(0)

    # --- moving entries, capture-safe ------------------------------------------------------------------------------
    def keep_path(self, start: Tensor, index_K: Tensor) -> None:
        """Every layer: columns ``start + index_K`` move to ``start + arange(K)`` (a fixed-size gather; entries past
        the real path land past ``length`` and are never read)."""
        K = index_K.shape[0]
        src = start + index_K
        dst = start + self._arange[:K]
        for layer in self.layers:
            for buf in (layer.keys, layer.values):
                buf.index_copy_(2, dst, buf.index_select(2, src))

    # --- what transformers asks a cache ---------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.host_length



def _mark_static(t: Tensor) -> None:
    """Tell ``torch.compile`` the tensor keeps its address (CUDA graphs then read it in place, no copy)."""
    try:
        torch._dynamo.mark_static_address(t)
    except Exception:  # noqa: BLE001 - marking is an optimisation hint; a torch without it still decodes
        pass
