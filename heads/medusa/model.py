"""Medusa-1 heads: K small residual MLPs on the target's last hidden state, each with its own vocab projection.

Which token each output predicts (heads are numbered k = 1..K; index i = k - 1 in code):
    the target's own lm_head at position t predicts token t+1; Medusa head k at position t predicts token t+k+1.

Shape legend:  B batch, T sequence, D target hidden size, V vocabulary, K number of heads.
    hidden_BTD (target hidden state after the final norm, hidden-state index -1)
      -> head k: [ResBlock] * num_layers (separate weights) -> Linear(D, V) -> logits_BTV
    (training: the Linear and the loss run together in row chunks, ``distill.chunked``; logits_BTV never exists)

Decoding: ``tree`` null is the top-1 chain (head k's argmax at depth k); a static tree (``inference.tree``: a preset
name or a list of top-k index paths) verifies several candidates per depth in one target forward. Candidates are
top-k picks, not draws, so they carry no draft probabilities and sampling acceptance stays lossless. The step
decoder drafts through ``static_draft`` (``MedusaStaticDraft``: the same heads on the last committed hidden state,
one capture-safe step over fixed buffers).

Training target: head k at position t is distilled toward the teacher's distribution for token t+k+1, which is the
teacher's logits at position t+k; weights decay as ``loss_decay ** (k - 1)`` (Medusa's 0.8^k schedule).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from distill.chunked import Finished, TeacherRows, chunked_divergence, slice_positions
from distill.teacher_output import TeacherOutput
from heads import flops
from heads.base import DraftOutput, DraftTerm, Drafter, TargetDims
from inference.sampling import SamplingConfig
from inference.static_draft import DraftBuffers, mark_static
from inference.tree import parse_tree


def _raw(logits: Tensor) -> Tensor:
    return logits


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b zero-initialised so a fresh head starts as the target's own lm_head."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHead(nn.Sequential):
    """``num_layers`` ResBlocks, then Linear(D, V). Called with teacher rows and a loss, it returns that loss and its
    argmax per row, projecting in chunks (``distill.chunked``) inside its own call, where a sharding engine has its
    weights gathered; the [N, V] logits never exist whole."""

    def features(self, x: Tensor) -> Tensor:
        for block in list(self)[:-1]:
            x = block(x)
        return x

    def projection(self, finish=_raw) -> nn.Module:
        """The vocabulary projection the loss compares: the Linear, then ``finish`` (what the target's forward does
        after its lm_head, e.g. Gemma-2's soft-capping) when there is something to finish."""
        return self[-1] if finish is _raw else Finished(self[-1], finish)

    def forward(self, x: Tensor, teacher: TeacherRows | None = None, loss_fn=None, finish=_raw,
                weight_N: Tensor | None = None):
        if teacher is None:
            return self[-1](self.features(x))
        return chunked_divergence(self.features(x), self.projection(finish), teacher, loss_fn, weight_N=weight_N)


class MedusaHeads(Drafter):
    name = "medusa"
    teacher_layers = (-1,)

    def __init__(self, dims: TargetDims | Mapping[str, int], num_heads: int = 4, num_layers: int = 1,
                 loss_decay: float = 0.8, tree: str | list | None = None):
        super().__init__(dims)
        if num_heads < 1:
            raise ValueError(f"drafter.num_heads must be >= 1, got {num_heads}")
        if num_layers < 0:
            raise ValueError(f"drafter.num_layers must be >= 0, got {num_layers}")
        if not 0 < loss_decay <= 1:
            raise ValueError(f"drafter.loss_decay must be in (0, 1], got {loss_decay}")
        D, V = self.dims.hidden_size, self.dims.vocab_size
        self.num_heads, self.loss_decay = num_heads, loss_decay
        # Each head and each block is built separately: `[block] * n` would share one set of weights.
        self.heads = nn.ModuleList(
            MedusaHead(*(ResBlock(D) for _ in range(num_layers)), nn.Linear(D, V, bias=False))
            for _ in range(num_heads)
        )
        self._finish = _raw  # until bound: heads' raw logits (candidates are top-k picks: the same either way)
        self.set_tree(tree)

    def set_tree(self, spec) -> None:
        self.tree = parse_tree(spec, max_depth=self.num_heads)
        self._tree_index: dict = {}  # (depth, device) -> the static tree's gather index and parents, built once

    def bind_target(self, teacher, initialize: bool) -> None:
        self._finish = teacher.output_logits.finish  # what the target's forward does after its lm_head (soft-capping)
        if initialize:
            # Start every head's projection at the target's lm_head (copied, not shared: heads train it).
            lm_head = teacher.lm_head.weight.detach()
            for head in self.heads:
                head[-1].weight.data.copy_(lm_head.to(head[-1].weight.dtype))

    def train_flops(self, target, B: int, T: int):
        return flops.medusa(self, target, B, T)

    def head_logits(self, hidden_BTD: Tensor) -> list[Tensor]:
        return [head(hidden_BTD) for head in self.heads]

    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        hidden_BTD = teacher_out.hidden[-1]
        T = hidden_BTD.shape[1]
        terms = []
        for i, head in enumerate(self.heads):
            shift = i + 1  # head k = i + 1 at t is compared with teacher logits at t + k (predicting t + k + 1)
            if T <= shift + 1:
                break
            # every position t < T - shift - 1 is a row, weighted by whether it is trained: static shapes, no sync
            B, n = hidden_BTD.shape[0], T - shift - 1
            weight_N = self.train_mask(batch, i).reshape(-1).float()
            hidden_ND = hidden_BTD[:, :n].reshape(B * n, -1)
            teacher = TeacherRows(teacher_out, *slice_positions(B, n, shift, hidden_BTD.device))
            weight = self.loss_decay**i
            if loss_fn is None:  # evaluated later by DraftOutput.loss
                terms.append(DraftTerm(head.features(hidden_ND), head.projection(self._finish), teacher, weight=weight,
                                       weight_N=weight_N))
            else:  # through the head's own call (sharding engines gather its weights for it)
                loss_sum, pred_N = head(hidden_ND, teacher, loss_fn, self._finish, weight_N)
                terms.append(DraftTerm(hidden_ND, head, teacher, weight=weight, loss_sum=loss_sum, pred_N=pred_N,
                                       weight_N=weight_N))
        return DraftOutput(terms=terms, num_valid=self.count_valid(batch)).evaluate(loss_fn)

    def compile_regions(self) -> list[tuple[object, str]]:
        """Each head's ResBlocks (its projection runs in the chunked loss, compiled there)."""
        return [(head, "features") for head in self.heads]

    def train_mask(self, batch: Mapping[str, Tensor], k: int) -> Tensor:
        """[B, T - k - 2]: head k + 1 is trained at t when the token it predicts, t + k + 2, is real and loss-bearing."""
        return (batch["loss_mask"].bool() & batch["attention_mask"].bool())[:, k + 2:]

    # --- decoding ------------------------------------------------------------------------------------------
    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        """The heads on the last committed hidden state as one capture-safe step (``MedusaStaticDraft``), drafting
        min(num_heads, committed rows - 1) deep. Candidates are top-k picks for any ``sampling``; ``generator`` and
        ``capacity`` are unused (the heads keep no context)."""
        depth = min(self.num_heads, committed.ids_M.shape[0] - 1)
        paths = self.tree.paths if self.tree is not None else None
        return self.reuse_static_draft((paths, depth), committed, capacity, sampling, generator,
                                       lambda: MedusaStaticDraft(self, committed, depth))

    def _static_tree(self, depth: int, device: torch.device) -> tuple[list[int], Tensor, Tensor, int]:
        """(candidates per head, index of each path's token among them, parents, depth) of the tree limited to
        ``depth``, on ``device``: built on the first proposal and reused (a static tree's shape never changes)."""
        key = (depth, str(device))
        if key not in self._tree_index:
            tree = self.tree.limited(depth)
            # Head i's candidates, as deep into its ranking as any path at depth i + 1 reaches.
            ranks = [1 + max((p[-1] for p in tree.paths if len(p) == i + 1), default=-1) for i in range(tree.depth)]
            offsets = [sum(ranks[:i]) for i in range(len(ranks))]
            flat = torch.tensor([offsets[len(p) - 1] + p[-1] for p in tree.paths], dtype=torch.long, device=device)
            parents = torch.tensor(tree.parents, dtype=torch.long, device=device)
            self._tree_index[key] = (ranks, flat, parents, tree.depth)
        return self._tree_index[key]


class MedusaStaticDraft:
    """``inference.static_draft.StaticDraft`` for Medusa heads (batch 1): the heads read the target's hidden state of
    the last committed row (``count - 1``; after ``prefill``, the prompt's last), then the chain takes each head's
    argmax and a static tree gathers each path's candidate from the heads' top-k through a preset index. The tree's
    parents never change: they are written once."""

    def __init__(self, drafter: MedusaHeads, committed, depth: int):
        if -1 not in committed.hidden_M:
            raise ValueError(f"medusa reads the target's final hidden state (layer -1); the committed buffers hold "
                             f"{sorted(committed.hidden_M)}: allocate them with layers=drafter.teacher_layers")
        if depth < 1:
            raise ValueError(f"medusa needs committed buffers of at least 2 rows (1 + the draft depth), got "
                             f"{committed.ids_M.shape[0]}")
        self.drafter, self.committed = drafter, committed
        weight = drafter.heads[0][-1].weight
        dev = weight.device
        self.last_1D = torch.zeros(1, drafter.dims.hidden_size, device=dev, dtype=weight.dtype)
        self.fresh = torch.ones((), dtype=torch.bool, device=dev)  # set by prefill: read last_1D, not the rows
        if drafter.tree is None:
            self.ranks, self.flat, self.depth = None, None, depth
            parents = torch.arange(-1, depth - 1, device=dev)
        else:
            self.ranks, self.flat, parents, self.depth = drafter._static_tree(depth, dev)
        self.buffers = DraftBuffers(tokens_T=torch.zeros(parents.shape[0], dtype=torch.long, device=dev),
                                    parents_T=parents.clone(), chain=drafter.tree is None)
        mark_static(self.last_1D, self.fresh, self.buffers.tokens_T, self.buffers.parents_T,
                    *([self.flat] if self.flat is not None else []))

    @torch.no_grad()
    def prefill(self, prompt_ids_P: Tensor, hidden_P: dict[int, Tensor], pending: Tensor) -> None:
        self.last_1D.copy_(hidden_P[-1].reshape(-1, self.last_1D.shape[1])[-1:])
        self.fresh.fill_(True)

    @torch.no_grad()
    def draft(self) -> None:
        c = self.committed
        newest = c.hidden_M[-1].index_select(0, (c.count - 1).reshape(1)).to(self.last_1D.dtype)
        self.last_1D.copy_(torch.where(self.fresh, self.last_1D, newest))
        self.fresh.fill_(False)
        heads, h = self.drafter.heads, self.last_1D
        if self.flat is None:
            tokens = torch.cat([heads[i](h).argmax(-1) for i in range(self.depth)])
        else:
            top = torch.cat([heads[i](h).topk(r, dim=-1).indices for i, r in enumerate(self.ranks) if r], 1)[0]
            tokens = top[self.flat]
        self.buffers.tokens_T.copy_(tokens)
