"""Turning logits into the distribution a token is drawn from — one function, applied identically to target and draft.

Speculative sampling is lossless only if the draft's q and the target's p are warped the same way: the decoder then
reproduces sampling from the *warped* target distribution (temperature, then top-k, then top-p), exactly what plain
sampling with the same settings draws from. Temperature 0 means greedy: every rule reduces to exact argmax match.

Shapes: logits_NV [N, V] -> probs_NV [N, V] (float32, rows sum to 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p; 1 keeps all
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"decoder.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"decoder.top_p must lie in (0, 1], got {self.top_p}; use 1.0 to disable nucleus sampling")
        if self.top_k < 0:
            raise ValueError(f"decoder.top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"temperature={self.temperature:g}, top_p={self.top_p:g}, top_k={self.top_k}"


GREEDY = SamplingConfig()


def warp(logits_NV: Tensor, cfg: SamplingConfig) -> Tensor:
    """Probabilities after temperature, top-k and top-p (in that order, as HF ``generate`` applies them).

    Greedy configs return the one-hot of the argmax, so a greedy drafter's "distribution" is a point mass.
    """
    logits_NV = logits_NV.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits_NV.argmax(-1), logits_NV.shape[-1]).float()
    logits_NV = logits_NV / cfg.temperature
    if 0 < cfg.top_k < logits_NV.shape[-1]:
        kth = logits_NV.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth, float("-inf"))
    probs_NV = logits_NV.softmax(-1)
    if cfg.top_p < 1:
        sorted_NV, order_NV = probs_NV.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (sorted_NV.cumsum(-1) - sorted_NV) >= cfg.top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order_NV, drop_sorted)
        probs_NV = probs_NV.masked_fill(drop, 0.0)
        probs_NV = probs_NV / probs_NV.sum(-1, keepdim=True)
    return probs_NV


def seeded_generator(current: torch.Generator | None, seed: int, device: torch.device) -> torch.Generator:
    """``current`` where it already lives on ``device``, else a new generator there seeded with ``seed``: a drafter's
    per-sequence sampler, made on the device its draws happen on."""
    if current is not None and current.device == device:
        return current
    return torch.Generator(device=device).manual_seed(seed)


def sample(probs_NV: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row: [N]."""
    return torch.multinomial(probs_NV, 1, generator=generator).squeeze(-1)
