"""Acceptance rules: pure functions of the draft (tokens, tree shape, draft probabilities) and the target's verdict.

Each rule decides the accepted draft nodes (one root-to-node path) and the tokens committed this step — the
accepted drafts plus one token from the target (the bonus, or the correction at the first rejection).

- Greedy (temperature 0): a node is accepted when its token is the target's argmax after its ancestors. The output
  is exactly plain greedy decoding of the target.
- Rejection sampling (Leviathan et al. 2023; Chen et al. 2023), for chains: accept draft x with probability
  min(1, p(x)/q(x)); at the first rejection draw the correction from norm(max(0, p − q)). Each committed token is
  then distributed exactly as p, the warped target distribution.
- Recursive rejection for trees (SpecInfer; "recursive speculative decoding" without replacement): at a node, try
  its children in order; reject child x → p ← norm(max(0, p − q)), q ← q with x removed, renormalised; the first
  accepted child becomes the next node; if none is accepted the bonus is drawn from the last residual p. A child
  chosen deterministically (top-k, n-gram) counts as a draw from the point mass on it, so the rule is
  "accept with p(x), else remove x from p". Both keep the committed token distributed exactly as p.
- Typical acceptance (Medusa): accept x when p(x) > min(ε, δ·exp(−H(p))). LOSSY: output is not distributed as the
  target's; it exists to compare with Medusa and is labelled lossy wherever it is reported.

Rows of ``p_N1V`` / ``argmax_N1``: row 0 is the target after the pending token, row 1 + i after draft node i.
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.sampling import sample
from inference.tree import DraftTree


# Medusa's typical acceptance: ε and δ of p(x) > min(ε, δ·exp(-H(p))), the values Medusa's paper and code use. The one
# place they are written: ``decoder.typical_threshold`` / ``decoder.typical_alpha`` default to these.
TYPICAL_THRESHOLD, TYPICAL_ALPHA = 0.09, 0.3


# --- the whole tree at once, on the device (the decoder's path: one transfer per step) -------------------------
#
# Every node is decided at once and the result left on the device (the host walks of the rules are the tests'
# readable references, tests/host_acceptance.py): ``on_path_N`` (the accepted nodes: one root-to-node path), ``last_1``
# (the target row after the path's last node: 0 = the pending token, 1 + i = node i) and ``bonus_1`` (the token the
# target commits there). ``settle`` packs them into one tensor the decoder reads back once.


def _last_row(on_path_N: Tensor) -> Tensor:
    """[1]: 1 + the deepest accepted node (the path's nodes are each other's ancestors: the largest index), or 0."""
    rank = on_path_N.long() * torch.arange(1, on_path_N.shape[0] + 1, device=on_path_N.device)
    return torch.cat([rank.new_zeros(1), rank]).amax(0, keepdim=True)


def _parent_rows(tree: DraftTree) -> Tensor:
    """[N]: the target row each node is judged against (its parent's; 0 = the pending token's), clamped into the
    tree when a parent does not precede its child (``settle`` reports that)."""
    idx = torch.arange(tree.size, device=tree.parents.device)
    return torch.minimum(tree.parents.clamp(min=-1), idx - 1) + 1


def _on_path(ancestors_NN: Tensor, chosen_N: Tensor) -> Tensor:
    """A node is accepted when it and every ancestor was chosen under its parent."""
    return ~(ancestors_NN & ~chosen_N[None, :]).any(1)


def _siblings_before(tree: DraftTree) -> tuple[Tensor, Tensor]:
    """(earlier_NN, duplicate_N): ``earlier[i, j]``: j is an earlier sibling of i; ``duplicate[i]``: an earlier
    sibling proposes the same token (the walk above never gets past the first of them)."""
    idx = torch.arange(tree.size, device=tree.tokens.device)
    earlier = (tree.parents[:, None] == tree.parents[None, :]) & (idx[None, :] < idx[:, None])
    return earlier, (earlier & (tree.tokens[:, None] == tree.tokens[None, :])).any(1)


def greedy_verdict(tree: DraftTree, target_argmax_N1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``tree_greedy_accept`` for the whole tree at once: a node is chosen when its token is the target's argmax
    after its parent (the first such sibling)."""
    if tree.is_chain:  # a prefix: node i is judged by row i (its parent's), and no node has siblings
        on_path = (tree.tokens == target_argmax_N1[: tree.size]).long().cumprod(0).bool()
        last = on_path.long().sum(0, keepdim=True)
        return on_path, last, target_argmax_N1.index_select(0, last)
    _, ancestors = tree.geometry
    _, duplicate = _siblings_before(tree)
    chosen = (tree.tokens == target_argmax_N1[_parent_rows(tree)]) & ~duplicate
    on_path = _on_path(ancestors, chosen)
    last = _last_row(on_path)
    return on_path, last, target_argmax_N1.index_select(0, last)


def rejection_verdict(tree: DraftTree, p_N1V: Tensor, generator: torch.Generator | None = None,
                      uniforms: Tensor | None = None, valid_N: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``tree_rejection_accept`` for the whole tree at once, for point-mass candidates (``probs_NV`` None) and for
    chains with draft probabilities. Point masses: under its parent, child c (siblings tried in order) is accepted
    with probability p(x_c) / (1 - sum of p over the distinct earlier siblings' tokens), the residual the walk would
    have reached; a duplicate of an earlier sibling has probability 0. Every node draws its own uniform (those
    below a rejected node go unused), so the committed tokens are distributed exactly as the walk's.

    ``uniforms`` [N + 1]: the draws to use instead of the generator's (N for the nodes, the last for the bonus, taken
    by inverse CDF): a recorded step reads them from a buffer filled before each replay. ``valid_N``: False for the
    padding nodes of a fixed-width step, which are never accepted and never remove their token from a residual."""
    if tree.probs_NV is not None and not tree.is_chain:
        raise ValueError("rejection_verdict takes point-mass trees or chains; use tree_rejection_accept")
    N, dev = tree.size, p_N1V.device
    if p_N1V.shape[0] != N + 1:
        raise ValueError(f"target distributions have {p_N1V.shape[0]} rows for a tree of {N}; expected {N + 1}")
    tokens = tree.tokens.clamp(0, p_N1V.shape[1] - 1)  # out-of-range drafts are reported by ``settle``
    p_x = p_N1V[_parent_rows(tree), tokens]  # each candidate's probability under its parent's row
    if tree.probs_NV is not None:  # a chain drawn from q (Leviathan / Chen), same draws as chain_rejection_accept
        q_x = tree.probs_NV[torch.arange(N, device=dev), tokens]
        accept = (p_x / q_x).clamp(max=1)
        q_pad = torch.cat([tree.probs_NV, p_N1V.new_zeros(1, p_N1V.shape[1])])
    else:
        earlier, duplicate = _siblings_before(tree)
        removed = ((earlier & ~duplicate[None, :]).to(p_x.dtype) * p_x[None, :]).sum(1)
        accept = torch.where(duplicate, 0.0, p_x / (1 - removed).clamp(min=torch.finfo(p_x.dtype).tiny)).clamp(max=1)
    u = torch.rand(N, generator=generator, device=dev) if uniforms is None else uniforms[:N]
    taken = u < accept
    if valid_N is not None:
        taken = taken & valid_N
    if tree.is_chain:
        on_path = taken.long().cumprod(0).bool()
    else:
        earlier, _ = _siblings_before(tree)
        on_path = _on_path(tree.geometry[1], taken & ~(earlier & taken[None, :]).any(1))
    last = _last_row(on_path)
    p_row = p_N1V.index_select(0, last)[0]
    if tree.probs_NV is not None:  # norm(max(0, p - q)) at the first rejection; q = 0 past the chain's end
        residual = (p_row - q_pad.index_select(0, last)[0]).clamp(min=0)
    else:  # every child of the last node was rejected: remove their tokens
        rejected = _parent_rows(tree) == last
        rejected = (rejected if valid_N is None else rejected & valid_N).to(p_row.dtype)
        dropped = p_row.new_zeros(p_row.shape).index_add_(0, tokens, rejected) > 0
        residual = p_row.masked_fill(dropped, 0)
    total = residual.sum()
    # Zero only through float rounding (a rejection of probability 0): keep p.
    residual = torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny), p_row)
    if uniforms is not None:
        return on_path, last, sample_uniform(residual, uniforms[N:])
    return on_path, last, sample(residual[None], generator)


def typical_verdict(tree: DraftTree, p_N1V: Tensor, threshold: float, alpha: float, uniforms: Tensor,
                    valid_N: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``typical_accept`` (Medusa's rule, LOSSY) for the whole tree at once: under its parent, the first child whose
    token passes p(x) > min(threshold, alpha·exp(-H(p))) is chosen; the bonus is drawn from p after the path's last
    node by inverse CDF on ``uniforms[N]``."""
    N = tree.size
    entropy = -(p_N1V * p_N1V.clamp(min=1e-12).log()).sum(-1)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    rows = _parent_rows(tree)
    passed = p_N1V[rows, tree.tokens.clamp(0, p_N1V.shape[1] - 1)] > bar[rows]
    if valid_N is not None:
        passed = passed & valid_N
    if tree.is_chain:
        on_path = passed.long().cumprod(0).bool()
    else:
        earlier, _ = _siblings_before(tree)
        on_path = _on_path(tree.geometry[1], passed & ~(earlier & passed[None, :]).any(1))
    last = _last_row(on_path)
    return on_path, last, sample_uniform(p_N1V.index_select(0, last)[0], uniforms[N:])


def sample_uniform(probs_V: Tensor, u_1: Tensor) -> Tensor:
    """[1]: the token whose cumulative probability first exceeds ``u_1 · total`` (inverse CDF; a zero-probability
    token is never drawn): sampling from a uniform drawn beforehand, so a recorded step draws nothing itself. Rows
    at once: ``probs_RV`` with ``u_R1`` gives [R, 1]."""
    cdf = probs_V.cumsum(-1)
    return (cdf <= u_1 * cdf[..., -1:]).sum(-1, keepdim=True).clamp(max=probs_V.shape[-1] - 1)


def settle(tree: DraftTree, on_path_N: Tensor, last_1: Tensor, bonus_1: Tensor, vocab_size: int,
           valid_N: Tensor | None = None) -> Tensor:
    """One long tensor for the decoder to read back: [accepted count a, tree depth, malformed flags,
    path (N slots, the first a used), committed tokens (N + 1 slots, the first a + 1 used)]. Malformed: 1 when a
    draft lies outside the vocabulary, 2 when a parent does not precede its child (``DraftTree.check``'s errors).
    ``valid_N``: False for a fixed-width step's padding nodes (token -1), which are not checked."""
    N, dev = tree.size, tree.tokens.device
    idx = torch.arange(N, device=dev)
    count = on_path_N.long().sum(0, keepdim=True)
    bad_N = (tree.tokens < 0) | (tree.tokens >= vocab_size)
    bad_tokens = (bad_N if valid_N is None else bad_N & valid_N).any(0, keepdim=True).long()
    if tree.is_chain:  # the accepted nodes are a prefix; depth N; parents are 0 .. N - 2 by construction
        path = torch.where(idx < count, idx, max(N - 1, 0))
        depth, flags = count.new_full((1,), N), bad_tokens
    else:
        path = torch.sort(torch.where(on_path_N, idx, N + idx)).values.clamp(max=max(N - 1, 0))  # accepted first
        depth = tree.geometry[0].amax(0, keepdim=True) if N else count.new_zeros(1)
        flags = bad_tokens + 2 * tree.bad_parents().long().view(1)
    committed = torch.cat([tree.tokens[path], bonus_1.new_zeros(1)]).scatter(0, count, bonus_1.long())
    return torch.cat([count, depth.long(), flags, path, committed])
