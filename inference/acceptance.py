"""Acceptance rules: pure functions of the draft tokens and the target's verdict on them.

Greedy (temperature 0): a draft token is accepted while it equals the target's argmax at its position; the first
mismatch, or the position after the last draft token, contributes the target's own token (the bonus). The output
is therefore exactly what plain greedy decoding of the target would produce.
"""

from __future__ import annotations

from torch import Tensor


def greedy_accept(draft_K: Tensor, target_argmax_K1: Tensor) -> tuple[int, Tensor]:
    """Return (number of accepted draft tokens a, committed tokens = draft[:a] + [target_argmax[a]]).

    ``target_argmax_K1[j]`` is the target's greedy token after the context plus ``draft_K[:j]``; it has one more
    entry than the draft, the token that follows a fully accepted draft.
    """
    K = draft_K.shape[0]
    if target_argmax_K1.shape[0] != K + 1:
        raise ValueError(f"target verdict has {target_argmax_K1.shape[0]} tokens for a draft of {K}; expected {K + 1}")
    mismatch = (draft_K != target_argmax_K1[:K]).nonzero()
    accepted = int(mismatch[0]) if mismatch.numel() else K
    return accepted, target_argmax_K1[: accepted + 1]
