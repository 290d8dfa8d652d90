"""EAGLE-2 dynamic draft trees: grow the tree where the drafter is confident, then keep the best nodes.

The hook a feature drafter (EAGLE, ``heads/eagle.py``) calls from ``propose``. It only needs a function that scores
the children of a set of frontier nodes:

    score_children(frontier, tokens, parents) -> logprobs [len(frontier), V]
        frontier: node indices to score (-1 = the pending token); tokens / parents: every node created so far
        (node i is token ``tokens[i]`` under node ``parents[i]``), so the drafter can run the frontier nodes.

Expansion (Li et al. 2024, EAGLE-2): a node's value is its cumulative draft log-probability (the product of the
confidences along its path approximates its chance of acceptance). Depth 1 takes the root's ``top_k`` children;
each further depth scores the ``top_k`` most valuable nodes of the previous depth and adds each one's ``top_k``
children. After ``depth`` levels the ``total_tokens`` most valuable nodes are kept. A child is never worth more than
its parent, so the kept set is closed under ancestors (ties go to the earlier node, which is the parent).
Candidates are top-k picks, not draws: the tree carries no draft probabilities (see ``inference.acceptance``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from inference.tree import DraftTree

ScoreFn = Callable[[Sequence[int], Sequence[int], Sequence[int]], Tensor]


def check_dynamic_tree_args(top_k: int, depth: int, total_tokens: int) -> None:
    for key, value in (("top_k", top_k), ("depth", depth), ("total_tokens", total_tokens)):
        if value < 1:
            raise ValueError(f"drafter.{key} must be >= 1, got {value}")


def expand_dynamic_tree(score_children: ScoreFn, top_k: int, depth: int, total_tokens: int,
                        device: torch.device | str = "cpu") -> DraftTree:
    check_dynamic_tree_args(top_k, depth, total_tokens)
    tokens: list[int] = []
    parents: list[int] = []
    values: list[float] = []
    frontier, frontier_values = [-1], [0.0]
    for _ in range(depth):
        logprobs_FV = score_children(frontier, tokens, parents).float()
        top = logprobs_FV.topk(min(top_k, logprobs_FV.shape[-1]), dim=-1)
        level_start = len(tokens)
        for f, (node, base) in enumerate(zip(frontier, frontier_values)):
            for lp, tok in zip(top.values[f].tolist(), top.indices[f].tolist()):
                tokens.append(tok)
                parents.append(node)
                values.append(base + lp)
        level = range(level_start, len(tokens))
        frontier = sorted(level, key=lambda i: (-values[i], i))[:top_k]
        frontier_values = [values[i] for i in frontier]
    keep = sorted(range(len(tokens)), key=lambda i: (-values[i], i))[:total_tokens]
    keep.sort()  # creation order is topological: a parent is created before its children
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        torch.tensor([tokens[i] for i in keep], dtype=torch.long, device=device),
        torch.tensor([new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep], dtype=torch.long, device=device),
    )
