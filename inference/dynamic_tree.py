"""EAGLE-2 dynamic draft trees: grow the tree where the drafter is confident, then keep the best nodes.

The hook a feature drafter (EAGLE, ``heads/eagle/model.py``) calls from ``propose``. It only needs a function that scores
one level of nodes at a time:

    score(level, parent_slot_F, tokens_F) -> logits [F, V] (log-probabilities up to a per-row constant)
        level 0: the pending token alone (F = 1; parent_slot_F and tokens_F are None);
        level d >= 1: the F frontier nodes of depth d: node f is token ``tokens_F[f]`` under the node scored in slot
        ``parent_slot_F[f]`` (-1: the pending token). Slots number the scored nodes in the order they were scored
        (level 1's frontier takes slots 0 .. F - 1, level 2's the next F, ...), so the drafter can keep each scored
        node's state in a tensor indexed by slot.

Every level has a fixed size (top_k, then top_k * top_k candidates), so the whole expansion runs on the device
without reading anything back: no per-step sync however deep the tree.

Expansion (Li et al. 2024, EAGLE-2): a node's value is its cumulative draft log-probability (the product of the
confidences along its path approximates its chance of acceptance). Depth 1 takes the root's ``top_k`` children;
each further depth scores the ``top_k`` most valuable nodes of the previous depth and adds each one's ``top_k``
children. After ``depth`` levels the ``total_tokens`` most valuable nodes are kept. A child is never worth more than
its parent, so the kept set is closed under ancestors (ties go to the earlier node, which is the parent).
Candidates are top-k picks, not draws: the tree carries no draft probabilities (see ``inference.acceptance``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


LevelScore = Callable[[int, Optional[Tensor], Optional[Tensor]], Tensor]


def check_dynamic_tree_args(top_k: int, depth: int, total_tokens: int) -> None:
    for key, value in (("top_k", top_k), ("depth", depth), ("total_tokens", total_tokens)):
        if value < 1:
            raise ValueError(f"drafter.{key} must be >= 1, got {value}")


def _best(values: Tensor, k: int) -> Tensor:
    """Indices of the k largest values along the last axis, ties to the earlier index (a stable sort's order)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _top(logits_FV: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(log-probabilities [..., k] in float64, tokens [..., k]) of each row's k best tokens: top-k of the raw logits,
    then minus the row's logsumexp, so no [..., V] log-softmax is written."""
    top = logits_FV.topk(min(k, logits_FV.shape[-1]), dim=-1)
    norm = torch.logsumexp(logits_FV.float(), -1, keepdim=True)
    return (top.values.float() - norm).double(), top.indices


def expand_dynamic_trees(score: LevelScore, top_k: int, depth: int, total_tokens: int) -> tuple[Tensor, Tensor]:
    """B trees grown side by side (every row the same shape of expansion, its own values): (tokens [B, T], parents
    [B, T]), T = min(total_tokens, nodes scored). ``score(0, None, None)`` gives the roots' logits [B, V];
    ``score(d, parent_slot_BF, tokens_BF)`` row b's F frontier nodes' logits [B, F, V] (slots per row, as above)."""
    check_dynamic_tree_args(top_k, depth, total_tokens)
    values, tokens = _top(score(0, None, None), top_k)  # level 1: the roots' children, [B, k]
    B, dev = tokens.shape[0], tokens.device
    parents = torch.full_like(tokens, -1)  # node index of each node's parent (-1: the pending token)
    level = (values, tokens, torch.full_like(tokens, -1), 0)  # values, tokens, parents' slots, first node index
    all_values, all_tokens, all_parents, slots = [values], [tokens], [parents], 0
    for d in range(1, depth):
        lv, lt, lslot, start = level
        front = _best(lv, top_k)  # [B, F]: the level's most valuable nodes (ties: created first)
        F = front.shape[1]
        child_v, child_t = _top(score(d, lslot.gather(1, front), lt.gather(1, front)), top_k)  # [B, F, k]
        k = child_t.shape[2]
        child_v = (lv.gather(1, front)[:, :, None] + child_v).reshape(B, -1)
        child_t = child_t.reshape(B, -1)
        child_parent = (start + front)[:, :, None].expand(B, F, k).reshape(B, -1)
        child_slot = (slots + torch.arange(F, device=dev))[None, :, None].expand(B, F, k).reshape(B, -1)
        slots += F
        level = (child_v, child_t, child_slot, start + lv.shape[1])
        all_values.append(child_v)
        all_tokens.append(child_t)
        all_parents.append(child_parent)
    values, tokens, parents = torch.cat(all_values, 1), torch.cat(all_tokens, 1), torch.cat(all_parents, 1)
    # Creation order is topological (a parent is created before its children); keep it among the kept nodes.
    keep = _best(values, total_tokens).sort(dim=-1).values  # [B, T]
    T = keep.shape[1]
    new_index = torch.full_like(parents, -1).scatter_(1, keep, torch.arange(T, device=dev).expand(B, T))
    kept_parents = parents.gather(1, keep)
    kept_parents = torch.where(kept_parents >= 0, new_index.gather(1, kept_parents.clamp(min=0)), -1)
    return tokens.gather(1, keep), kept_parents
