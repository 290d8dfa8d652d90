"""Where a drafter's greedy output first parts from plain greedy decoding, and how far apart the target's logits
put the two tokens there.

In float32 a lossless decoder's greedy output equals plain greedy decoding token for token (every CPU test here).
In bf16 on a GPU it may not: the target's multi-token verification forward and its one-token plain step run
kernels of different shapes, whose rounding differs, so two nearly tied logits can swap order, and the greedy
continuations part from there. A real decoder bug looks different: the token it commits is not the target's
choice by a wide margin. So for each prompt whose output differs (the first ``MAX_KEPT`` of a run) this records
the first differing position and the target's logit gap there, read off one plain forward (no cache) over the
prompt and plain decoding's tokens up to that position: ``logit[expected] - logit[got]``, and that gap relative to
the larger of the two logits. A gap within a few units of the dtype's rounding (bf16 keeps 8 significant bits:
2^-8 ≈ 0.004 relative) is a near-tie; a gap of whole logits is a bug.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

MAX_KEPT = 5


@dataclass
class Mismatch:
    prompt: int  # index of the prompt in the evaluation
    position: int  # first new-token index where the outputs differ
    prefix: list[int]  # plain decoding's new tokens before ``position``
    expected: int | None  # plain decoding's token there (None: plain decoding stopped first)
    got: int | None  # the drafter's token there (None: the drafter's output stopped first)

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["prefix"]
        return out


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first token where ``got`` differs from ``ref`` (the shorter one's length when one is a prefix
    of the other); None when they are equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def mismatch(index: int, ref: list[int], got: list[int]) -> Mismatch | None:
    at = first_divergence(ref, got)
    if at is None:
        return None
    pick = lambda tokens: tokens[at] if at < len(tokens) else None
    return Mismatch(prompt=index, position=at, prefix=list(ref[:at]), expected=pick(ref), got=pick(got))


@torch.no_grad()
def logit_gap(model, prompt_ids: torch.Tensor, m: Mismatch) -> dict:
    """The target's logits at ``m``'s position, from one forward without a cache over the prompt and plain
    decoding's tokens before it: the gap between the expected and the committed token, absolute and relative,
    and the gap between the target's own top two there."""
    device = next(model.parameters()).device
    ids = torch.cat([prompt_ids.reshape(1, -1), torch.tensor([m.prefix], dtype=torch.long)], dim=1).to(device)
    logits = model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2).values
    out = {**m.to_dict(), "top2_gap": float(top[0] - top[1])}
    if m.expected is not None and m.got is not None:
        a, b = logits[m.expected], logits[m.got]
        out["logit_gap"] = float(a - b)
        out["relative_gap"] = float((a - b) / torch.maximum(a.abs(), b.abs()).clamp_min(1e-6))
    return out


def against_reference(model, prompts: list[torch.Tensor], reference: list[list[int]],
                      runs: dict[str, list[list[int]]]) -> dict:
    """Each run's outputs (``{method: [new tokens per prompt]}``, the first ``len(reference)`` prompts) against the
    reference outputs of the same prompts: per method how many are identical, and for each that is not, the first
    differing position and the target's logit gap there (``logit_gap``: ``logit_gap`` is the reference token's logit
    minus the method's, ``top2_gap`` the target's own top-1 minus top-2), with the largest absolute gap."""
    out = {}
    for name, outputs in runs.items():
        found = [m for i, (ref, got) in enumerate(zip(reference, outputs)) if (m := mismatch(i, ref, got)) is not None]
        gaps = [logit_gap(model, prompts[m.prompt], m) for m in found]
        out[name] = {"prompts": len(outputs), "identical": len(outputs) - len(found), "mismatches": gaps,
                     "max_abs_logit_gap": max((abs(g["logit_gap"]) for g in gaps if "logit_gap" in g), default=None)}
    return out
