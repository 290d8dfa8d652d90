"""DFlash2's drafting after the backbone forward: the selector's walk over each slot's top-K candidates, in the
capture-safe static step (``DFlash2StaticDraft``).

Which token each output predicts: as in ``heads.dflash`` (block slot k >= 1 at position a + k predicts token a + k);
slot k's scores read the token the walk took at slot k - 1 (slot 1: the anchor).

Sampled walks (temperature > 0) draw slot k's token from its candidates' scores warped as the target's logits are
(``inference.sampling.warp``: temperature, top-k, top-p); that distribution, zero outside the candidates, is the q
the exact acceptance rule needs, so decoding stays lossless.

Shapes: B rows, T drafted slots, K candidates per slot, D hidden size, V vocabulary, r selector rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.dflash.draft import DFlashStaticDraft
from inference.acceptance import sample_uniform
from inference.sampling import warp
from inference.static_draft import hashed_uniforms


def candidates(drafter, out_BTD: Tensor, head_rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(unary [B, T, K], candidate ids [B, T, K], projected states [B, T, r]) of the slots' states."""
    B, T, D = out_BTD.shape
    logits = drafter.draft_logits(out_BTD.reshape(B * T, D), head_rows)  # [B * T, V]
    unary, cand = logits.topk(drafter.selector_top_k, -1)
    sel = drafter.candidate_selector
    projected = sel.hidden_projection(out_BTD.to(sel.hidden_projection.weight.dtype))
    K = unary.shape[-1]
    return unary.view(B, T, K), cand.view(B, T, K), projected


class DFlash2StaticDraft(DFlashStaticDraft):
    """``StaticDraft`` for one ``heads.dflash2.DFlash2Drafter`` (batch 1): DFlash's catch-up and block, then the walk
    over the T slots' candidates, one slot after another over fixed shapes."""

    @torch.no_grad()
    def draft(self) -> None:
        d = self.drafter
        out, anchor = self.block_out()  # [T, D], []
        unary, cand, projected = candidates(d, out[None], self.head_rows)  # [1, T, K] ...
        greedy = self.sampling.greedy
        if not greedy:
            uniforms = hashed_uniforms(self.seed, self.counter, self.draws_T)
            self.counter.add_(1)
        prev = anchor.reshape(1)
        tokens, probs = [], []
        for k in range(self.depth):
            scores = d.candidate_selector.scores(prev, projected[:, k], cand[:, k], unary[:, k])  # [1, K]
            if greedy:
                pick = scores.argmax(-1)
            else:
                q = warp(scores, self.sampling)[0]  # [K]
                probs.append(torch.zeros(d.dims.vocab_size, device=q.device).scatter(0, cand[0, k], q))
                pick = sample_uniform(q, uniforms[k: k + 1])
            prev = cand[0, k].gather(0, pick.reshape(1))
            tokens.append(prev)
        self.buffers.tokens_T.copy_(torch.cat(tokens))
        if not greedy:
            self.buffers.probs_TV.copy_(torch.stack(probs))
