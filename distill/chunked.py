"""A projection and a divergence computed together in chunks of rows, so no [N, V] tensor exists for the whole batch.

A drafter's loss term is ``divergence(head(student_ND), teacher rows)`` with ``head`` a vocabulary projection
(Medusa head k's last Linear, EAGLE's lm_head, a draft LM's output embedding). Materialising ``head(student_ND)``
for all N rows, plus float32 log-softmaxes of it and of the teacher for backward, is what made 128k-vocabulary
training run out of memory. Here each chunk of ``chunk_elements // V`` rows is projected, compared with the
teacher's log-probs for the same rows and differentiated on the spot (Liger-kernel's fused-linear recipe, in plain
PyTorch): only the gradients w.r.t. ``student_ND`` [N, D] and the projection's trainable weights survive the chunk,
and backward just scales them by the incoming gradient. The gradient w.r.t. a chunk's logits comes from autograd on
that chunk alone, or, for forward KL (the default loss), from its closed form ``T (q - p)`` computed in place
(``distill.losses.fused_divergence``: 4 [rows, V] float32 buffers and two ``exp`` passes, where autograd keeps
~7). Forward and backward equal the unchunked loss up to float summation order (tests: rtol 1e-5).

Teacher side (``TeacherRows``): rows (b, t) of a ``distill.teacher.TeacherOutput`` — dense logits, the projected
form (final hidden state + read-out: each chunk projects its own teacher rows; a reduced vocabulary's slice is
projected once per batch) or the offline cache's sparse top-K — optionally restricted to the student's vocabulary
ids (EAGLE-3's ``d2t``). Each chunk gathers its own rows (and columns), never a full-row copy of the batch; the
per-row log-normaliser is computed once per batch and shared by every term (``TeacherOutput.log_normaliser``).

Rows and weights: a drafter hands every row of a term's static slice (``slice_positions``) with a 0/1 weight per row
(``weight_N``) instead of selecting its trained rows (``x[mask]``, ``nonzero``): a selection's size is data, which on a
GPU makes the host wait for the device. The loss is ``sum_r w_r * divergence_r`` and each row's gradient is scaled by
``w_r``; rows of weight 0 are read as zeros, so whatever a padded position holds never reaches a gradient.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distill import fused_kernels
from distill.losses import fused_divergence, log_acceptance, row_divergence, softmax_pair_
from distill.teacher_output import autocast_weight, plain_linear, project_into

CHUNK_ELEMENTS = 1 << 25  # rows per chunk = this // V (261 at 128k): 128 MB per float32 [rows, V] temporary; CPU
# matmuls with fewer rows run 2-3x slower per row on 2 threads (measured: 65 vs 261 vs 1024 rows)
# On a GPU: one [rows, V] float32 buffer of 1 GB (2,092 rows at 128k; ~3 per chunk). On an H100 the CPU default
# trained Medusa (4 heads, V 128k, seq 2048-8192) at 0.66-0.72x the tokens/s of the unchunked base commit
# (scripts/results/bench_memory_gpu.json): 8-32 chunks of 261 rows per head are small matmuls with a Python loop
# around them, where GPU memory has room for a whole 2k-token row's chunk. The effect of this value on that
# figure has not been measured yet (the lease ran out); it follows the CPU trend (larger chunks train faster).
CUDA_CHUNK_ELEMENTS = 1 << 28
_budget = contextvars.ContextVar("chunk_elements", default=CHUNK_ELEMENTS)
# ``torch.compile`` keyword arguments for the loss core of every chunk (``compiled_loss``); None: eager.
_compile = contextvars.ContextVar("compile_loss", default=None)


def default_chunk_elements(device: torch.device | str) -> int:
    """``trainer.loss_chunk_elements: null``: the chunk budget for the device the loss runs on."""
    return CUDA_CHUNK_ELEMENTS if torch.device(device).type == "cuda" else CHUNK_ELEMENTS


@contextlib.contextmanager
def chunk_budget(elements: int) -> Iterator[None]:
    """Inside this block, chunked losses that are not given ``chunk_elements`` project ``elements // V`` rows per
    chunk (``trainer.loss_chunk_elements``): fewer, larger chunks read the vocabulary head's weight fewer times (each
    chunk reads it for the student's and the teacher's projection and the backward matmul; on a CPU at V 128k that is
    ~10% of an EAGLE-1 step at 4 chunks per 1k rows), at 4 float32 [rows, V] buffers of memory per chunk."""
    if elements < 1:
        raise ValueError(f"trainer.loss_chunk_elements={elements} must be >= 1 (rows x vocabulary per loss chunk)")
    token = _budget.set(elements)
    try:
        yield
    finally:
        _budget.reset(token)


@contextlib.contextmanager
def compiled_loss(compile_kw: dict | None) -> Iterator[None]:
    """Inside this block, a chunk's hand-differentiated divergence (``distill.losses.fused_divergence``: the
    softmaxes, the divergence and its logit gradient, several passes over [rows, V] float32 buffers eagerly) runs
    as one compiled function (``trainer.compile``), its row count dynamic; ``compile_kw``: ``torch.compile``'s
    keyword arguments, None: eager."""
    token = _compile.set(compile_kw)
    try:
        yield
    finally:
        _compile.reset(token)


class Finished(nn.Module):
    """``finish(proj(x))`` as one module (a vocabulary projection, then what the target's forward does after its
    lm_head, e.g. Gemma-2's soft-capping), so the chunked loss differentiates ``proj``'s parameters through it."""

    def __init__(self, proj: nn.Module, finish: Callable[[Tensor], Tensor]):
        super().__init__()
        self.proj, self.finish = proj, finish

    def forward(self, x: Tensor) -> Tensor:
        return self.finish(self.proj(x))


class Frozen:
    """A vocabulary projection the loss differentiates through but never trains (EAGLE-1's: the target's lm_head):
    no gradient for its parameters whatever their ``requires_grad``; inputs cast to its dtype and back."""

    def __init__(self, head: nn.Module):
        self.head = head

    def __call__(self, x: Tensor) -> Tensor:
        return self.head(x.to(self.head.weight.dtype)).to(x.dtype)


class Workspace:
    """[rows, V] buffers reused by every chunk of one loss term on a CPU: a fresh float32 buffer of 128 MB costs
    ~75 ms of page faults there (glibc maps and unmaps allocations this large each time; measured on this machine:
    as long as the ``exp`` pass over it), four of them per chunk. On a GPU the caching allocator reuses memory
    already, so ``take`` gives None (allocate as usual)."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cpu"
        self._bufs: dict[str, Tensor] = {}

    def take(self, name: str, rows: int, cols: int) -> Tensor | None:
        """A float32 [rows, cols] view of buffer ``name`` (grown when too small)."""
        if not self.enabled:
            return None
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * cols:
            buf = self._bufs[name] = torch.empty(rows * cols, dtype=torch.float32)
        return buf[: rows * cols].view(rows, cols)


@dataclass
class TeacherRows:
    """Rows (``b_N``, ``t_N``) of a batch's teacher signal, over the vocabulary ids ``cols`` (None: all of V)."""

    signal: object  # distill.teacher.TeacherOutput
    b_N: Tensor
    t_N: Tensor
    cols: Tensor | None = None
    label_map: Tensor | None = None  # target id -> student index (-1: absent), for top-1 agreement
    # every row went through ``raw`` of a projected signal, which recorded its argmax (``TeacherOutput._project``)
    projected_all: bool = False

    def __len__(self) -> int:
        return self.b_N.shape[0]

    @property
    def width(self) -> int:
        """The vocabulary the student must cover: len(cols), or V."""
        if self.cols is not None:
            return self.cols.numel()
        return self.signal.logits_BTV.shape[-1] if self.signal.logits_BTV is not None else self.signal.vocab_size

    def raw(self, start: int = 0, end: int | None = None, out: Tensor | None = None) -> Tensor:
        """The teacher's logits of rows [start, end) in their own dtype (what an unchunked loss would be given); a
        new tensor (gathered, expanded or projected) or ``out`` (``TeacherOutput.rows``), never a view of the
        signal."""
        return self.signal.rows(self.b_N[start:end], self.t_N[start:end], self.cols, out)

    def log_probs(self, start: int, end: int, temperature: float, probs: bool = False, ws: Workspace | None = None):
        """float32 log-softmax of rows [start, end) at T; dense signals and vocabulary slices reuse the batch's
        shared normaliser. ``probs``: (log-probs, probs) instead, the probs where they come from the same ``exp``
        pass as the normaliser (projected full rows, sparse rows), else None (the caller exponentiates). ``ws``:
        buffers to write into, reused from chunk to chunk."""
        rows = end - start
        # the rows ``TeacherOutput.rows`` writes into ``out``: projected, and full-vocabulary dense
        written = self.signal.projected or self.cols is None and not self.signal.sparse
        out = ws.take("teacher", rows, self.width) if ws is not None and written else None
        x = self.raw(start, end, out).float()  # gathered or projected: a tensor of its own, normalised in place
        if temperature != 1:
            x.div_(temperature)
        if self.signal.sparse or self.signal.projected and self.cols is None:
            # K ids per row, or full rows projected for this chunk alone: the chunk's own softmax costs no more
            if probs:
                return softmax_pair_(x, ws.take("p", rows, self.width) if ws is not None else None)
            return x.sub_(torch.logsumexp(x, dim=-1, keepdim=True))
        lse = self.signal.log_normaliser(temperature, self.cols)
        x.sub_(lse[self.b_N[start:end], self.t_N[start:end]][:, None])
        if not probs:
            return x
        return x, (torch.exp(x, out=ws.take("p", rows, self.width)) if ws is not None else None)

    @torch.no_grad()
    def labels(self) -> Tensor:
        """[N] the index the student's argmax must equal to agree with the teacher: the teacher's top token over the
        whole vocabulary, mapped into the student's (-1, never matched, when it lies outside)."""
        if self.signal.projected and self.projected_all:  # recorded already: no look-up of the rows left to project
            top = self.signal.recorded_argmax()[self.b_N, self.t_N]
        else:
            top = self.signal.argmax_BT()[self.b_N, self.t_N]
        return top if self.label_map is None else self.label_map[top]


@dataclass
class LabelRows:
    """Hard next-token labels as the "teacher" of a chunked loss (a language-modelling term, e.g. Medusa-2's
    adapted target): ``raw`` hands each chunk its labels, and ``cross_entropy_sum`` is the matching loss_fn."""

    labels_N: Tensor
    width: int  # the vocabulary the projection covers

    def __len__(self) -> int:
        return self.labels_N.shape[0]

    def raw(self, start: int = 0, end: int | None = None) -> Tensor:
        return self.labels_N[start:end]


def cross_entropy_sum(logits_CV: Tensor, labels_C: Tensor, mask_C: Tensor | None = None) -> tuple[Tensor, None]:
    """float32 next-token cross-entropy summed over a chunk's rows where ``mask_C`` is True (None: all rows;
    ``LabelRows``' loss_fn). Masked rows are zeroed (``torch.where``), not selected: no host sync."""
    if mask_C is None:
        return F.cross_entropy(logits_CV.float(), labels_C, reduction="sum"), None
    ce = F.cross_entropy(logits_CV.float(), labels_C, reduction="none")
    return torch.where(mask_C, ce, 0).sum(), None


def chunked_cross_entropy(hidden_ND: Tensor, head: Callable[[Tensor], Tensor], labels_N: Tensor, vocab_size: int,
                          chunk_elements: int | None = None, weight_N: Tensor | None = None) -> Tensor:
    """``F.cross_entropy(head(hidden_ND), labels_N, reduction="sum")`` without the [N, V] logits (chunked, with the
    same hand-made backward as the divergences); ``weight_N``: 0/1 per row, the rows that count (None: all)."""
    return chunked_divergence(hidden_ND, head, LabelRows(labels_N, vocab_size), cross_entropy_sum, chunk_elements,
                              weight_N)[0]


def positions(mask_BT: Tensor, shift: int = 0) -> tuple[Tensor, Tensor]:
    """(b_N, t_N + shift) of the True entries of ``mask_BT``, in the row-major order of ``x[mask_BT]`` (a
    data-dependent size: the host waits for the device; a training step uses ``slice_positions``)."""
    b_N, t_N = mask_BT.nonzero(as_tuple=True)
    return b_N, t_N + shift


def slice_positions(B: int, n: int, shift: int = 0, device: torch.device | str | None = None
                    ) -> tuple[Tensor, Tensor]:
    """(b_N, t_N + shift) of every position of ``x[:, :n]`` of a [B, T, ...] batch, in the row-major order of
    ``x[:, :n].reshape(B * n, ...)``: a term's static rows (weighted by ``mask[:, :n].reshape(-1)``)."""
    b_N = torch.arange(B, device=device)[:, None].expand(B, n).reshape(-1)
    t_N = torch.arange(shift, n + shift, device=device)[None].expand(B, n).reshape(-1)
    return b_N, t_N


def chunked_divergence(student_ND: Tensor, head: Callable[[Tensor], Tensor], teacher: TeacherRows | LabelRows, loss_fn,
                       chunk_elements: int | None = None, weight_N: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(loss summed over the N rows, the student's argmax per row [N]) for ``loss_fn`` (a ``distill.losses`` menu
    function or partial; any other ``loss_fn(student_CV, teacher_CV, mask_C)`` is called per chunk, ``mask_C`` None
    or, with weights, the chunk's rows of nonzero weight as a bool mask: such a function may select rows by it, at
    the cost of a host sync per chunk) between ``head(student_ND)`` and the teacher rows. ``weight_N``: 0/1 per row
    (float; None: every row counts): the loss is ``sum_r w_r * divergence_r``, each row's gradient scaled by ``w_r``.
    Differentiable w.r.t. ``student_ND`` and ``head``'s parameters that require grad (``head`` an ``nn.Module``; a
    plain function's captured tensors are treated as constants). Under ``trainer.fused_kernel`` auto | liger, a term
    liger-kernel computes exactly runs through it instead (``distill.fused_kernels``; given weights, it takes the
    rows of weight 1 alone, a selection whose size the host must read)."""
    if len(teacher) != student_ND.shape[0]:
        raise ValueError(f"{student_ND.shape[0]} student rows but {len(teacher)} teacher rows")
    if weight_N is not None and weight_N.shape != (student_ND.shape[0],):
        raise ValueError(f"weight_N {tuple(weight_N.shape)} must hold one weight per row ({student_ND.shape[0]})")
    if _partitioned(head):
        return _gathered_divergence(student_ND, head, teacher, loss_fn, chunk_elements, weight_N)
    # ``trainer.fused_kernel``: liger-kernel's fused linear JSD where it computes this term exactly (GPU)
    lin = plain_linear(head.head if isinstance(head, Frozen) else head)
    liger = fused_kernels.select(student_ND, head, lin, teacher, loss_fn, weight_N)
    if liger is not None:
        rows = max(1, (chunk_elements or _budget.get()) // teacher.width)
        return fused_kernels.liger_divergence(liger), fused_kernels.student_argmax(student_ND, head, rows)
    job = _Job(head, lin, teacher, loss_fn, chunk_elements or _budget.get(), weight_N)
    params = [p for p in head.parameters() if p.requires_grad] if isinstance(head, nn.Module) else []
    if torch.is_grad_enabled() and (student_ND.requires_grad or params):
        loss = _ChunkedDivergence.apply(job, student_ND, *params)
    else:
        loss = job.run(student_ND, [], need_grads=False)[0]
    job.mark_projected()
    return loss, job.pred_N


@torch.no_grad()
def chunked_acceptance(student_ND: Tensor, head: Callable[[Tensor], Tensor], teacher: TeacherRows,
                       weight_N: Tensor | None = None, temperature: float = 1.0,
                       chunk_elements: int | None = None) -> Tensor:
    """[N] float32 acceptance Σ_v min(p_v, q_v) = 1 − TV(q, p) per row between ``softmax(head(student_ND) / T)`` and
    the teacher's rows at T (``distill.losses.log_acceptance``), chunk by chunk like ``chunked_divergence`` and
    without a graph: a training target or weight, never differentiated. A pass of its own (one projection of the
    rows more), so it works beside any loss path, liger's included. ``weight_N``: rows of weight 0 are read as zeros
    and answer 0 (whatever a padded position holds, even non-finite, stays out)."""
    if len(teacher) != student_ND.shape[0]:
        raise ValueError(f"{student_ND.shape[0]} student rows but {len(teacher)} teacher rows")
    step = max(1, (chunk_elements or _budget.get()) // teacher.width)
    out = []
    for start in range(0, student_ND.shape[0], step):
        end = min(start + step, student_ND.shape[0])
        keep = None if weight_N is None else weight_N[start:end] > 0
        x = student_ND[start:end] if keep is None else torch.where(keep[:, None], student_ND[start:end], 0)
        z = head(x).float()
        log_q = F.log_softmax(z if temperature == 1 else z / temperature, dim=-1)
        alpha = log_acceptance(log_q, teacher.log_probs(start, end, temperature)).exp()
        out.append(alpha if keep is None else torch.where(keep, alpha, 0))
    return torch.cat(out) if out else torch.zeros(0, device=student_ND.device)


def _partitioned(head) -> bool:
    """Whether ``head`` holds parameters DeepSpeed ZeRO-3 partitions (``ds_id``): their tensors are empty outside the
    module's own forward, so the chunk loop cannot read the weight; the head must be called."""
    return isinstance(head, nn.Module) and any(hasattr(p, "ds_id") for p in head.parameters())


def _gathered_divergence(student_ND: Tensor, head: nn.Module, teacher, loss_fn, chunk_elements: int | None,
                         weight_N: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``chunked_divergence`` by plain autograd through calls of ``head`` (ZeRO-3 gathers its weight on each call and
    reduces its gradient in backward): the same loss, chunk by chunk, but every chunk's logits stay in the graph."""
    job = _Job(head, None, teacher, loss_fn, chunk_elements or _budget.get(), weight_N)
    step = max(1, job.chunk_elements // teacher.width)
    total = torch.zeros((), dtype=torch.float32, device=student_ND.device)
    preds = []
    for start in range(0, student_ND.shape[0], step):
        end = min(start + step, student_ND.shape[0])
        logits = head(job.rows(student_ND, start, end))
        preds.append(logits.detach().argmax(-1))
        total = total + job._chunk_loss(logits, start, end).float()
    pred_N = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=student_ND.device)
    job.mark_projected()
    return total, pred_N


class _Job:
    """One term's chunk loop; ``run`` returns (loss, grad w.r.t. student rows, grads w.r.t. params)."""

    def __init__(self, head, lin: nn.Linear | None, teacher: TeacherRows | LabelRows, loss_fn, chunk_elements: int,
                 weight_N: Tensor | None = None):
        # ``lin``: the plain nn.Linear ``head`` is or wraps (``Frozen``), else None (``teacher_output.plain_linear``)
        self.head, self.lin, self.teacher, self.loss_fn = head, lin, teacher, loss_fn
        self.core = row_divergence(loss_fn)
        self.fused = fused_divergence(loss_fn, compile_kw=_compile.get())
        self.chunk_elements = chunk_elements
        self.weight_N = None if weight_N is None else weight_N.detach().float()
        self.pred_N: Tensor | None = None

    def rows(self, x_ND: Tensor, start: int, end: int) -> Tensor:
        """Rows [start, end) of ``x_ND``, those of weight 0 read as zeros (a padded position's features may be
        anything, even non-finite; a zero row keeps them out of the projection's weight gradient)."""
        if self.weight_N is None:
            return x_ND[start:end]
        return torch.where(self.weight_N[start:end, None] > 0, x_ND[start:end], 0)

    def _weighted(self, rows_C: Tensor, start: int, end: int) -> Tensor:
        """The chunk's per-row divergences summed, each times its row's weight."""
        return rows_C.sum() if self.weight_N is None else (rows_C * self.weight_N[start:end]).sum()

    def mark_projected(self) -> None:
        """Record that every teacher row went through ``raw`` (its argmax is then recorded, ``TeacherRows.labels``)."""
        if isinstance(self.teacher, TeacherRows):
            self.teacher.projected_all = True

    def _chunk_loss(self, logits_CV: Tensor, start: int, end: int) -> Tensor:
        if self.core is None:
            mask = None if self.weight_N is None else self.weight_N[start:end] > 0
            return self.loss_fn(logits_CV, self.teacher.raw(start, end), mask)[0]
        core, temperature = self.core
        z = logits_CV.float() if temperature == 1 else logits_CV.float() / temperature
        return self._weighted(core(F.log_softmax(z, dim=-1), self.teacher.log_probs(start, end, temperature)),
                              start, end)

    def _loss_and_dlogits(self, logits_CV: Tensor, start: int, end: int,
                          ws: Workspace | None = None) -> tuple[Tensor, Tensor]:
        """(the chunk's loss, its gradient w.r.t. ``logits_CV``: a detached tensor of the caller's, consumed; with
        ``ws``, the gradient lives in its buffers until the next chunk)."""
        if self.fused is not None:
            fused, temperature = self.fused
            q_out = ws.take("q", *logits_CV.shape) if ws is not None else None
            rows, dlogits = fused(logits_CV, *self.teacher.log_probs(start, end, temperature, probs=True, ws=ws),
                                  q_out=q_out)
            if self.weight_N is not None:
                dlogits.mul_(self.weight_N[start:end, None])
            return self._weighted(rows, start, end), dlogits
        with torch.enable_grad():
            logits_CV.requires_grad_()
            loss = self._chunk_loss(logits_CV, start, end)
            return loss, torch.autograd.grad(loss, [logits_CV])[0]

    def run(self, x_ND: Tensor, params: list[Tensor], need_grads: bool):
        N = x_ND.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=x_ND.device)
        grad_x = torch.zeros_like(x_ND) if need_grads and x_ND.requires_grad else None
        grads = [torch.zeros_like(p) for p in params] if need_grads else []
        step = max(1, self.chunk_elements // self.teacher.width)
        # d loss / d logits first (by hand for a fused divergence, else autograd on the chunk's logits alone), then
        # through the head: an nn.Linear (trainable or ``Frozen``) by its two matmuls, the weight's gradient
        # accumulated in place (no [V, D] temporary per chunk); any other head by autograd. A fused divergence on a
        # CPU works in buffers reused from chunk to chunk (``Workspace``).
        lin = self.lin
        linear = (lin is not None and lin.weight.dtype == x_ND.dtype
                  and all(p is lin.weight or p is lin.bias for p in params))
        ws = Workspace(x_ND.device) if linear and self.fused is not None else None
        # under autocast, the weight's cast copy made once: per batch for a frozen read-out (shared with the teacher's
        # projection of the same weight, EAGLE-1), per term for a trainable head
        memo = (self.teacher.signal.memo if lin is not None and not lin.weight.requires_grad
                and isinstance(self.teacher, TeacherRows) else {})
        wrt = ([x_ND] if grad_x is not None else []) + params
        preds = []
        for start in range(0, N, step):
            end = min(start + step, N)
            if not need_grads or not wrt:
                with torch.no_grad():
                    logits = self.head(self.rows(x_ND, start, end))
                    preds.append(logits.argmax(-1))
                    total += self._chunk_loss(logits, start, end).float()
                continue
            x = self.rows(x_ND, start, end).detach()
            if linear:
                with torch.no_grad():
                    logits = project_into(lin, x, ws.take("student", end - start, self.teacher.width)
                                          if ws is not None else None, memo)
                preds.append(logits.argmax(-1))
                loss, dlogits = self._loss_and_dlogits(logits, start, end, ws)
                self._linear_grads(lin, dlogits, x, start, grad_x, grads, params, autocast_weight(lin.weight, memo))
            else:
                with torch.enable_grad():
                    x.requires_grad_(grad_x is not None)
                    out = self.head(x)
                preds.append(out.detach().argmax(-1))
                loss, dlogits = self._loss_and_dlogits(out.detach().clone(), start, end)
                got = list(torch.autograd.grad(out, ([x] if grad_x is not None else []) + params,
                                               grad_outputs=dlogits.to(out.dtype), allow_unused=True))
                if grad_x is not None:
                    grad_x[start:end] = got.pop(0)
                for acc, g in zip(grads, got):
                    if g is not None:
                        acc += g
            total += loss.detach().float()
        self.pred_N = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=x_ND.device)
        return total, grad_x, grads


    @staticmethod
    def _linear_grads(lin: nn.Linear, dlogits: Tensor, x: Tensor, start: int, grad_x: Tensor | None,
                      grads: list[Tensor], params: list[Tensor], cast: Tensor | None) -> None:
        """Through the projection: grad_x += dlogits W (under autocast in its dtype, with the weight's cast copy
        ``cast``, as autograd through the autocast projection does), the weight's gradient accumulated in float32."""
        weight = lin.weight
        if grad_x is not None:
            w = weight if cast is None else cast
            grad_x[start: start + x.shape[0]] = (dlogits.to(w.dtype) @ w).to(grad_x.dtype)
        for acc, p in zip(grads, params):
            if p is weight:
                acc.addmm_(dlogits.t().to(acc.dtype), x.to(acc.dtype))
            else:  # the bias
                acc += dlogits.sum(0).to(acc.dtype)


class _ChunkedDivergence(torch.autograd.Function):
    """Forward computes the loss and its gradients chunk by chunk; backward scales them by the incoming gradient
    (a scalar), so nothing of size [N, V] is kept between the two."""

    @staticmethod
    def forward(ctx, job: _Job, x_ND: Tensor, *params: Tensor) -> Tensor:
        loss, grad_x, grads = job.run(x_ND, list(params), need_grads=True)
        ctx.grad_x, ctx.grads = grad_x, grads
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_x = None if ctx.grad_x is None else ctx.grad_x.mul_(grad_out.to(ctx.grad_x.dtype))
        grads = [g.mul_(grad_out.to(g.dtype)) for g in ctx.grads]  # in place: they are not needed again
        ctx.grad_x = ctx.grads = None
        return (None, grad_x, *grads)
