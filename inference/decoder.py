"""Greedy chain speculative decoding for any Hugging Face causal LM, plus plain greedy through the same cache path.

One step: the drafter proposes k tokens continuing the committed sequence; the target runs ONE forward over
[pending token, draft_1..draft_k] on top of its KV cache; ``greedy_accept`` keeps the agreeing prefix and the
target's own next token (the bonus); the cache is cropped back to exactly the kept entries, so the next step starts
from the same state plain greedy decoding would have.

Shapes: the sequence is a single prompt (batch 1): ``tokens`` [1, n]; the pending token is the last committed
token, predicted by the target but not yet fed to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from eval.metrics import AcceptStats
from inference.acceptance import greedy_accept


@dataclass
class Generation:
    new_tokens: list[int]
    seconds: float
    stats: AcceptStats = field(default_factory=AcceptStats)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


def _check_prompt(prompt_ids: Tensor, max_new_tokens: int, lookahead: int, max_positions: int) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must have shape [1, n], got {tuple(prompt_ids.shape)}")
    if prompt_ids.shape[1] == 0:
        raise ValueError("empty prompt: give at least one token")
    needed = prompt_ids.shape[1] + max_new_tokens + lookahead
    if max_positions and needed > max_positions:
        raise ValueError(
            f"prompt of {prompt_ids.shape[1]} tokens + max_new_tokens={max_new_tokens} + {lookahead} draft tokens "
            f"needs {needed} positions, more than the target's max_position_embeddings={max_positions}; "
            f"shorten the prompt (eval.prompt_tokens) or lower eval.max_new_tokens"
        )


class Decoder:
    """Decodes with a frozen target (a ``distill.teacher.Teacher``) and, optionally, a drafter."""

    def __init__(self, teacher, eos_token_id: int | None = None):
        self.teacher = teacher
        self.model = teacher.model
        self.eos_token_id = eos_token_id

    def _forward(self, input_ids: Tensor, cache: DynamicCache, layers: tuple[int, ...]):
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, output_hidden_states=bool(layers))
        hidden = {i: out.hidden_states[self.teacher.resolve_layer(i)] for i in layers}
        return out.logits[0].argmax(-1), hidden  # [m], {layer: [1, m, D]}

    def _finish(self, committed: list[int]) -> list[int]:
        if self.eos_token_id is not None and self.eos_token_id in committed:
            return committed[: committed.index(self.eos_token_id) + 1]
        return committed

    @torch.no_grad()
    def greedy(self, prompt_ids: Tensor, max_new_tokens: int) -> Generation:
        """Plain autoregressive greedy decoding: one target forward per token, same cache path as speculation."""
        _check_prompt(prompt_ids, max_new_tokens, 0, self.teacher.max_positions)
        start = time.perf_counter()
        cache = DynamicCache()
        next_ids, _ = self._forward(prompt_ids.to(self.teacher.device), cache, ())
        out = [int(next_ids[-1])]
        while len(out) < max_new_tokens and out[-1] != self.eos_token_id:
            next_ids, _ = self._forward(next_ids[-1:].view(1, 1), cache, ())
            out.append(int(next_ids[-1]))
        return Generation(new_tokens=self._finish(out), seconds=time.perf_counter() - start)

    @torch.no_grad()
    def speculative(self, drafter, prompt_ids: Tensor, max_new_tokens: int, num_draft: int) -> Generation:
        """Greedy speculative decoding; token-identical to ``greedy`` by construction of ``greedy_accept``."""
        _check_prompt(prompt_ids, max_new_tokens, num_draft, self.teacher.max_positions)
        layers = tuple(drafter.teacher_layers)
        device = self.teacher.device
        gen = Generation(new_tokens=[], seconds=0.0)
        start = time.perf_counter()
        cache = DynamicCache()
        drafter.reset()
        next_ids, hidden = self._forward(prompt_ids.to(device), cache, layers)
        drafter.observe(hidden)
        tokens = torch.cat([prompt_ids.to(device), next_ids[-1:].view(1, 1)], dim=1)
        committed = [int(next_ids[-1])]
        while len(committed) < max_new_tokens and committed[-1] != self.eos_token_id:
            t0 = time.perf_counter()
            draft = drafter.propose(tokens, min(num_draft, max_new_tokens - len(committed))).to(device)
            t1 = time.perf_counter()
            verify_in = torch.cat([tokens[:, -1], draft]).view(1, -1)
            target_ids, hidden = self._forward(verify_in, cache, layers)
            accepted, new = greedy_accept(draft, target_ids)
            # The forward cached k + 1 entries; keep the pending token's and the accepted drafts' (a + 1).
            cache.crop(-(draft.shape[0] - accepted))
            gen.verify_seconds += time.perf_counter() - t1
            gen.draft_seconds += t1 - t0
            gen.stats.update(draft.shape[0], accepted)
            drafter.observe({i: h[:, : accepted + 1] for i, h in hidden.items()})
            tokens = torch.cat([tokens, new.view(1, -1)], dim=1)
            committed.extend(int(t) for t in new)
        gen.new_tokens = self._finish(committed[:max_new_tokens])
        gen.seconds = time.perf_counter() - start
        return gen
