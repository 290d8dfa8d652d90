"""The acceptance rules walked on the host, node by node, reading each verdict back: the readable references the
decoder's device verdicts (``inference.acceptance``: every node decided at once, read back once per step) are tested
against. Each returns ``(path, committed)``: the accepted draft nodes, root side first, and the tokens committed
this step (the accepted drafts plus one token from the target: the bonus, or the correction at the first
rejection)."""

from __future__ import annotations

import torch
from torch import Tensor

from inference.acceptance import TYPICAL_ALPHA, TYPICAL_THRESHOLD, _siblings_before
from inference.sampling import sample
from inference.tree import DraftTree


def greedy_accept(draft_K: Tensor, target_argmax_K1: Tensor) -> tuple[int, Tensor]:
    """Chain form: (accepted count a, committed = draft[:a] + [target_argmax[a]])."""
    K = draft_K.shape[0]
    if target_argmax_K1.shape[0] != K + 1:
        raise ValueError(f"target verdict has {target_argmax_K1.shape[0]} tokens for a draft of {K}; expected {K + 1}")
    mismatch = (draft_K != target_argmax_K1[:K]).nonzero()
    accepted = int(mismatch[0]) if mismatch.numel() else K
    return accepted, target_argmax_K1[: accepted + 1]


def chain_rejection_accept(draft_K: Tensor, q_KV: Tensor | None, p_K1V: Tensor,
                           generator: torch.Generator | None = None) -> tuple[int, Tensor]:
    """Leviathan/Chen speculative sampling for one chain, vectorised (gpt-fast's ``speculative_decode``)."""
    K = draft_K.shape[0]
    if p_K1V.shape[0] != K + 1:
        raise ValueError(f"target distributions have {p_K1V.shape[0]} rows for a draft of {K}; expected {K + 1}")
    idx = torch.arange(K, device=draft_K.device)
    p_x = p_K1V[idx, draft_K]
    q_x = q_KV[idx, draft_K] if q_KV is not None else torch.ones_like(p_x)
    u = torch.rand(K, generator=generator, device=p_x.device)
    rejected = (u >= (p_x / q_x).clamp(max=1)).nonzero()
    if not rejected.numel():
        return K, torch.cat([draft_K, sample(p_K1V[K:], generator)])
    a = int(rejected[0])
    residual = _residual(p_K1V[a], q_KV[a] if q_KV is not None else None, draft_K[a])
    return a, torch.cat([draft_K[:a], sample(residual[None], generator)])


def _residual(p_V: Tensor, q_V: Tensor | None, rejected: Tensor) -> Tensor:
    """norm(max(0, p − q)); for a point-mass draft that is p with the rejected token removed."""
    if q_V is None:
        r = p_V.clone()
        r[rejected] = 0
    else:
        r = (p_V - q_V).clamp(min=0)
    total = r.sum()
    # Zero only when p == q (a rejection of probability 0, reachable only through float rounding): keep p.
    return r / total if total > 0 else p_V


def tree_rejection_accept(tree: DraftTree, p_N1V: Tensor, generator: torch.Generator | None = None) -> tuple[list[int], Tensor]:
    """Multi-candidate recursive rejection sampling down the tree; a chain reduces to Leviathan/Chen."""
    if p_N1V.shape[0] != tree.size + 1:
        raise ValueError(f"target distributions have {p_N1V.shape[0]} rows for a tree of {tree.size}; expected {tree.size + 1}")
    if tree.is_chain:
        a, committed = chain_rejection_accept(tree.tokens, tree.probs_NV, p_N1V, generator)
        return list(range(a)), committed
    kids = tree.children()
    tokens = tree.tokens
    path: list[int] = []
    node = -1
    while True:
        p = p_N1V[node + 1]
        candidates = kids[node + 1]
        q = tree.probs_NV[candidates[0]].clone() if candidates and tree.probs_NV is not None else None
        chosen = None
        u = torch.rand(len(candidates), generator=generator, device=p.device).tolist()
        for c, u_c in zip(candidates, u):
            x = tokens[c]
            accept = p[x] if q is None else (p[x] / q[x]).clamp(max=1)
            if u_c < float(accept):
                chosen = c
                break
            p = _residual(p, q, x)
            if q is not None:  # siblings were drawn without replacement: the next one came from q without x
                q[x] = 0
                q = q / q.sum() if q.sum() > 0 else q
        if chosen is None:
            committed = [tokens[path]] if path else []
            return path, torch.cat([*committed, sample(p[None], generator)])
        path.append(chosen)
        node = chosen


def typical_accept(tree: DraftTree, p_N1V: Tensor, threshold: float = TYPICAL_THRESHOLD, alpha: float = TYPICAL_ALPHA,
                   generator: torch.Generator | None = None) -> tuple[list[int], Tensor]:
    """Medusa's typical acceptance (LOSSY): a candidate passes when p(x) > min(threshold, alpha * exp(-H(p)))."""
    entropy_N1 = -(p_N1V * p_N1V.clamp(min=1e-12).log()).sum(-1)
    bar_N1 = torch.minimum(torch.full_like(entropy_N1, threshold), alpha * torch.exp(-entropy_N1))
    kids = tree.children()
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = -1
    while True:
        row = node + 1
        chosen = next((c for c in kids[row] if float(p_N1V[row, tokens[c]]) > float(bar_N1[row])), None)
        if chosen is None:
            break
        path.append(chosen)
        node = chosen
    bonus = sample(p_N1V[node + 1][None], generator)
    return path, torch.cat([tree.tokens[path], bonus]) if path else bonus


def refuse_repeated_sampled_siblings(tree: DraftTree) -> None:
    """Siblings drawn from draft probabilities with replacement (a token repeated under one parent) make
    multi-candidate rejection inexact (an exact enumeration finds the first token off by up to 0.5 in total variation
    on small vocabularies): refused. Deterministic candidates (top-k, n-grams) may repeat: a repeat is never accepted."""
    if tree.probs_NV is None or tree.is_chain or not tree.size:
        return
    if bool(_siblings_before(tree)[1].any()):
        raise ValueError(
            f"the drafter sampled sibling candidates with replacement (a token repeats under one parent: tokens "
            f"{tree.tokens.tolist()}, parents {tree.parents.tolist()}); lossless tree rejection needs siblings drawn "
            f"without replacement: draw them with torch.multinomial(q, k, replacement=False), or draft a chain")
