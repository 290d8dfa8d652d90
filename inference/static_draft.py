"""A drafter's whole draft step as one capture-safe tensor function: the contract between the step decoder and a
drafter that runs inside CUDA graphs.

The step decoder keeps every tensor a decode step reads or writes in buffers allocated once, before any capture;
a step is a pure function of those buffers (no Python value that changes between steps, no read-back, no new
allocation the host keeps), so it can be recorded once per shape bucket and replayed. A drafter that offers
``static_draft`` runs its catch-up on the newly committed positions and every draft level the same way, straight
after the target's verification and with no host work in between (SGLang's EAGLE draft CUDA-graph runner and
vLLM's EAGLE proposer keep the same kind of persistent buffers).

Per step (batch 1), the decoder rewrites ``CommittedBuffers`` in place; the drafter reads them and rewrites its
``DraftBuffers`` in place. M = the verify bucket's 1 + its deepest path; T = the drafter's draft width.

The batched decoder runs the same object for the R rows of a batch bucket (``inference.batch_draft``): its tensors
stacked along a row dimension and ``draft`` vmapped over them. So a static draft keeps every value that changes per
sequence in a tensor it holds (an attribute, or in a list, dict or object it holds), each buffer in one attribute
(slices taken inside the step), and sets on the host, per step, only the shape ``use_shape`` picks.

Shapes: M committed rows, T draft nodes, D hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from inference.acceptance import sample_uniform
from inference.hash32 import MASK32, mix32, mul32
from inference.sampling import warp


@dataclass
class CommittedBuffers:
    """What the last verification committed, in static buffers the decoder owns (rows >= ``count`` are padding
    with finite values the drafter must ignore)."""

    ids_M: Tensor  # [M] long: the previous pending token, then the accepted path's tokens
    hidden_M: dict[int, Tensor]  # teacher layer index -> [M, D]: the target's hidden state after feeding ids_M[i]
    count: Tensor  # [] long, 1 <= count <= M: how many rows are real (1 + accepted nodes)
    position: Tensor  # [] long: the position id of ids_M[0] (ids_M[i] sits at position + i)
    pending: Tensor  # [] long: the target's next token (not yet fed), at position + count: the root of the draft


@dataclass
class DraftBuffers:
    """The draft, in static buffers the drafter owns; the decoder's verify step reads them as they are."""

    tokens_T: Tensor  # [T] long: candidate tokens in topological order (siblings in the order to try them)
    parents_T: Tensor  # [T] long: -1 = child of the pending token, else the index of an earlier node
    probs_TV: Tensor | None = None  # [T, V] the draft distributions of a sampled chain; None: point masses
    chain: bool = False  # parents are always 0 .. T - 2 (the host knows the shape without reading it)


@runtime_checkable
class StaticDraft(Protocol):
    """A drafter's decoding state at one capacity bucket, with every buffer allocated by the time it is returned."""

    buffers: DraftBuffers

    def prefill(self, prompt_ids_P: Tensor, hidden_P: dict[int, Tensor], pending: Tensor) -> None:
        """Eager, once per sequence, before any step: the prompt's tokens [P], the target's hidden states at every
        prompt position (layer -> [P, D]) and the first generated token ([] long). Writes into the preallocated
        state (never reallocates); the first ``draft`` call drafts after ``pending``."""
        ...

    def draft(self) -> None:
        """Capture-safe: catch up on ``CommittedBuffers`` (as the decoder left them after its last verification;
        skipped by the first call after ``prefill``), then draft all levels into ``buffers``."""
        ...


class ShapedDraft(Protocol):
    """Optional on a ``StaticDraft`` whose step has more than one static shape: attention over a capacity bucket
    that grows with the sequence (as the target's ``inference.batch_cache.BatchKV``), a catch-up no wider than
    what the last verification left to feed. The decoder calls ``use_shape`` on the host before each draft and keeps
    one recorded draft step per key it returns."""

    def use_shape(self, context: int, own_draft: bool) -> tuple[int, ...]:
        """Host: the next ``draft`` follows ``context`` committed tokens (the pending token's position);
        ``own_draft``: the committed rows past the first are this step's own last draft (the decoder verified it,
        or ``prefill`` ran), not another proposal's. Fix the step's shape (Python constants of the recorded step)
        and return it as the key of its recording."""
        ...


def mark_static(*tensors: Tensor) -> None:
    """Tell ``torch.compile`` these buffers keep their address: a compiled step reads and writes them in place (and
    under ``mode="reduce-overhead"`` keeps its CUDA graph, which it would otherwise skip for a step that mutates its
    inputs)."""
    for t in tensors:
        try:
            torch._dynamo.mark_static_address(t)
        except Exception:  # noqa: BLE001 - a hint only; a torch without it still decodes
            pass


def weights_signature(module) -> tuple:
    """The dtype, device and storage of every parameter of ``module``: a cast (``module.to``) reallocates them, and a
    step recorded over the old ones would read freed memory, so a static draft is reused only while this holds."""
    parameters = getattr(module, "parameters", None)  # a proposer need not be an nn.Module
    return tuple((p.dtype, p.device, p.data_ptr()) for p in parameters()) if parameters else ()


def check_layers_held(drafter, committed: CommittedBuffers) -> None:
    """A static draft's refusal: the committed buffers must hold every target layer ``drafter`` reads."""
    missing = [i for i in drafter.teacher_layers if i not in committed.hidden_M]
    if missing:
        raise ValueError(f"{drafter.name} reads target hidden-state layers {list(drafter.teacher_layers)}; the "
                         f"committed buffers hold {sorted(committed.hidden_M)} (missing {missing}): allocate them "
                         f"with layers=drafter.teacher_layers")


def check_prompt_fits(name: str, prompt_len: int, capacity: int) -> None:
    """A ``StaticDraft.prefill`` refusal: the prompt must fit the capacity its buffers were allocated for."""
    if not 1 <= prompt_len <= capacity:
        raise ValueError(f"{name}: a prompt of {prompt_len} tokens does not fit this static draft's capacity "
                         f"{capacity}; allocate it with a larger capacity bucket")


def reseed_draws(seed: Tensor, counter: Tensor, generator: torch.Generator | None) -> None:
    """Eager, per sequence: a sampling static draft's in-step uniforms are a hash of (``seed``, ``counter``) (a
    compiled step cannot trace a generator); draw a fresh ``seed`` from the decoder's ``generator`` and restart
    ``counter``, so each sequence's drafts are independent yet a seeded evaluation is reproducible."""
    draw = torch.randint(0, 2**31 - 1, (1,), generator=generator,
                         device=generator.device if generator is not None else "cpu")
    seed.copy_(draw[0])
    counter.zero_()


def new_committed(rows: int, layers: tuple[int, ...], hidden_size: int, device: torch.device | str,
                  dtype: torch.dtype) -> CommittedBuffers:
    """``CommittedBuffers`` of ``rows`` rows, zero-filled, allocated once (the decoder's verify step writes them)."""
    long = dict(dtype=torch.long, device=device)
    return CommittedBuffers(
        ids_M=torch.zeros(rows, **long),
        hidden_M={i: torch.zeros(rows, hidden_size, dtype=dtype, device=device) for i in layers},
        count=torch.ones((), **long),
        position=torch.zeros((), **long),
        pending=torch.zeros((), **long),
    )


def hashed_uniforms(seed: Tensor, counter: Tensor, index_n: Tensor) -> Tensor:
    """[n] float32 uniforms in [0, 1 - 2**-23] from (seed, counter, index): fixed-shape integer ops, so a CUDA graph
    replays fresh draws as ``counter`` advances. 23 bits: u * total then stays below total in float32, so the
    inverse CDF never runs past the last token."""
    x = mix32((seed & MASK32) ^ mul32(counter & MASK32, 0x9E3779B1))
    x = mix32(x ^ mul32(index_n & MASK32, 0x85EBCA77))
    return (x >> 9).to(torch.float32) * (1.0 / (1 << 23))


def draw_chain(static, logits_TV: Tensor) -> None:
    """A parallel drafter's sampled chain inside its static step: ``static.depth`` tokens, one per row of the warped
    ``logits_TV``, drawn with the step's hashed uniforms (a fresh counter each step), their distributions kept in
    ``static.buffers.probs_TV`` for rejection sampling."""
    uniforms = hashed_uniforms(static.seed, static.counter, static.draws_T)
    static.counter.add_(1)
    probs = warp(logits_TV, static.sampling)
    static.buffers.probs_TV.copy_(probs)
    static.buffers.tokens_T.copy_(torch.cat([sample_uniform(probs[k], uniforms[k: k + 1])
                                             for k in range(static.depth)]))


def clip_tree(buffers, depth: int) -> None:
    """Nodes of a static draft's tree deeper than ``depth`` (a root child has depth 1) get token -1, which is never
    accepted: the step's bucket stays, the accepted path stays within the tokens a decode still needs. On the
    device, ``depth - 1`` gathers; the next draft rewrites every node."""
    parents = buffers.parents_T
    up = parents.clone()  # each node's ancestor 1, then 2, ... levels up (-1 once past a root child)
    for _ in range(depth - 1):
        up = torch.where(up >= 0, parents[up.clamp(min=0)], up)
    buffers.tokens_T.masked_fill_(up >= 0, -1)  # still below a node after ``depth`` levels: deeper than ``depth``
