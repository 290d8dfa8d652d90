"""A drafter's batch-1 static draft (``inference.static_draft``) run for the R rows of a batch bucket at once: the
capture-safe draft step of the batched decoder (``inference.batch_decoder``), for every drafter kind that has a
batch-1 one, from that kind's own batch-1 code.

How: the batch-1 object's state (every tensor it holds, found through its attributes, lists and dicts, its weights
and the drafter's own tensors aside) is stacked once along a new leading row dimension, [R, ...]. A draft step runs the
batch-1 ``draft`` under ``torch.vmap``, the object's attributes pointed at the rows of the stacked state and its
``CommittedBuffers`` at the rows of the batched verify's hand-off (``BatchSteps.committed_ids`` / ``committed_hidden``,
the pending tokens, and 1 + each row's accepted count from the packed verdicts); the in-place writes of the batch-1
step (``index_copy_``, ``copy_``, ``fill_``, ``add_``) land in each row's slice. Row r then drafts exactly what the
batch-1 draft drafts from row r's committed tokens (tests/test_batch_static_draft.py), each row with its own accepted
lengths, and the step stays one function of fixed buffers: eager, ``torch.compile(fullgraph=True, dynamic=False)``
(dynamo traces the vmap) or a CUDA graph, one per (batch bucket, draft shape). A bucket of one row runs the batch-1
step on row 0's slices directly (vmap's fixed cost buys nothing there).

Finished rows (``BatchSteps.active`` 0) stay in the bucket: their drafts are replaced by token -1, and their per-row
scalars (context length, first-step flag, draw counter) are put back after each step, so a finished row's state never
moves past the capacity it was allocated for whatever the verify hands it. ``prefill`` (eager, per row) and
``move_rows`` (re-bucketing) point the same object at one row's slices, or copy rows between buckets.

Shapes: R rows, M committed rows, T draft nodes, V vocabulary, D hidden size.
"""

from __future__ import annotations

import collections
import warnings

import torch
from torch import Tensor

from inference.static_draft import CommittedBuffers, mark_static, new_committed

# vmap runs the ops without a batching rule (index_copy_, CPU attention) row by row and says so once per op; a
# compiled step traces them into one graph either way.
warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented the "
                        "batching rule")

_NOT_STATE = ("drafter", "model", "committed", "generator", "_owner", "owner")  # never walked: not per-row state
_DEPTH = 6  # how deep the walk goes (a draft's cache, its layers, their buffers)


class NotStackable(ValueError):
    """A static draft whose state this module cannot find (its draft buffers are not among the tensors it holds:
    kept on its class, say): the batched decoder drafts through per-row copies of the drafter instead."""


def state_slots(obj, shared: set[int]) -> list[tuple[object, object, Tensor, str]]:
    """Every tensor ``obj`` holds as (container, key, tensor, path): attributes of plain objects, items of lists and
    dicts, walked ``_DEPTH`` levels; modules, generators and the tensors whose storage is in ``shared`` are left out.
    A tuple holding tensors is turned into a list in place (so a row's tensor can be pointed at), once. ``path``
    names the tensor's place (``cache.layers.0.keys``), the same in every object of one class."""
    out: list[tuple[object, object, Tensor, str]] = []
    seen: set[int] = set()

    def walk(node, depth: int, path: str) -> None:
        if depth == 0 or id(node) in seen or isinstance(node, (torch.nn.Module, torch.Generator, Tensor, type)):
            return
        seen.add(id(node))
        if isinstance(node, (dict, list)):
            items = list(node.items() if isinstance(node, dict) else enumerate(node))
        elif hasattr(node, "__dict__"):
            items = [(k, v) for k, v in vars(node).items() if k not in _NOT_STATE]
        else:
            return
        for key, value in items:
            if isinstance(value, tuple) and any(isinstance(v, Tensor) for v in value):
                value = list(value)
                _put(node, key, value)
            where = f"{path}.{key}" if path else str(key)
            if isinstance(value, Tensor):
                if value.untyped_storage().data_ptr() not in shared:
                    out.append((node, key, value, where))
            else:
                walk(value, depth - 1, where)

    walk(obj, _DEPTH, "")
    return out


def _put(container, key, value) -> None:
    if isinstance(container, (dict, list)):
        container[key] = value
    else:
        setattr(container, key, value)


def drafter_storages(drafter) -> set[int]:
    """The storages of the drafter's weights and of the tensors it keeps itself (cut weight rows, vocabulary maps):
    shared by every row, never stacked."""
    tensors = []
    if isinstance(drafter, torch.nn.Module):
        tensors += [*drafter.parameters(), *drafter.buffers()]
    for value in vars(drafter).values():
        if isinstance(value, Tensor):
            tensors.append(value)
        elif isinstance(value, (tuple, list)):
            tensors += [v for v in value if isinstance(v, Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors}


class RowDrafts:
    """A batch-1 static draft ``proto`` at the R rows of the batched verify's buffers ``state``
    (``inference.batch_steps.BatchSteps``): ``committed`` is the batch-1 ``CommittedBuffers`` ``proto`` was made for
    (its shapes; the rows it reads are pointed at ``state``'s at each step). ``like``: another bucket's rows of the
    same ``proto``, whose state layout these share (so rows move between them)."""

    def __init__(self, drafter, proto, committed: CommittedBuffers, state, like: "RowDrafts | None" = None):
        self.drafter, self.proto, self.committed, self.state, self.R = drafter, proto, committed, state, state.R
        if like is not None:
            self.slots = like.slots
        else:
            slots = state_slots(proto, drafter_storages(drafter))
            views = collections.Counter(t.untyped_storage().data_ptr()
                                        for t in {id(t): t for _, _, t, _ in slots}.values())
            # Views of one buffer through several attributes (a cache's column ranges) are tables a step only
            # reads: shared by the rows, as the weights are (a step writing one fails under vmap, never silently).
            self.slots = [s for s in slots if views[s[2].untyped_storage().data_ptr()] == 1]
        unique: dict[int, Tensor] = {}
        for _, _, t, _ in self.slots:
            unique.setdefault(id(t), t)
        self.index = {i: n for n, i in enumerate(unique)}  # a tensor's place in ``self.stacked``
        self.paths = {path: self.index[id(t)] for _, _, t, path in self.slots}  # the same, by path
        # One row: views of the batch-1 object's own tensors (its state stays where it is, as its own counters
        # and caches are read by the drafter); more rows: a copy per row.
        self.stacked = [t.detach().unsqueeze(0).repeat(self.R, *([1] * t.dim())) if self.R > 1
                        else t.detach().unsqueeze(0) for t in unique.values()]
        mark_static(*self.stacked)
        # Per-row scalars (lengths, flags, counters): put back on finished rows, reset on empty ones.
        self.scalars = [n for n, t in enumerate(unique.values()) if t.dim() == 0]
        self.initial = [self.stacked[n][0].clone() for n in self.scalars]
        b = proto.buffers
        missing = [name for name in ("tokens_T", "parents_T", "probs_TV")
                   if getattr(b, name) is not None and id(getattr(b, name)) not in self.index]
        if missing:
            raise NotStackable(f"{type(proto).__name__}: its draft buffers {missing} are not among the tensors its "
                               f"instance holds, so no row dimension can be added to them")
        self.chain = b.chain
        self.T = b.tokens_T.shape[0]
        self.tokens_RT = self.stacked[self.index[id(b.tokens_T)]]
        self.parents_RT = None if b.chain else self.stacked[self.index[id(b.parents_T)]]
        self.probs_RTV = None if b.probs_TV is None else self.stacked[self.index[id(b.probs_TV)]]
        self.parents_T = b.parents_T.cpu()  # the host's record of the step's shape (a static tree's: its parents)
        # A drafter that cuts its own chain (``Proposer.variable_depth``) counts the slots it keeps in ``kept``: per
        # row here, read back once per step to pick the verify bucket, as the batch-1 decoder reads its own.
        cuts = getattr(proto, "kept", None) is not None and "kept" in self.paths and b.chain
        self.kept_R = self.stacked[self.paths["kept"]] if cuts else None
        # one row: the step's views of row 0 (of buffers that never move), made here, outside any traced step
        self._row0 = None if self.R > 1 else (state.committed_ids[0],
                                              {i: h[0] for i, h in state.committed_hidden.items()}, state.pending[0])

    # --- pointing the batch-1 object at rows -------------------------------------------------------------------
    def _point(self, values: list[Tensor], committed: tuple | None = None) -> None:
        for container, key, t, _ in self.slots:
            _put(container, key, values[self.index[id(t)]])
        if committed is not None:
            c = self.committed
            c.ids_M, c.hidden_M, c.count, c.position, c.pending = committed

    def _restore(self, committed: tuple) -> None:
        for container, key, t, _ in self.slots:
            _put(container, key, t)
        c = self.committed
        c.ids_M, c.hidden_M, c.count, c.position, c.pending = committed

    def _own(self) -> tuple:
        c = self.committed
        return c.ids_M, c.hidden_M, c.count, c.position, c.pending

    # --- eager, outside any recording --------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: list[Tensor], hidden: dict[int, Tensor], firsts: Tensor) -> None:
        """Each prompt's row (``proto.prefill`` on that row's slices): ``hidden`` {layer: [R, P, D]} as the batched
        prefill returns it, ``firsts`` [n] the first generated tokens; the bucket's other rows start empty."""
        self._check_held()
        own = self._own()
        for r, prompt in enumerate(prompts):
            self._point([t[r] for t in self.stacked])
            try:
                P = prompt.shape[0]
                self.proto.prefill(prompt, {i: h[r, :P] for i, h in hidden.items()}, firsts[r])
            finally:
                self._restore(own)
        self._empty(len(prompts))

    def _empty(self, n: int) -> None:
        """Rows n .. R - 1 hold no sequence: their scalars back to a new draft's (in range for any step)."""
        for k, first in zip(self.scalars, self.initial):
            self.stacked[k][n:].copy_(first.expand(self.R - n))

    def move_rows(self, other: "RowDrafts", rows: list[int]) -> None:
        """Rows 0 .. len(rows) - 1 become ``other``'s ``rows`` (a batch moving to a smaller bucket), state tensor by
        state tensor (matched by path). ``other`` may run a batch-1 draft of the same kind at a smaller capacity (the
        smaller bucket's buffers were allocated for a longer decode): the columns it has (every position its rows
        reached) are copied; the rest keep their own values (constant tables, columns no row has reached)."""
        pairs = [(self.stacked[n], other.stacked[other.paths[path]]) for path, n in self.paths.items()
                 if path in other.paths]
        if type(other.proto) is not type(self.proto) or not all(
                a.dim() == b.dim() and a.dtype == b.dtype and all(x >= y for x, y in zip(a.shape[1:], b.shape[1:]))
                for a, b in pairs):
            raise ValueError(f"rows of a {type(other.proto).__name__} cannot move to a {type(self.proto).__name__}'s "
                             f"buffers: move them between the buckets of one drafter and settings")
        self._check_held()
        index = torch.tensor(rows, dtype=torch.long, device=self.stacked[0].device)
        for mine, theirs in pairs:
            part = tuple(slice(0, n) for n in theirs.shape[1:])
            mine[(slice(0, len(rows)), *part)].copy_(theirs.index_select(0, index))
        self._empty(len(rows))

    def use_shape(self, context: int) -> tuple | None:
        """Host, before a draft: the shape of a drafter whose step has several (``ShapedDraft``), for attention over
        ``context`` committed tokens (the bucket's longest row), or None. At more than one row, refuses a batch-1
        object whose host code replaced one of its state tensors since (its rows would be drafted from the old one;
        one row drafts from the object's own tensors, checked when rows move in)."""
        use_shape = getattr(self.proto, "use_shape", None)
        shape = use_shape(context, True) if use_shape is not None else None
        if self.R > 1:
            self._check_held()
        return shape

    def _check_held(self) -> None:
        for container, key, t, _ in self.slots:
            held = container[key] if isinstance(container, (dict, list)) else getattr(container, key)
            if held is not t:
                raise RuntimeError(f"{type(self.proto).__name__}: its state tensor {key!r} was replaced between "
                                   f"steps; a static draft run at batch R keeps every state tensor it allocated "
                                   f"(write into it in place)")

    # --- capture-safe, every step ------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self) -> None:
        """Every row's catch-up and draft (one vmapped batch-1 step), then the drafts into the verify's buffers."""
        s = self.state
        M = s.committed_ids.shape[1]
        count = (1 + s.out[:, 0]).clamp(1, M)  # what the last step committed per row (a plain step: 1)
        position = s.cache.length - count
        own = self._own()

        def row(values, ids_M, hidden_M, count, position, pending):
            self._point(values, (ids_M, hidden_M, count, position, pending))
            try:
                self.proto.draft()
            finally:
                self._restore(own)

        if self.R == 1:  # the batch-1 step on its own state and row 0's hand-off: vmap's fixed cost buys nothing here
            ids, hidden, pending = self._row0
            c = self.committed
            c.ids_M, c.hidden_M, c.count, c.position, c.pending = ids, hidden, count[0], position[0], pending
            try:
                self.proto.draft()
            finally:
                c.ids_M, c.hidden_M, c.count, c.position, c.pending = own
            tokens, probs = self.tokens_RT, self.probs_RTV  # one row drafts until the decode ends: no finished row
        else:
            kept = [self.stacked[k].clone() for k in self.scalars]
            args = (self.stacked, s.committed_ids, s.committed_hidden, count, position, s.pending)
            torch.vmap(row, out_dims=None)(*args)
            live = s.active.bool()
            for k, before in zip(self.scalars, kept):
                self.stacked[k].copy_(torch.where(live, self.stacked[k], before))
            tokens = torch.where(live[:, None], self.tokens_RT, -1)
            probs = None if self.probs_RTV is None else self.probs_RTV * live[:, None, None]
        T = self.T
        s.tokens_RT[:, :T].copy_(tokens)
        if not self.chain:
            s.parents_RT[:, :T].copy_(self.parents_RT)
        if s.probs_RTV is not None and self.chain:
            if probs is not None:
                s.probs_RTV[:, :T].copy_(probs)
            else:  # point masses: q(x) = 1 on each drafted token
                P = s.probs_RTV[:, :T]
                P.zero_()
                P.scatter_(2, tokens.clamp(0, P.shape[-1] - 1)[:, :, None], (tokens >= 0).to(P.dtype)[:, :, None])


def static_of(drafter, state, sampling, generator, committed: dict) -> tuple | None:
    """(the drafter's batch-1 static draft for ``state``'s verify, the ``CommittedBuffers`` it reads), or None (the
    per-row copies then draft): no static draft for this drafter or setting, or one the batched verify cannot take
    (sampled siblings); one wider than the verify's buffers is refused with the fix. ``committed``: the caller's
    batch-1 committed buffers by shape, kept so a drafter asked again for the same settings hands back the same
    object (``Drafter.reuse_static_draft``), whatever the batch bucket: every bucket's rows run the one batch-1
    object, each pointing it at its own state."""
    if not hasattr(drafter, "static_draft"):
        return None
    hidden = next(iter(state.committed_hidden.values()), None)
    shape = (state.committed_ids.shape[1], tuple(state.committed_hidden), hidden.shape[-1] if hidden is not None else 1,
             state.cache.capacity, str(state.device), state.dtype)
    own = committed.get(shape)
    if own is None:
        own = committed[shape] = new_committed(shape[0], tuple(drafter.teacher_layers), shape[2], state.device,
                                               state.dtype)
    proto = drafter.static_draft(own, state.cache.capacity, sampling, generator)
    if proto is None:
        return None
    b = proto.buffers
    state.check_width(b.tokens_T.shape[0])  # as the verify refuses an eager proposal this wide
    if not b.chain and b.probs_TV is not None:
        return None
    return proto, own
