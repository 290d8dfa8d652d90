"""What the teacher says about one batch (``TeacherOutput``), in the three forms a loss reads: dense logits,
projected (the final normed hidden state plus the target's read-out), or the offline cache's sparse top-K."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FLOOR_MARGIN = 1e4  # sparse signals: exp(-1e4) is exactly 0 in float32 and bfloat16
PROJECT_CHUNK_ELEMENTS = 1 << 25  # projected signals: rows per projection = this // V (128 MB of float32 logits)


@dataclass
class TeacherOutput:
    """What the teacher says about one batch, in one of three forms: dense logits (online); projected (online: the
    final normed hidden state and the target's read-out, so the [B, T, V] logits never exist: ``rows`` projects the
    rows a loss chunk asks for, ``columns`` keeps one vocabulary slice); or its top-K log-probs (the offline cache,
    kept sparse: ``rows`` expands only the rows a loss chunk asks for). Losses read it through ``rows`` /
    ``log_normaliser`` / ``argmax_BT``, whose per-batch reductions are computed once and shared by every head / TTT
    step (``_memo``)."""

    logits_BTV: Tensor | None
    hidden: dict[int, Tensor] = field(default_factory=dict)  # layer index -> [B, T, D]
    topk_ids_BTK: Tensor | None = None  # sparse form: the teacher's top-K ids ...
    topk_logprobs_BTK: Tensor | None = None  # ... and their float32 log-probs
    vocab_size: int | None = None  # sparse and projected forms: V
    dtype: torch.dtype | None = None  # sparse form: the dtype the online teacher's logits would have
    final_BTD: Tensor | None = None  # projected form: what the target's lm_head reads (hidden-state index -1) ...
    readout: Callable[[Tensor], Tensor] | None = None  # ... and what turns it into logits (``TargetLogits``)
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def memo(self) -> dict:
        """This batch's cache of per-batch reductions and cast weights (kept with the batch, dropped with it)."""
        return self._memo

    @property
    def sparse(self) -> bool:
        return self.logits_BTV is None and self.final_BTD is None

    @property
    def projected(self) -> bool:
        return self.final_BTD is not None

    @property
    def shape_BT(self) -> tuple[int, int]:
        ref = self.topk_ids_BTK if self.sparse else self.final_BTD if self.projected else self.logits_BTV
        return ref.shape[0], ref.shape[1]

    def rows(self, b_N: Tensor, t_N: Tensor, cols: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """Teacher logits of positions (b_N, t_N): [N, V], or [N, len(cols)] over the vocabulary ids ``cols`` (one
        gather, no full-row copy). Sparse: the top-K log-probs at their ids, a finite floor (smallest - 1e4)
        elsewhere, so a softmax over them is the teacher renormalised on its top K. ``out``: a buffer of the
        result's shape and dtype that full-vocabulary dense and projected rows are written into (else ignored)."""
        if self.projected:
            if cols is None:
                return self._project(b_N, t_N, out)
            return _gather(self.columns(cols), b_N, t_N, out)  # the kept [B, T, len(cols)] slice
        if not self.sparse:
            if cols is None:
                return _gather(self.logits_BTV, b_N, t_N, out)
            return self.logits_BTV[b_N[:, None], t_N[:, None], cols[None, :]]
        dense = dense_logits(self.topk_ids_BTK[b_N, t_N], self.topk_logprobs_BTK[b_N, t_N], self.vocab_size,
                             self.dtype or torch.float32)
        return dense if cols is None else dense[:, cols]

    @torch.no_grad()
    def argmax_BT(self) -> Tensor:
        """[B, T] the teacher's top token over the whole vocabulary (computed once per batch)."""
        if self.projected:  # every row projected once, in row chunks (``_project`` records the argmax on the way)
            if not self._memo.get("argmax_all"):
                B, T = self.shape_BT
                b_all = torch.arange(B, device=self._device)[:, None].expand(B, T).reshape(-1)
                t_all = torch.arange(T, device=self._device)[None].expand(B, T).reshape(-1)
                for i in range(0, B * T, self._chunk_rows()):  # all rows, not the unrecorded ones: a static loop
                    self._project(b_all[i: i + self._chunk_rows()], t_all[i: i + self._chunk_rows()])
                self._memo["argmax_all"] = True
            return self._memo["argmax"]
        if "argmax" not in self._memo:
            if self.sparse:
                best = self.topk_logprobs_BTK.argmax(-1, keepdim=True)
                self._memo["argmax"] = self.topk_ids_BTK.gather(-1, best)[..., 0].long()
            else:
                self._memo["argmax"] = self.logits_BTV.argmax(-1)
        return self._memo["argmax"]

    @torch.no_grad()
    def log_normaliser(self, temperature: float, cols: Tensor | None = None, chunk_elements: int = 1 << 23) -> Tensor:
        """[B, T] float32 logsumexp of the logits / T (over ``cols`` only when given): log-probs of any row are then
        ``rows(...) / T - this``. Computed once per batch, temperature and vocabulary, in row chunks; dense and
        projected forms (projected: over the ``columns`` slice, or projecting each chunk of rows)."""
        key = ("lse", temperature, None if cols is None else (cols.data_ptr(), cols.numel()))
        if key not in self._memo:
            source, cols = (self.columns(cols), None) if self.projected and cols is not None else (self.logits_BTV, cols)
            B, T = self.shape_BT
            step = self._chunk_rows() if source is None else max(1, chunk_elements // (
                source.shape[-1] if cols is None else cols.numel()))
            lse = torch.empty(B, T, dtype=torch.float32, device=self._device)
            for b in range(B):
                for t0 in range(0, T, step):
                    if source is None:  # projected, full vocabulary
                        t_N = torch.arange(t0, min(t0 + step, T), device=self._device)
                        x = self._project(torch.full_like(t_N, b), t_N)
                    else:
                        x = source[b, t0: t0 + step]
                    x = (x if cols is None else x[:, cols]).float()
                    lse[b, t0: t0 + step] = torch.logsumexp(x if temperature == 1 else x / temperature, dim=-1)
            self._memo[key] = lse
        return self._memo[key]

    # --- the projected form ----------------------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return next(t for t in (self.logits_BTV, self.final_BTD, self.topk_ids_BTK) if t is not None).device

    def _chunk_rows(self) -> int:
        return max(1, PROJECT_CHUNK_ELEMENTS // self.vocab_size)

    def recorded_argmax(self) -> Tensor:
        """[B, T] the teacher's top token at the positions projected so far (-1 elsewhere): ``argmax_BT`` without
        projecting the rest, for a caller that knows its rows were projected (``distill.chunked.TeacherRows``)."""
        return self._argmax_record()

    def _argmax_record(self) -> Tensor:
        """[B, T] the teacher's top token at the positions projected so far (-1 elsewhere)."""
        if "argmax" not in self._memo:
            self._memo["argmax"] = torch.full(self.shape_BT, -1, dtype=torch.long, device=self._device)
        return self._memo["argmax"]

    @torch.no_grad()
    def _project(self, b_N: Tensor, t_N: Tensor, out: Tensor | None = None) -> Tensor:
        """[N, V] logits of positions (b_N, t_N) through the read-out (into ``out`` where the read-out is a plain
        projection, ``project_into``), recording their argmax on the way (the agreement labels then cost no second
        projection)."""
        logits = project_into(self.readout, self.final_BTD[b_N, t_N], out, self.memo)
        self._argmax_record()[b_N, t_N] = logits.argmax(-1)
        return logits

    @torch.no_grad()
    def columns(self, cols: Tensor) -> Tensor:
        """[B, T, len(cols)] the logits over the vocabulary ids ``cols`` (a reduced draft vocabulary), projected once
        per batch in row chunks over the whole vocabulary (whose argmax is recorded at the same time) and kept:
        every TTT step reads this slice, a quarter of [B, T, V] at EAGLE-3's 32k of 128k. Projected form only."""
        key = ("cols", cols.data_ptr(), cols.numel())
        if key not in self._memo:
            B, T = self.shape_BT
            out = None
            b_all, t_all = (x.flatten() for x in torch.meshgrid(torch.arange(B, device=self._device),
                                                                torch.arange(T, device=self._device), indexing="ij"))
            step = self._chunk_rows()
            for i in range(0, B * T, step):
                rows = self._project(b_all[i: i + step], t_all[i: i + step])[:, cols]
                if out is None:
                    out = torch.empty(B * T, cols.numel(), dtype=rows.dtype, device=rows.device)
                out[i: i + step] = rows
            self._memo[key] = out.view(B, T, -1)
            self._memo["argmax_all"] = True  # every row was projected
        return self._memo[key]


def _gather(src_BTW: Tensor, b_N: Tensor, t_N: Tensor, out: Tensor | None) -> Tensor:
    """``src_BTW[b_N, t_N]``, written into ``out`` when it fits (same dtype, ``src`` contiguous)."""
    if out is None or out.dtype != src_BTW.dtype or not src_BTW.is_contiguous():
        return src_BTW[b_N, t_N]
    B, T, W = src_BTW.shape
    return torch.index_select(src_BTW.view(B * T, W), 0, b_N * T + t_N, out=out)


def plain_linear(head) -> nn.Linear | None:
    """The ``nn.Linear`` that ``head`` is, or that it applies with nothing after it (a target read-out,
    ``distill.teacher.TargetLogits``, without soft-capping); None for any other head."""
    if type(head) is nn.Linear:
        return head
    inner = getattr(head, "lm_head", None)
    return inner if type(inner) is nn.Linear and getattr(head, "softcap", 0) is None else None


def autocast_weight(weight: Tensor, memo: dict) -> Tensor | None:
    """``weight`` in the autocast dtype of its device, cast once per ``memo`` (None outside autocast). Autocast
    casts a weight that does not require grad (the target's read-out) anew at every call, and a chunked loss calls
    its projection once per chunk: at V 128k, D 512 on a CPU each cast is ~0.1 s, as long as a chunk's matmul."""
    device = weight.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    key = ("autocast", weight.data_ptr(), weight._version, dtype)  # _version: an optimizer step makes a new key
    if key not in memo:
        memo[key] = weight.detach().to(dtype)
    return memo[key]


def project_into(head, x_ND: Tensor, out: Tensor | None = None, memo: dict | None = None) -> Tensor:
    """``head(x_ND)`` for a plain projection (``plain_linear``): under autocast, its weight cast once per ``memo``
    (``autocast_weight``; the values autocast would compute); outside it, written into ``out`` (a [N, V] buffer
    reused from chunk to chunk: on a CPU a fresh [rows, V] result costs as much in page faults as the ``exp`` pass
    over it, glibc maps and unmaps allocations this large each time). Any other head: ``head(x_ND)``."""
    linear = plain_linear(head)
    if linear is None or linear.weight.dtype != x_ND.dtype:
        return head(x_ND)
    weight = autocast_weight(linear.weight, memo) if memo is not None else None
    if weight is not None:
        bias = None if linear.bias is None else linear.bias.detach().to(weight.dtype)
        logits = F.linear(x_ND.to(weight.dtype), weight, bias)
        return logits if out is None or out.dtype == logits.dtype else out.copy_(logits)
    if out is None or out.dtype != x_ND.dtype or torch.is_autocast_enabled(x_ND.device.type):
        return head(x_ND)
    if linear.bias is None:
        return torch.mm(x_ND, linear.weight.t(), out=out)
    return torch.addmm(linear.bias, x_ND, linear.weight.t(), out=out)


def dense_logits(topk_ids: Tensor, topk_logprobs: Tensor, vocab_size: int, dtype: torch.dtype) -> Tensor:
    """[..., V] logits whose softmax is the top-K distribution renormalised: log-probs at their ids, a finite floor
    (smallest top-K log-prob - 1e4 per position) elsewhere."""
    floor = topk_logprobs.float().min(dim=-1, keepdim=True).values - FLOOR_MARGIN
    dense = floor.to(dtype).expand(*topk_ids.shape[:-1], vocab_size).clone()
    return dense.scatter_(-1, topk_ids.long(), topk_logprobs.to(dtype))
