"""DSpark: DFlash's block drafter plus a Markov head (a low-rank learned bigram bias) and a confidence head.

Which token each output predicts: as in ``heads.dflash`` (block slot k >= 1 at position a + k predicts token a + k;
the anchor a is the last verified token). The Markov head makes the block semi-autoregressive: slot k's logits get a
bias from the token at a + k - 1 (slot 1: the anchor; slot k >= 2: the token drafted at slot k - 1), a cheap loop over
the block after the one backbone forward.

Shape legend:  as ``heads.dflash``, plus r the Markov rank, Vd the drafted ids (``draft_vocab_size``, else V).
    backbone   out_k = DFlash's normed state of block slot k                                [D]
    Markov     e_k = markov_w1[x_{k-1}]                       (an embedding of target ids)  [r]
               logits_k = lm_head(out_k) + markov_w2(e_k)     (r -> V, no bias)             [V]
    confidence c_k = sigmoid(proj([out_k ; e_k]))             ([out_k] without the Markov latent)  []
Training is teacher-forced: x_{k-1} is the training token at a + k - 1. The confidence head is trained with binary
cross-entropy towards ``confidence_target``: ``greedy`` (the default), whether the slot's draft (its argmax) is the
target's token, the greedy acceptance observed on the training block; ``tv``, 1 - TV(q, p) = Σ_v min(p_v, q_v)
between the slot's draft distribution q and the target's p (temperature 1, detached), the probability that
speculative sampling accepts the slot's sampled draft (a soft label; one projection pass more per slot). Both losses
keep DFlash's slot decay exp(-(k - 1) / gamma); the confidence loss is scaled by ``confidence_weight``.

Decoding drafts slot by slot after the backbone: slot k's bias reads the token just drafted at k - 1. With
``confidence_threshold`` the block is cut where the running product c_1 ... c_k (the predicted chance that every
draft up to slot k is accepted) falls below it: the slots from there on are not offered for verification (an
empty draft is a plain step). Null: the fixed block. Sampled drafts are drawn from the biased, warped distribution
of their slot given the previous draft, which is the q the exact acceptance rule needs: lossless either way.

Parameter names follow the speculators DSpark checkpoints (``markov_head.markov_w1``, ``markov_head.markov_w2``,
``confidence_head.proj``), so an export renames nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill.chunked import Frozen, TeacherRows, chunked_acceptance
from distill.teacher_output import TeacherOutput
from heads.base import DraftOutput, DraftTerm, TargetDims
from heads.dflash.model import DFlashDrafter
from heads.dspark.draft import DSparkStaticDraft
from inference.sampling import SamplingConfig


class MarkovHead(nn.Module):
    """The low-rank bigram bias: an embedding of the previous token (``markov_w1``, [V, r]) projected to the
    vocabulary (``markov_w2``, [V, r]). ``markov_w2`` starts at zero, so training starts from DFlash's logits."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=rank ** -0.5)
        nn.init.zeros_(self.markov_w2.weight)


class ConfidenceHead(nn.Module):
    """One linear map of a slot's features to the logit of its acceptance."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).squeeze(-1)


class MarkovLogits(nn.Module):
    """A training term's vocabulary projection over [out ; e] rows: the frozen lm_head of the state plus the Markov
    bias of the latent. A module holding ``markov_w2`` (not the lm_head): the chunked loss differentiates its
    parameters."""

    def __init__(self, lm_head: nn.Module, markov: MarkovHead, hidden_size: int):
        super().__init__()
        self.markov_w2 = markov.markov_w2
        self.lm_head, self.D = Frozen(lm_head), hidden_size  # a plain attribute: never a parameter here

    def forward(self, x_NX: Tensor) -> Tensor:
        return self.lm_head(x_NX[:, : self.D]) + self.markov_w2(x_NX[:, self.D:])


CONFIDENCE_TARGETS = ("greedy", "tv")  # what the confidence head's BCE is trained towards (module docstring)


class DSparkDrafter(DFlashDrafter):
    name = "dspark"
    decode_keys = ("depth", "confidence_threshold")

    def __init__(self, dims: TargetDims | Mapping[str, int], markov_rank: int = 256, confidence_head: bool = True,
                 confidence_with_markov: bool = True, confidence_weight: float = 1.0,
                 confidence_threshold: float | None = None, confidence_target: str = "greedy", **dflash: Any):
        super().__init__(dims, **dflash)
        if confidence_target not in CONFIDENCE_TARGETS:
            raise ValueError(f"drafter.confidence_target={confidence_target!r} is not known; valid: "
                             f"{list(CONFIDENCE_TARGETS)} (greedy: whether the slot's argmax is the target's token; "
                             f"tv: 1 - TV(q, p), the sampled draft's acceptance probability)")
        if markov_rank < 0:
            raise ValueError(f"drafter.markov_rank={markov_rank} must be >= 0 (0: no Markov head)")
        if confidence_with_markov and confidence_head and markov_rank == 0:
            raise ValueError("drafter.confidence_with_markov=true needs a Markov head (drafter.markov_rank > 0); set "
                             "drafter.confidence_with_markov=false for a confidence head over the state alone")
        if confidence_weight < 0:
            raise ValueError(f"drafter.confidence_weight={confidence_weight} must be >= 0")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"drafter.confidence_threshold={confidence_threshold} must be in [0, 1) or null (the "
                             f"fixed block)")
        if confidence_threshold is not None and not confidence_head:
            raise ValueError("drafter.confidence_threshold needs the confidence head (drafter.confidence_head=true)")
        D, V = self.dims.hidden_size, self.dims.vocab_size
        self.markov_rank = markov_rank
        self.markov_head = MarkovHead(V, markov_rank) if markov_rank else None
        self.confidence_with_markov = bool(confidence_with_markov and markov_rank)
        self.confidence_head = ConfidenceHead(D + (markov_rank if self.confidence_with_markov else 0)) \
            if confidence_head else None
        self.confidence_weight = float(confidence_weight)
        self.confidence_threshold = confidence_threshold
        self.confidence_target = confidence_target
        self._markov_rows: tuple | None = None

    # --- training ------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        out, pos_BNS, drawn = self.train_blocks(batch, teacher_out)
        ids = batch["input_ids"]
        B, N, S = pos_BNS.shape
        latent = None
        if self.markov_head is not None:  # teacher-forced: slot k's previous token is the training token at a + k - 1
            prev = ids.gather(1, (pos_BNS - 1).clamp(0, ids.shape[1] - 1).view(B, N * S)).view(B, N, S)
            latent = self.markov_head.markov_w1(prev).to(out.dtype)  # [B, N, S, r]
            head = MarkovLogits(self._frozen["lm_head"], self.markov_head, self.dims.hidden_size)
            terms = self.block_terms(torch.cat([out, latent], -1), head, pos_BNS, drawn, batch, teacher_out)
        else:
            terms = self.block_terms(out, Frozen(self._frozen["lm_head"]), pos_BNS, drawn, batch, teacher_out)
        labels = None
        if self.confidence_head is not None and self.confidence_target == "tv":  # before the terms drop the teacher
            labels = self._tv_labels(terms, pos_BNS, teacher_out, ids.shape[1])
        result = DraftOutput(terms=terms, num_valid=drawn.sum()).evaluate(loss_fn)
        if self.confidence_head is not None:
            result.aux_loss_sum = self.confidence_weight * self._confidence_loss(out, latent, terms, labels)
        return result

    def _tv_labels(self, terms: list[DraftTerm], pos_BNS: Tensor, teacher_out: TeacherOutput, T: int) -> list[Tensor]:
        """Per slot k >= 1, [B * N] Σ_v min(p_v, q_v) between the slot's draft distribution (its term's logits, the
        Markov bias included) and the target's distribution over the token it predicts, at temperature 1 (whatever
        the token loss's ``objective``)."""
        B, N = pos_BNS.shape[:2]
        b_N = torch.arange(B, device=pos_BNS.device)[:, None].expand(B, N).reshape(-1)
        return [chunked_acceptance(term.student_ND, term.head,
                                   TeacherRows(teacher_out, b_N, self.slot_teacher_positions(pos_BNS, k, T)),
                                   term.weight_N)
                for k, term in enumerate(terms, start=1)]

    def _confidence_loss(self, out_BNSD: Tensor, latent: Tensor | None, terms: list[DraftTerm],
                         labels: list[Tensor] | None = None) -> Tensor:
        """Σ over slots k >= 1 and trained rows of the slot weight x BCE(c_k, y_k), y_k = ``labels[k - 1]`` when given
        (``confidence_target: tv``), else 1[the slot's argmax is the target's token] (the terms' own argmax, computed
        by their loss). The confidence head alone gets this gradient's label, the backbone and the Markov latent its
        features' gradient, as the reference trains them."""
        total = out_BNSD.new_zeros((), dtype=torch.float32)
        B, N = out_BNSD.shape[:2]
        for k, term in enumerate(terms, start=1):
            with torch.no_grad():
                if labels is not None:
                    hit = labels[k - 1].float()
                else:
                    pred = term.pred_N if term.pred_N is not None else term.student_NV.argmax(-1)
                    hit = (pred == term.label_N).float()
            logit = self.confidence(out_BNSD[:, :, k].reshape(B * N, -1),
                                    None if latent is None else latent[:, :, k].reshape(B * N, -1))
            bce = F.binary_cross_entropy_with_logits(logit.float(), hit, reduction="none")
            w = term.weight_N if term.weight_N is not None else torch.ones_like(bce)
            total = total + term.weight * (bce * w).sum()
        return total

    def confidence(self, out_ND: Tensor, latent_Nr: Tensor | None) -> Tensor:
        """[N] acceptance logits of slots with states ``out_ND`` and Markov latents ``latent_Nr``."""
        x = torch.cat([out_ND, latent_Nr.to(out_ND.dtype)], -1) if self.confidence_with_markov else out_ND
        return self.confidence_head(x.to(self.confidence_head.proj.weight.dtype))

    # --- decoding ------------------------------------------------------------------------------------------
    def markov_rows(self) -> Tensor | None:
        """``markov_w2``'s rows of the drafted ids [Vd, r] (None: every id), cut once per weight and ``d2t``."""
        if self.draft_vocab_size is None or self.markov_head is None:
            return None
        w = self.markov_head.markov_w2.weight
        key = (w.data_ptr(), w._version, w.dtype, self.d2t.data_ptr(), self.d2t._version)
        if self._markov_rows is None or self._markov_rows[0] != key:
            with torch.no_grad():
                self._markov_rows = (key, w.detach().index_select(0, self.d2t.to(w.device)))
        return self._markov_rows[1]

    def slot_logits(self, out_ND: Tensor, latent_Nr: Tensor | None, rows: Tensor | None = None,
                    markov_rows: Tensor | None = None) -> Tensor:
        """[N, V] decoding logits of slots with states ``out_ND`` and previous-token latents ``latent_Nr``: DFlash's
        (over the drafted ids) plus the Markov bias. ``rows`` / ``markov_rows``: the cut lm_head / ``markov_w2``
        rows when the caller holds them."""
        if self.markov_head is None:
            return self.draft_logits(out_ND, rows)
        if self.draft_vocab_size is None:
            return self._logits(out_ND) + self.markov_head.markov_w2(latent_Nr.to(out_ND.dtype))
        rows = self.head_rows() if rows is None else rows
        markov_rows = self.markov_rows() if markov_rows is None else markov_rows
        sub = F.linear(out_ND.to(rows.dtype), rows) + F.linear(latent_Nr.to(markov_rows.dtype), markov_rows)
        return self.expand_draft(sub.to(out_ND.dtype))

    def latent(self, prev_N: Tensor, like: Tensor) -> Tensor | None:
        """[N, r] Markov latents of the previous tokens ``prev_N`` (None without a Markov head)."""
        if self.markov_head is None:
            return None
        return self.markov_head.markov_w1(prev_N.to(self.markov_head.markov_w1.weight.device)).to(like.dtype)

    @property
    def variable_depth(self) -> bool:
        """With the confidence cut, chains end where the drafter stops trusting them: the decoders verify each in
        the bucket of its own length."""
        return self.confidence_threshold is not None

    def reset(self, seed: int = 0) -> None:
        super().reset(seed)
        self.__dict__.setdefault("offered", 0)

    def offered_positions(self) -> int:
        """Draft positions offered for verification so far (after the confidence cut), eager and static steps
        together: the decode loop's verify width is the bucket's, this is what the drafter put in it."""
        static = self.__dict__.get("_static_drafts", {}).values()
        return self.offered + sum(int(s.offered) for s in static if isinstance(s, DSparkStaticDraft))

    def clear_offered(self) -> None:
        self.offered = 0
        for s in self.__dict__.get("_static_drafts", {}).values():
            if isinstance(s, DSparkStaticDraft):
                s.offered.zero_()

    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        rows = committed.ids_M.shape[0]
        depth = min(self.depth or self.block_size - 1, rows - 1, self.block_size - 1)
        return self.reuse_static_draft((depth, self.fc.weight.dtype, self.confidence_threshold), committed, capacity,
                                       sampling, generator,
                                       lambda: DSparkStaticDraft(self, committed, capacity, depth, sampling, generator))

    def saved_config(self, drafter_cfg: Mapping[str, Any]) -> dict:
        node = super().saved_config(drafter_cfg)
        node["markov_rank"] = self.markov_rank
        node["confidence_head"] = self.confidence_head is not None
        node["confidence_with_markov"] = self.confidence_with_markov
        node["confidence_threshold"] = self.confidence_threshold
        node["confidence_target"] = self.confidence_target
        return node

    def with_threshold(self, threshold: float | None) -> "DSparkDrafter":
        """This drafter (the same modules and weights) decoding with ``confidence_threshold`` = ``threshold``: a
        shallow copy with its own decoding state."""
        if threshold is not None and (self.confidence_head is None or not 0.0 <= threshold < 1.0):
            raise ValueError(f"drafter.confidence_threshold={threshold} needs the confidence head and a value in "
                             f"[0, 1)")
        view = copy.copy(self)
        view.__dict__["_static_drafts"] = {}
        view.confidence_threshold = threshold
        view.offered = 0
        view.reset()
        return view
