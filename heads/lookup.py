"""Prompt lookup (n-gram) drafting: no weights, no training; the baseline every report shows.

Which token each output predicts: if the last n tokens (n from ``max_ngram`` down to ``min_ngram``) occurred
earlier in the sequence, the tokens that followed that earlier occurrence are proposed as the next tokens. Of
several occurrences, ``match="recent"`` (the default) takes the most recent one that is followed by a full draft
(recent text is the best guess); if none is, the earliest (the longest continuation: in a repeating pattern the
most recent match is followed by only one token). ``match="earliest"`` always takes the earliest occurrence, as
vLLM's ``ngram`` method does (``vllm/v1/spec_decode/ngram_proposer.py``,
``_find_longest_matched_ngram_and_propose_tokens``), so its served acceptance can be reproduced here.

Shapes: tokens [1, n] -> a chain of k tokens, 0 <= k <= max_depth (empty when nothing matches: a plain decode step).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from heads.base import DraftOutput, Drafter, TargetDims
from inference.sampling import GREEDY, SamplingConfig
from inference.tree import DraftTree


MATCHES = ("recent", "earliest")  # which earlier occurrence of the final n-gram is followed (module docstring)


class PromptLookup(Drafter):
    name = "lookup"

    def __init__(self, dims: TargetDims | Mapping[str, int], max_ngram: int = 3, min_ngram: int = 1,
                 match: str = "recent"):
        super().__init__(dims)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"drafter.min_ngram and drafter.max_ngram need 1 <= min <= max, got {min_ngram}, {max_ngram}")
        if match not in MATCHES:
            raise ValueError(f"drafter.match={match!r}; valid: {list(MATCHES)} (earliest: vLLM's ngram rule)")
        self.max_ngram, self.min_ngram, self.match = max_ngram, min_ngram, match
        self.reset()

    def forward(self, batch, teacher_out) -> DraftOutput:
        raise TypeError("drafter=lookup has nothing to train; run `python -m eval drafter=lookup` instead")

    def reset(self, seed: int = 0) -> None:
        self._host: list[int] | None = None  # the ids of the last proposal's context, on the host
        self._extended = False  # ``accepted`` appended the step's committed tokens: _host is the next context

    def accepted(self, path: list[int], committed: list[int] | None = None) -> None:
        # The decoder hands the committed tokens over on the host: the next context is the last one + them, so the
        # next proposal reads nothing back from the device.
        self._extended = self._host is not None and committed is not None
        if self._extended:
            self._host.extend(committed)

    @torch.no_grad()
    def propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
        # Candidates are copied, not drawn: probabilities None (point masses), lossless under sampling too.
        return DraftTree.chain(self._lookup(tokens, max_depth))

    def _lookup(self, tokens: Tensor, max_tokens: int) -> Tensor:
        seq = tokens[0]
        # The search is sequential and data-dependent: done on the host, so a step costs at most one read-back of
        # the ids instead of a sync per n-gram size, and none after ``accepted`` handed the committed tokens over;
        # the draft itself is a slice of the device tensor.
        if not (self._extended and len(self._host) == seq.shape[0]):
            self._host = seq.tolist()
        self._extended = False
        ids = self._host
        n_tokens = len(ids)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            # Every window of length n that ends before the final n-gram itself.
            tail = ids[-n:]
            starts = [i + n for i in range(n_tokens - n) if ids[i] == tail[0] and ids[i: i + n] == tail]
            if starts:
                full = [s for s in starts if s + max_tokens <= n_tokens] if self.match == "recent" else []
                start = full[-1] if full else starts[0]
                return seq[start: start + max_tokens]
        return seq.new_empty(0)
