"""DFlash2: DFlash's one-pass block drafter with dynamic block convolutions in every draft layer and a low-rank path
selector over each slot's top candidates.

Which token each output predicts: as in ``heads.dflash`` (block slot k >= 1 at position a + k predicts token a + k;
the anchor a is the last verified token). The backbone is still one non-causal forward over the block; only the
selector walks it slot by slot, and verification is still a chain.

Shape legend:  as ``heads.dflash``, plus K the selector's candidates per slot (``selector_top_k``), r its rank.
    backbone   DFlash's layers, each sublayer wrapped in ``heads.dflash2.conv.BlockConv``    -> out_k  [D]
    unary      u_k = lm_head(out_k) over the whole vocabulary; candidates c_k = top-K(u_k)           [K]
    selector   score_k(b | a) = u_k(b) + <P[a] ⊙ W h_k, Q[b]>   (a: the token at slot k - 1, b in c_k)  [K]
               P = ``predecessor_codebook`` [V, r], Q = ``successor_codebook`` [V, r], W = ``hidden_projection``
               (D -> r), h_k = out_k. W starts at zero: an untrained selector picks DFlash's top-1.
    walk       x_0 = the anchor; x_k = the best candidate of slot k given x_{k-1} (greedy), or a draw from
               softmax(score_k(· | x_{k-1}) / temperature) over c_k (sampled: that distribution, zero outside c_k,
               is the draft's q, so the exact acceptance rule stays lossless).

Training: DFlash's loss (``objective``, the slot decay) trains the backbone and with it each slot's candidate list.
The selector's term is a K-way cross-entropy at every trained slot: the scores of the slot's unary top-K (the target's
token put in place of the last candidate where the list misses it) given the target's token at the slot before (the
path a walk takes while every earlier slot is right; slot 1: the anchor), towards the target's token; slot-decayed as
the unary loss, scaled by ``selector_weight`` and ramped in linearly over ``selector_warmup_steps``. The selector
reads the backbone's states and the unary logits detached: its term trains the selector alone, so the unary loss
trains the same backbone with or without it. The published DFlash2 specifies inference only; this objective is the
one the public trainers (speculators, SpecForge, NeMo AutoModel) describe.

The candidates are target ids (the codebooks are indexed by them): the selector needs the full vocabulary, and a
reduced one (``draft_vocab_size``) is refused. Parameter names follow the published checkpoints
(``layers.{i}.attention_conv.base_kernel``, ``candidate_selector.hidden_projection`` ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill.chunked import Frozen
from distill.teacher_output import TeacherOutput
from heads import flops
from heads.base import DraftOutput, TargetDims
from heads.dflash.model import DFlashDrafter
from heads.dflash2.conv import DFlash2Layer
from heads.dflash2.draft import DFlash2StaticDraft
from inference.sampling import SamplingConfig

_CANDIDATE_ROWS = 4096  # rows of a slot's unary logits made at once while training (the full vocabulary each)


class CandidateSelector(nn.Module):
    """The pairwise path selector: two codebooks over target ids and a projection of the slot's state."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.predecessor_codebook.weight, std=rank ** -0.5)
        nn.init.normal_(self.successor_codebook.weight, std=rank ** -0.5)
        nn.init.zeros_(self.hidden_projection.weight)

    def scores(self, prev_N: Tensor, projected_Nr: Tensor, cand_NK: Tensor, unary_NK: Tensor) -> Tensor:
        """[N, K] the candidates' scores given the previous tokens ``prev_N`` and the slots' projected states."""
        weight = self.predecessor_codebook.weight
        query = self.predecessor_codebook(prev_N.to(weight.device)) * projected_Nr.to(weight.dtype)  # [N, r]
        pair = (self.successor_codebook(cand_NK) * query[:, None]).sum(-1)  # [N, K]
        return unary_NK.float() + pair.float()


class DFlash2Drafter(DFlashDrafter):
    name = "dflash2"
    decode_keys = ("depth",)

    def __init__(self, dims: TargetDims | Mapping[str, int], conv: bool = True, conv_kernel_size: int = 2,
                 conv_group_size: int = 16, selector: bool = True, selector_top_k: int = 16, selector_rank: int = 256,
                 selector_weight: float = 1.0, selector_warmup_steps: int = 0, **dflash: Any):
        if selector and dflash.get("draft_vocab_size") is not None:
            raise ValueError(f"drafter.draft_vocab_size={dflash['draft_vocab_size']}: DFlash2's selector picks its "
                             f"candidates among the target's ids over the whole vocabulary (its codebooks are "
                             f"indexed by them); set drafter.draft_vocab_size=null, or drafter.selector=false")
        super().__init__(dims, **dflash)
        D, V, S = self.dims.hidden_size, self.dims.vocab_size, self.block_size
        if selector and not 1 <= selector_top_k <= V:
            raise ValueError(f"drafter.selector_top_k={selector_top_k} must be in 1..vocab_size={V}")
        if selector and selector_rank < 1:
            raise ValueError(f"drafter.selector_rank={selector_rank} must be >= 1")
        if selector_weight < 0:
            raise ValueError(f"drafter.selector_weight={selector_weight} must be >= 0")
        if selector_warmup_steps < 0:
            raise ValueError(f"drafter.selector_warmup_steps={selector_warmup_steps} must be >= 0 (0: no ramp)")
        self.conv = bool(conv)
        if self.conv:  # DFlash's layers, each sublayer wrapped in its block convolutions
            self.layers = nn.ModuleList([
                DFlash2Layer(D, layer.self_attn.h, layer.self_attn.g, layer.self_attn.hd,
                             layer.mlp.gate_proj.out_features, layer.input_layernorm.eps, layer.self_attn.theta, S,
                             conv_kernel_size, conv_group_size) for layer in self.layers])
        self.selector_top_k = selector_top_k
        self.candidate_selector = CandidateSelector(V, D, selector_rank) if selector else None
        self.selector_weight = float(selector_weight)
        self.selector_warmup_steps = int(selector_warmup_steps)
        # the warm-up factor of this step (``begin_step``): a tensor, so a compiled step reads it without recompiling
        self.register_buffer("_selector_ramp", torch.ones(()), persistent=False)

    # --- training ------------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        warm = self.selector_warmup_steps
        self._selector_ramp.fill_(min(1.0, (step + 1) / warm) if warm else 1.0)

    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        out, pos_BNS, drawn = self.train_blocks(batch, teacher_out)
        terms = self.block_terms(out, Frozen(self._frozen["lm_head"]), pos_BNS, drawn, batch, teacher_out)
        result = DraftOutput(terms=terms, num_valid=drawn.sum()).evaluate(loss_fn)
        if self.candidate_selector is not None and self.selector_weight > 0:
            anchors = batch["input_ids"].gather(1, pos_BNS[..., 0]).reshape(-1)
            result.aux_loss_sum = self.selector_weight * self._selector_ramp * self.selector_loss(terms, anchors)
        return result

    def selector_loss(self, terms, anchors_N: Tensor) -> Tensor:
        """Σ over slots k >= 1 and trained rows of the slot weight x the K-way cross-entropy of the selector's scores
        towards the target's token (module docstring). ``terms``: the block's token terms (slot k's states, rows,
        weight and the target's token at each row: its argmax over the whole vocabulary); ``anchors_N``: each row's
        anchor token, slot 1's predecessor."""
        sel = self.candidate_selector
        prev, total = anchors_N, anchors_N.new_zeros((), dtype=torch.float32)
        for term in terms:
            gold, state = term.label_N, term.student_ND.detach()
            unary, cand, label = self.training_candidates(state, gold)
            projected = sel.hidden_projection(state.to(sel.hidden_projection.weight.dtype))
            scores = sel.scores(prev, projected, cand, unary)
            ce = F.cross_entropy(scores, label, reduction="none")
            total = total + term.weight * (ce * term.weight_N).sum()
            prev = gold
        return total

    @torch.no_grad()
    def training_candidates(self, state_ND: Tensor, gold_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(unary [N, K], candidates [N, K], label [N]): each row's top-K unary logits and ids, the target's token in
        place of the last candidate where the list misses it, and the gold token's index in the list."""
        units, cands = [], []
        for i in range(0, state_ND.shape[0], _CANDIDATE_ROWS):
            logits = self._logits(state_ND[i: i + _CANDIDATE_ROWS])  # [n, V]
            unary, cand = logits.topk(self.selector_top_k, -1)
            gold = gold_N[i: i + _CANDIDATE_ROWS]
            missing = ~(cand == gold[:, None]).any(-1)
            cand[:, -1] = torch.where(missing, gold, cand[:, -1])
            unary[:, -1] = torch.where(missing, logits.gather(1, gold[:, None])[:, 0], unary[:, -1])
            units.append(unary)
            cands.append(cand)
        unary, cand = torch.cat(units), torch.cat(cands)
        label = (cand == gold_N[:, None]).int().argmax(-1)
        return unary, cand, label

    def train_flops(self, target, B: int, T: int):
        return flops.dflash2(self, target, B, T)

    def saved_config(self, drafter_cfg: Mapping[str, Any]) -> dict:
        node = super().saved_config(drafter_cfg)
        node["conv"], node["selector"] = self.conv, self.candidate_selector is not None
        if self.conv:
            conv = self.layers[0].attention_conv
            node["conv_kernel_size"], node["conv_group_size"] = conv.kernel_size, conv.group_size
        if self.candidate_selector is not None:
            node["selector_top_k"] = self.selector_top_k
            node["selector_rank"] = self.candidate_selector.hidden_projection.out_features
        return node

    # --- decoding ------------------------------------------------------------------------------------------
    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        if self.candidate_selector is None:
            return super().static_draft(committed, capacity, sampling, generator)
        rows = committed.ids_M.shape[0]
        depth = min(self.depth or self.block_size - 1, rows - 1, self.block_size - 1)
        return self.reuse_static_draft((depth, self.fc.weight.dtype), committed, capacity, sampling, generator,
                                       lambda: DFlash2StaticDraft(self, committed, capacity, depth, sampling,
                                                                  generator))
