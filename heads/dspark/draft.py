"""DSpark's decoding after the backbone forward: the slot-by-slot Markov chain and the confidence cut, in the
capture-safe static step (``DSparkStaticDraft``).

Which token each output predicts: as in ``heads.dflash`` (block slot k >= 1 at position a + k predicts token a + k);
slot k's Markov bias reads the token drafted at slot k - 1 (slot 1: the anchor).

Shapes: B rows, T drafted slots, D hidden size, V vocabulary, r Markov rank.
"""

from __future__ import annotations

import torch

from heads.dflash.draft import DFlashStaticDraft
from inference.acceptance import sample_uniform
from inference.sampling import SamplingConfig, warp
from inference.static_draft import hashed_uniforms, mark_static


class DSparkStaticDraft(DFlashStaticDraft):
    """``StaticDraft`` for one ``heads.dspark.DSparkDrafter`` (batch 1): DFlash's catch-up and block, then the T slots
    one after another over fixed shapes. The confidence cut writes the number of slots it keeps into ``kept``,
    which the step decoder reads back to verify the chain bucket of that length, filled with the drafted tokens;
    ``offered`` (a device counter, read by the caller when it wants it, never per step) sums the slots kept."""

    def __init__(self, drafter, committed, capacity: int, depth: int, sampling: SamplingConfig,
                 generator: torch.Generator | None):
        super().__init__(drafter, committed, capacity, depth, sampling, generator)
        self.markov_rows = drafter.markov_rows()
        self.offered = torch.zeros((), dtype=torch.long, device=self.length.device)
        # with the cut: the slots the cut keeps this step, which the decoder reads back to pick the verify bucket
        # (the one read-back between a cutting draft and its verification); None: the fixed block
        cut = drafter.confidence_threshold is not None
        self.kept = torch.zeros((), dtype=torch.long, device=self.length.device) if cut else None
        mark_static(self.offered, *([self.kept] if cut else []),
                    *([self.markov_rows] if self.markov_rows is not None else []))

    @torch.no_grad()
    def draft(self) -> None:
        d = self.drafter
        out, anchor = self.block_out()  # [T, D], []
        greedy = self.sampling.greedy
        if not greedy:
            uniforms = hashed_uniforms(self.seed, self.counter, self.draws_T)
            self.counter.add_(1)
        prev = anchor.reshape(1)
        tokens, probs = [], []
        for k in range(self.depth):
            latent = d.latent(prev, out)
            logits = d.slot_logits(out[k: k + 1], latent, self.head_rows, self.markov_rows)  # [1, V]
            if greedy:
                prev = logits.argmax(-1)
            else:
                p = warp(logits, self.sampling)
                probs.append(p[0])
                prev = sample_uniform(p[0], uniforms[k: k + 1])
            tokens.append(prev)
        drafted = torch.cat(tokens)  # [T]
        probs_TV = None if greedy else torch.stack(probs)
        if d.confidence_threshold is not None:  # every slot's confidence at once, from the tokens before each
            before = torch.cat([anchor.reshape(1), drafted[:-1]])
            confidence = torch.sigmoid(d.confidence(out[: self.depth], d.latent(before, out)).float()).reshape(-1)
            keep = confidence.cumprod(0) >= d.confidence_threshold  # [T], a prefix
            self.kept.copy_(keep.sum())
            self.offered.add_(self.kept)
        else:
            self.offered.add_(self.depth)
        self.buffers.tokens_T.copy_(drafted)
        if probs_TV is not None:
            self.buffers.probs_TV.copy_(probs_TV)
