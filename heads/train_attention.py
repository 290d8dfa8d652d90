"""Training attention under the drafters' structured masks, without a [Q, KV] mask or score tensor.

Each structured mask is written once, as a flex-attention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` that closes over
small per-row tensors (padding, anchors, chain ids): EAGLE's training-time test (``ttt_step_mask``), DFlash's blocks
(``dflash_block_mask``) and P-EAGLE's parallel chains (``parallel_chain_mask``). ``attend`` runs attention under one
with the kernel ``trainer.attention`` picks (``train_attention`` sets it for a block, as ``train.loop`` does):

* ``flex``: ``flex_attention`` compiled (``dynamic=False``) over a ``BlockMask`` made by the compiled
  ``create_block_mask``: masked-out blocks are skipped, nothing of [Q, KV] is held. Sizes are padded to powers of two
  so that batches with other anchor or chain counts reuse the compiled kernels. CUDA only for training (its backward
  is not implemented on a CPU).
* ``tiled``: SDPA over tiles of ``TILE`` queries; each tile's mask is the ``mask_mod`` evaluated on that tile
  ([B, 1, TILE, keys it may see]) and its keys are only the spans the mask says it may see (``StructuredMask.spans``),
  so cost and memory follow the visible keys. A leading run of plainly causal queries (``causal_prefix``) goes through
  SDPA's ``is_causal`` with no mask at all. Autograd runs through it on any device.
  A mask that is plainly causal throughout (EAGLE's step 0) runs SDPA's causal kernel under flex too.
* ``dense``: the whole [B, 1, Q, KV] mask and one SDPA call: the reference the others are tested against.
* ``auto`` (default): flex on CUDA, tiled elsewhere.

The masks are for training rows: right-padded or packed (``distill.data.TokenBlockDataset`` refuses other rows).
For those a real query never sees a padded key under causal order, which is what lets ``causal_prefix`` drop the
mask; the padded queries then differ from the dense mask's (they see other padded keys), but no real query and no
loss ever reads them. ``right_padded=False`` builds the exact mask for any padding (no ``causal_prefix``).
Nothing here reads a device value on the host: every shape is a Python int the caller already has.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

KERNELS = ("auto", "flex", "tiled", "dense")
# Queries per tile of the tiled kernel: small enough that a tile's mask and scores ([B, h, TILE, keys]) stay far below
# a [Q, KV] tensor, large enough that SDPA's per-call overhead is amortised (TTT step 1 at the toy target's shapes,
# fwd + bwd at 1 thread: 182 ms with tiles of 128, 247 with 256).
TILE = 128
# Whether ``flex`` runs compiled. Eager flex attention is a slow reference that builds the score tensor; tests on a
# CPU switch compilation off to check the masks' semantics without minutes of CPU compilation.
FLEX_COMPILE = True

# The current choice: a module value, not a ContextVar, so that a compiled region (trainer.compile) reads it without
# a graph break (dynamo cannot trace ContextVar.get; it guards on this value instead).
_choice = "auto"

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def check_attention(choice: str) -> None:
    if choice not in KERNELS:
        raise ValueError(f"trainer.attention={choice!r} is not a choice; valid: {list(KERNELS)}")


@contextlib.contextmanager
def train_attention(choice: str) -> Iterator[None]:
    """Inside this block, ``attend`` uses ``choice`` (``trainer.attention``: auto | flex | tiled | dense)."""
    global _choice
    check_attention(choice)
    before, _choice = _choice, choice
    try:
        yield
    finally:
        _choice = before


def chosen() -> str:
    """``trainer.attention`` as set (``auto`` unresolved): a drafter may keep a faster path of its own under auto."""
    return _choice


def kernel_for(device: torch.device, needs_grad: bool) -> str:
    """The kernel ``attend`` runs on ``device``: the chosen one, ``auto`` resolved (flex on CUDA, else tiled)."""
    choice = _choice
    if choice == "auto":
        return "flex" if device.type == "cuda" else "tiled"
    if choice == "flex" and needs_grad and device.type != "cuda":
        raise ValueError(f"trainer.attention=flex needs CUDA to train (flex attention has no backward on "
                         f"{device.type}); set trainer.attention=auto or tiled")
    return choice


@dataclass(eq=False)
class StructuredMask:
    """One training mask over Q queries and KV keys of B rows. ``mask_mod(b, h, q_idx, kv_idx)``: whether query
    ``q_idx`` of row ``b`` sees key ``kv_idx`` (any head), written with tensor ops only so that flex attention can
    compile it and a tile can evaluate it on broadcast index tensors. ``spans(q0, q1)``: the key ranges
    ``[start, end)`` queries q0..q1-1 may see (a superset; Python ints; None: every key). ``right_padded``: built for
    training rows (right-padded or packed), so only real queries must be exact; False: exact at every query of any
    padding. ``causal_prefix`` (right-padded only): the first ``causal_prefix`` queries see exactly the keys <=
    themselves at every real query."""

    mask_mod: MaskMod
    B: int
    Q: int
    KV: int
    spans: Callable[[int, int], Sequence[tuple[int, int]]] | None = None
    right_padded: bool = False
    causal_prefix: int = 0
    _blocks: dict = field(default_factory=dict, repr=False)  # flex BlockMask per device, shared by a forward's layers

    def evaluate(self, q0: int, q1: int, kv_idx: Tensor) -> Tensor:
        """[B, 1, q1 - q0, len(kv_idx)] bool: the mask on queries q0..q1-1 and the keys ``kv_idx``."""
        dev = kv_idx.device
        b = torch.arange(self.B, device=dev)[:, None, None, None]
        h = torch.zeros((), dtype=torch.long, device=dev)
        q = torch.arange(q0, q1, device=dev)[None, None, :, None]
        return self.mask_mod(b, h, q, kv_idx[None, None, None, :]).expand(self.B, 1, q1 - q0, kv_idx.shape[0])

    def dense(self, device: torch.device) -> Tensor:
        """[B, 1, Q, KV] bool: the whole mask (the ``dense`` kernel and the tests)."""
        return self.evaluate(0, self.Q, torch.arange(self.KV, device=device))

    def block_mask(self, device: torch.device, Q: int, KV: int):
        """The flex ``BlockMask`` of this mask padded to Q x KV (padded queries and keys see nothing), made once per
        device: a forward's layers share it."""
        if device not in self._blocks:
            # The true sizes as device tensors, not Python ints: compiled code would specialise on an int's value.
            mod = self.mask_mod
            q_last, kv_last = (torch.full((), n - 1, dtype=torch.long, device=device) for n in (self.Q, self.KV))

            def padded(b, h, q_idx, kv_idx):
                inside = (q_idx <= q_last) & (kv_idx <= kv_last)
                return inside & mod(b, h, torch.minimum(q_idx, q_last), torch.minimum(kv_idx, kv_last))

            self._blocks[device] = _create_block_mask(device)(padded, self.B, None, Q, KV, device=device)
        return self._blocks[device]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: StructuredMask) -> Tensor:
    """Attention of q [B, h, Q, hd] over k, v [B, h, KV, hd] under ``mask`` with ``trainer.attention``'s kernel;
    [B, h, Q, hd] in q's dtype. Softmax scale 1/sqrt(hd), as SDPA's default."""
    if (q.shape[0], q.shape[2], k.shape[2]) != (mask.B, mask.Q, mask.KV):
        raise ValueError(f"attention over q {tuple(q.shape)}, k {tuple(k.shape)} under a mask built for B={mask.B}, "
                         f"Q={mask.Q}, KV={mask.KV}: build the mask from the same rows and sizes")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    kernel = kernel_for(q.device, needs_grad)
    if kernel == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(q.device))
    if mask.right_padded and mask.causal_prefix >= max(mask.Q, mask.KV):  # plainly causal: the fused causal kernel
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if kernel == "flex":
        return _flex(q, k, v, mask)
    return _tiled(q, k, v, mask)


def _tiled(q: Tensor, k: Tensor, v: Tensor, mask: StructuredMask) -> Tensor:
    P = min(mask.causal_prefix, mask.Q, mask.KV) if mask.right_padded else 0
    outs = []
    if P:
        outs.append(F.scaled_dot_product_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P], is_causal=True))
    for q0 in range(P, mask.Q, TILE):
        q1 = min(q0 + TILE, mask.Q)
        spans = [(s, e) for s, e in (mask.spans(q0, q1) if mask.spans else [(0, mask.KV)]) if e > s]
        if len(spans) == 1:  # one range: views, no copy
            (s, e), = spans
            k_t, v_t = k[:, :, s:e], v[:, :, s:e]
        else:
            k_t = torch.cat([k[:, :, s:e] for s, e in spans], 2)
            v_t = torch.cat([v[:, :, s:e] for s, e in spans], 2)
        cols = torch.cat([torch.arange(s, e, device=q.device) for s, e in spans])
        outs.append(F.scaled_dot_product_attention(q[:, :, q0:q1], k_t, v_t, attn_mask=mask.evaluate(q0, q1, cols)))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: StructuredMask) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    # Sizes padded to a power of two: the compiled kernels (dynamic=False) then see a few shapes however the anchors
    # and chains of a batch vary (P-EAGLE's and DFlash's query counts follow the data), instead of recompiling per
    # batch. The padding costs only memory for q, k, v: its blocks are masked out, and flex skips them.
    Q, KV = _bucket(mask.Q), _bucket(mask.KV)
    q = F.pad(q, (0, 0, 0, Q - mask.Q))
    k, v = F.pad(k, (0, 0, 0, KV - mask.KV)), F.pad(v, (0, 0, 0, KV - mask.KV))
    run = _compiled_flex() if FLEX_COMPILE else flex_attention
    return run(q, k, v, block_mask=mask.block_mask(q.device, Q, KV))[:, :, : mask.Q]


def _bucket(n: int) -> int:
    return max(128, 1 << (n - 1).bit_length())


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=False: one kernel per shape, as SpecForge and speculators compile it (a step's shapes repeat).
    return torch.compile(flex_attention, dynamic=False)


def _create_block_mask(device: torch.device):
    """``create_block_mask``, compiled where flex runs compiled (it then evaluates the mask a block at a time; eager it
    evaluates all of [Q, KV] at once, acceptable only for the small masks of CPU tests)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return _compiled_block_mask() if FLEX_COMPILE and device.type == "cuda" else create_block_mask


@functools.cache
def _compiled_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False)


# --- the drafters' masks ------------------------------------------------------------------------------------------
# A mask_mod closes over tensors and Python values that compiled flex code treats as fixed: the sequence length,
# block size and window (fixed for a run) and tensors whose size follows the data (anchors, chains), padded to
# ``_bucket`` sizes so that a new batch is a new value, not a new shape.

def _padded(t: Tensor, dim: int) -> Tensor:
    """``t`` zero-padded along ``dim`` to a ``_bucket`` size (entries past the true size are never read)."""
    extra = _bucket(t.shape[dim]) - t.shape[dim]
    if extra <= 0:
        return t
    return torch.cat([t, t.new_zeros((*t.shape[:dim], extra, *t.shape[dim + 1:]))], dim)


def ttt_step_mask(attn_BT: Tensor, step: int, right_padded: bool = True, window: int | None = None
                  ) -> StructuredMask:
    """EAGLE training-time-test step ``step``'s mask over keys [step 0's T | step 1's T | ... | step ``step``'s T]:
    query t sees step 0's keys <= t that are real tokens (and always its own, so a padded query is never left with no
    key), and step i's key at t itself for i = 1..step. With ``window``: of step 0's keys only those less than
    ``window`` positions before the query's own position, t + step."""
    B, T = attn_BT.shape
    attn_BT = attn_BT.bool()

    def mask_mod(b, h, q_idx, kv_idx):
        i = kv_idx // T
        c = kv_idx - i * T  # the key's position
        ctx = (c <= q_idx) & (attn_BT[b, c] | (c == q_idx))
        if window is not None:
            ctx = ctx & (q_idx + step - c < window)
        return torch.where(i == 0, ctx, c == q_idx)

    def spans(q0, q1):  # step 0's keys up to the tile's last query, then each later step's keys at the tile itself
        first = 0 if window is None else max(0, q0 + step - window + 1)
        return [(first, q1)] + [(i * T + q0, i * T + q1) for i in range(1, step + 1)]

    plain = right_padded and step == 0 and window is None
    return StructuredMask(mask_mod, B, T, (step + 1) * T, spans, right_padded, T if plain else 0)


def dflash_block_mask(anchors_BN: Tensor, attn_BT: Tensor, block_size: int, window: int | None = None
                      ) -> StructuredMask:
    """DFlash's mask over the queries [block 0's S | block 1's S | ...] and keys [context T ; the same blocks]: block
    n's queries see the real context positions before its anchor (with ``window``: only those less than ``window``
    positions before the query's own) and every position of their own block (non-causal), nothing of other blocks."""
    B, N = anchors_BN.shape
    T, S = attn_BT.shape[1], block_size
    attn_BT = attn_BT.bool()
    anchors_BN = _padded(anchors_BN, 1)

    def mask_mod(b, h, q_idx, kv_idx):
        n = q_idx // S
        anchor = anchors_BN[b, n]
        ctx = (kv_idx < anchor) & attn_BT[b, kv_idx.clamp(max=T - 1)]
        if window is not None:  # the query sits at anchor + its slot
            ctx = ctx & (anchor + (q_idx - n * S) - kv_idx < window)
        return torch.where(kv_idx < T, ctx, (kv_idx - T) // S == n)

    def spans(q0, q1):  # the whole context (anchors are data), then the tile's own blocks
        return [(0, T), (T + q0 // S * S, T + -(-q1 // S) * S)]

    return StructuredMask(mask_mod, B, N * S, T + N * S, spans)


def parallel_chain_mask(attn_BT: Tensor, anchors_BN: Tensor, counts: Sequence[int], right_padded: bool = True,
                        window: int | None = None) -> StructuredMask:
    """P-EAGLE's mask over the queries (and keys) [depth 0 at 0..T-1 | depth 1's n_1 chains | depth 2's n_2 | ...]
    (chain i of every depth is anchored at ``anchors_BN[:, i]``; ``counts`` = n_1, n_2, ...): depth 0 is causal over
    real tokens (a query always sees itself); a depth-d query of chain i sees the depth-0 keys <= its anchor that are
    real tokens and the depth 1..d keys of chain i. With ``window``: of the depth-0 keys only those less than
    ``window`` positions before the query's own (t at depth 0, anchor + d at depth d)."""
    B, T = attn_BT.shape
    attn_BT = attn_BT.bool()
    slots = sum(counts)
    dev = attn_BT.device
    has_slots = slots > 0  # (the mask_mod reads no count: compiled code would specialise on it)
    if has_slots:
        chain = _padded(torch.cat([torch.arange(n, device=dev) for n in counts]), 0)  # [slots, padded]
        depth = _padded(torch.cat([torch.full((n,), d, device=dev) for d, n in enumerate(counts, start=1)]), 0)
        anchors_BN = _padded(anchors_BN, 1)

    def mask_mod(b, h, q_idx, kv_idx):
        real = attn_BT[b, kv_idx.clamp(max=T - 1)]
        zero = (kv_idx <= q_idx) & (real | (kv_idx == q_idx))
        if window is not None:
            zero = zero & (q_idx - kv_idx < window)
        if not has_slots:
            return zero
        s_q, s_k = (q_idx - T).clamp(min=0), (kv_idx - T).clamp(min=0)
        anchor = anchors_BN[b, chain[s_q]]
        to_ctx = (kv_idx <= anchor) & real
        if window is not None:
            to_ctx = to_ctx & (anchor + depth[s_q] - kv_idx < window)
        to_slot = (chain[s_k] == chain[s_q]) & (depth[s_k] <= depth[s_q])
        return torch.where(q_idx < T, zero, torch.where(kv_idx < T, to_ctx, to_slot))

    ends = [T + sum(counts[:d]) for d in range(len(counts) + 1)]  # where depth d's slots end

    def spans(q0, q1):  # depth 0 and every depth up to the tile's deepest query's (slots are grouped by depth)
        deepest = next(d for d, end in enumerate(ends) if q1 <= end)
        return [(0, ends[deepest] if deepest else q1)]

    plain = right_padded and window is None
    return StructuredMask(mask_mod, B, T + slots, T + slots, spans, right_padded, T if plain else 0)
