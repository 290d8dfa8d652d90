"""One sequence stepped by hand: a one-row bucket of the decoder (``inference.batch_decoder``) prefilled, then each
step of its real loop called on its own (what the cost model, ``inference.cost``, times)."""

from __future__ import annotations

import torch
from torch import Tensor

from inference.batch_decoder import BucketDecoder
from inference.batch_steps import Bucket
from inference.proposer import Proposer
from inference.sampling import SamplingConfig
from inference.tree import DraftTree


class Session:
    """One sequence in a one-row bucket of a ``BucketDecoder``: prefilled at construction, then ``plain_step``, or
    ``draft`` (or ``load``) followed by ``verify``, each one step of the real loop on the moving context (what
    ``inference.cost`` times). The caller pins the attention backend (``StepRunner.pinned``) around it."""

    def __init__(self, dec: BucketDecoder, drafter: Proposer | None, prompt_ids: Tensor, max_new_tokens: int,
                 num_draft: int, sampling: SamplingConfig | None = None):
        self.dec, self.max_new = dec, max_new_tokens
        # ``max_new_tokens`` is room in the buffers, not a decode's length: the positions a sequence reaches are the
        # caller's to bound (the cost model starts over within a real decode's contexts)
        prompt = [prompt_ids[0].to(dtype=torch.long)]
        self.batch = dec._prefill(drafter, prompt, max_new_tokens, num_draft, sampling or dec.sampling)
        self.row = self.batch.live[0]
        self.new = self.row.new
        self._next: tuple | None = None
        self._width = dec._width_of(self.batch)

    def plain_step(self) -> int:
        """One plain step: the next token (read back)."""
        self._next = (Bucket(0, True, self._width(0)), None)
        self.verify()
        return self.new[-1]

    def draft(self, depth: int) -> None:
        """The drafter's proposal of at most ``depth`` for the next ``verify`` (its static step, or its eager one)."""
        self._next = self.dec._draft(self.batch, depth, len(self.new) + depth)

    def load(self, tree: DraftTree, num_draft: int | None = None) -> None:
        """Verify ``tree`` next instead of a drafted proposal (the cost model's random trees of a shape), a chain in
        the bucket of a decode drafting ``num_draft`` (default: this session's)."""
        gamma = num_draft or self.batch.num_draft
        self._next = self.dec._load(self.batch, [tree], gamma, self._width)

    def verify(self) -> tuple[list[int], list[int]]:
        """Verify the proposal: (accepted path, committed tokens); the drafter is handed the committed rows."""
        bucket, drafted = self._next
        self.dec._step(self.batch.state, bucket, self.batch.sampling)
        return self.dec._commit(self.batch, bucket, drafted)[0]
