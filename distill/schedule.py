"""The learning-rate schedule: linear warmup, then cosine decay to a floor. A pure function of the step.

One definition for both training loops in this project: the drafter's (``train.loop.lr_at``) and the toy target's
pretraining (``distill.toy.pretrain``). It lives in ``distill`` so the toy target (distill) and the trainer (train,
a layer above) share it without distill importing train.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, peak: float, warmup_steps: int, decay_steps: int, floor_ratio: float) -> float:
    """The learning rate at 0-based ``step``: ``peak * (step + 1) / warmup_steps`` while warming up, then a cosine from
    ``peak`` down to ``peak * floor_ratio``, reached ``decay_steps`` steps after warmup and held from there on.

    The trainer decays over ``steps - warmup_steps`` (its last step lands just above the floor); the toy target over
    ``steps - 1 - warmup_steps`` (its last step lands on it). The arithmetic is kept exactly as both loops had it,
    so the learning rates, and therefore trained weights, are bit-identical to before they shared it.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
    floor = peak * floor_ratio
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
