"""Distillation losses: pure functions of student logits, teacher logits and a mask.

Every loss returns ``(loss_sum, num_valid)``: the sum over valid positions and how many there were. The training
loop adds these up over micro-batches (and, later, ranks) and divides once, so a batch with few valid tokens does
not get the same weight as a full one.

Shapes: ``student_NV`` / ``teacher_NV`` are logits over the vocabulary for N positions (any leading shape works as
long as the last dim is V and ``mask`` has the leading shape; ``mask=None`` counts every position).

Each divergence is a ``_core`` of (student log-probs, teacher log-probs) rows at temperature T, giving one value per
row (summed over the vocabulary only); the public functions select and normalise rows, apply it and sum.
``row_divergence(loss_fn)`` hands the core of a configured loss to ``distill.chunked``, which applies it to chunks of
rows whose logits are never all in memory at once and weights each row (a drafter's rows are a static slice with a
0/1 weight per row, so no row selection makes the step wait for the device).

Acceptance-aligned entries: ``lk`` targets the speculative-sampling acceptance α = Σ_v min(p_v, q_v) of a row
directly, and ``acceptance_weighted`` scales another entry's per-row divergence by that row's α (detached). Neither
has a hand-written gradient (``fused_divergence`` gives None: autograd differentiates each chunk) and liger-kernel
computes neither (``distill.fused_kernels`` falls back to the chunked path, or names why under ``liger``).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float) -> None:
    if student.shape != teacher.shape:
        raise ValueError(f"student logits {tuple(student.shape)} and teacher logits {tuple(teacher.shape)} differ")
    if mask is not None and mask.shape != student.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal the logits' leading shape {tuple(student.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"loss.temperature must be > 0, got {temperature}")


def forward_kl(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """KL(teacher || student) at temperature T, summed over positions where ``mask`` is True.

    The T² factor keeps gradient magnitudes comparable across temperatures (Hinton et al.), so T = 1 is plain KL.
    Computed in float32 whatever the logits' dtype: bf16 log-softmax over a large vocabulary loses the small
    differences the loss is about.
    """
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    return _fkl_core(log_q, log_p, temperature).sum(), n


def _fkl_core(log_q: Tensor, log_p: Tensor, temperature: float) -> Tensor:
    # F.kl_div(input, target) computes KL(target || input) with input = log q (student) and target = log p
    # (teacher, log_target=True): p * (log p - log q), summed over the vocabulary per row.
    return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) * temperature**2


def _select(student: Tensor, teacher: Tensor, mask: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """Masked rows in float32 at temperature T: (student log-probs, teacher log-probs, count). Selecting first: the
    softmax over V is the expensive part and padded / unmasked positions need none of it."""
    _check(student, teacher, mask, temperature)
    log_q = F.log_softmax(_rows(student, mask, temperature), dim=-1)
    log_p = F.log_softmax(_rows(teacher, mask, temperature), dim=-1)
    return log_q, log_p, _count(student, mask)


def _rows(logits: Tensor, mask: Tensor | None, temperature: float) -> Tensor:
    """The masked rows in float32, divided by T. ``mask=None``: every row, without the index copy (drafters pass
    rows already selected); T = 1 skips a pass over [N, V]."""
    rows = logits if mask is None else logits[mask.bool()]
    return rows.float() if temperature == 1 else rows.float() / temperature


def _count(logits: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return torch.tensor(logits.shape[:-1].numel(), device=logits.device)
    return mask.bool().sum()


def reverse_kl(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """KL(student || teacher): mode-seeking — the drafter concentrates on tokens the teacher likes most, which is
    what greedy acceptance rewards. T² scaled like ``forward_kl``."""
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    return _rkl_core(log_q, log_p, temperature).sum(), n


def _rkl_core(log_q: Tensor, log_p: Tensor, temperature: float) -> Tensor:
    # kl_div(input=log p, target=log q) = q * (log q - log p), summed over the vocabulary per row.
    return F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1) * temperature**2


def jsd(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0, beta: float = 0.5) -> tuple[Tensor, Tensor]:
    """Generalised Jensen-Shannon divergence (GKD / DistillSpec): β·KL(p || m) + (1-β)·KL(q || m), m = β·p + (1-β)·q,
    with p the teacher and q the student. β = 0.5 is the symmetric JSD; β interpolates between the two KLs' modes."""
    _check_beta(beta)
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    return _jsd_core(log_q, log_p, temperature, beta).sum(), n


def _check_beta(beta: float) -> None:
    if not 0 <= beta <= 1:
        raise ValueError(f"loss.beta must lie in [0, 1], got {beta}")


def _jsd_core(log_q: Tensor, log_p: Tensor, temperature: float, beta: float) -> Tensor:
    if beta in (0, 1):  # m equals one side: that side's term is 0 and the other is weighted 0
        return 0 * log_q.sum(-1)  # (still attached to the graph, so backward works)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    kl_pm = F.kl_div(log_m, log_p, log_target=True, reduction="none").sum(-1)
    kl_qm = F.kl_div(log_m, log_q, log_target=True, reduction="none").sum(-1)
    return (beta * kl_pm + (1 - beta) * kl_qm) * temperature**2


def total_variation(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """½·Σ|p − q| per position: for a one-token draft sampled from q, 1 − TV is exactly the acceptance probability of
    speculative sampling (Leviathan et al.), so minimising it targets α directly. Bounded, so no T² factor."""
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    return _tvd_core(log_q, log_p, temperature).sum(), n


def _tvd_core(log_q: Tensor, log_p: Tensor, temperature: float) -> Tensor:
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


def topk_forward_kl(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0, k: int = 32) -> tuple[Tensor, Tensor]:
    """KL(p_k || q) with p_k the teacher renormalised on its top-k tokens: only k (index, logit) pairs per position
    need storing offline. The student keeps its full-vocabulary softmax, so mass it puts elsewhere is penalised."""
    _check_k(k)
    _check(student, teacher, mask, temperature)
    log_q = F.log_softmax(_rows(student, mask, temperature), dim=-1)
    return _topk_core(log_q, _rows(teacher, mask, temperature), temperature, k).sum(), _count(student, mask)


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"loss.k must be >= 1, got {k}")


def _topk_core(log_q: Tensor, teacher_rows: Tensor, temperature: float, k: int) -> Tensor:
    """``teacher_rows``: the teacher's logits / T, or its log-probs (the same up to a per-row shift, which neither
    the top-k nor the renormalised softmax sees)."""
    top = teacher_rows.topk(min(k, teacher_rows.shape[-1]), dim=-1)
    log_pk = F.log_softmax(top.values, dim=-1)
    kl = (log_pk.exp() * (log_pk - log_q.gather(-1, top.indices))).sum(-1)
    return kl * temperature**2


def log_acceptance(log_q: Tensor, log_p: Tensor) -> Tensor:
    """log α per row, α = Σ_v min(p_v, q_v) = 1 − TV(p, q): the probability that speculative sampling accepts one
    token drawn from q when the target samples from p (Leviathan et al.). As a log-sum-exp of the elementwise
    minimum of the log-probs, so a row whose overlap underflows float32 still has a finite log α and gradient."""
    return torch.logsumexp(torch.minimum(log_q, log_p), dim=-1)


LK_VARIANTS = ("alpha", "lambda")


def lk(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0, variant: str = "alpha",
       eta: float = 3.0) -> tuple[Tensor, Tensor]:
    """LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding"): train
    the drafter on its acceptance α = Σ_v min(p_v, q_v) itself instead of on KL, its proxy. Per row, at temperature T
    (α is then the acceptance of sampling both at T):

    - ``variant="alpha"`` (LK^α): −log α. No hyperparameter; its gradient is TV's divided by α, so rows far from the
      teacher (small α, where TV's gradient vanishes) are not starved, and at a one-hot teacher it is cross-entropy.
    - ``variant="lambda"`` (LK^λ): λ·T²·KL(p || q) + (1 − λ)·TV(p, q) with λ = exp(−η·α), α detached: forward KL
      (this menu's, T² included) while the row is poorly matched, handing over to TV (exactly 1 − α) as α grows.
      ``eta`` ≥ 0 sets the hand-over (0: pure forward KL; the paper's default 3).

    Both are 0 exactly when q = p on the row and grow as q moves away."""
    _check_variant(variant)
    _check_eta(eta)
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    return _lk_core(log_q, log_p, temperature, variant, eta).sum(), n


def _check_variant(variant: str) -> None:
    if variant not in LK_VARIANTS:
        raise ValueError(f"loss.variant={variant!r} is not an LK loss; valid: {list(LK_VARIANTS)} (alpha: -log of the "
                         f"acceptance; lambda: forward KL handing over to TV as the acceptance grows)")


def _check_eta(eta: float) -> None:
    if not (isinstance(eta, (int, float)) and math.isfinite(eta) and eta >= 0):
        raise ValueError(f"loss.eta={eta} must be a finite number >= 0 (LK^lambda's KL weight is exp(-eta * alpha); "
                         f"the paper uses 3)")


def _lk_core(log_q: Tensor, log_p: Tensor, temperature: float, variant: str, eta: float) -> Tensor:
    if variant == "alpha":
        return -log_acceptance(log_q, log_p)
    kl, tv = _fkl_core(log_q, log_p, temperature), _tvd_core(log_q, log_p, temperature)
    lam = torch.exp(-eta * log_acceptance(log_q, log_p).detach().exp())
    return lam * kl + (1 - lam) * tv


# ``loss.base`` of ``acceptance_weighted``: the ``loss=`` preset names of the entries it can weight
WEIGHTED_BASES = {"fkl": forward_kl, "rkl": reverse_kl, "jsd": jsd, "tvd": total_variation,
                  "topk_fkl": topk_forward_kl, "lk": lk}


def acceptance_weighted(student: Tensor, teacher: Tensor, mask: Tensor | None, temperature: float = 1.0,
                        base: str = "fkl", base_kwargs: Mapping | None = None) -> tuple[Tensor, Tensor]:
    """Σ_rows a · D(p, q): the per-row divergence of the entry ``base`` (a ``loss=`` preset name: fkl, rkl, jsd, tvd,
    topk_fkl, lk; its own arguments in ``base_kwargs``, e.g. ``{beta: 0.3}``) times that row's acceptance
    a = Σ_v min(p_v, q_v) at temperature T, detached (a weight, not an objective). Rows the drafter already gets
    accepted weigh more than rows it has no chance on (PARD-2's confidence-adaptive token weights, D-PACE's
    acceptance-driven position weights: spend the capacity where acceptance can still be won).

    The weight is per row: the exact acceptance of this row's draft distribution, whatever draft position the row
    belongs to. The chain form (position k weighted by the product a_1 ... a_{k-1} of the earlier positions of the
    same anchor) is not offered: a loss sees one term's rows, and the drafters do not line rows up across terms (a
    Medusa head or an EAGLE step covers a different slice of positions, and Medusa evaluates each head inside its own
    call, before the later ones exist). Under Adam a uniform scale of the loss cancels, so a small mean a (early
    training) mostly changes the relative weights, not the step size."""
    core = row_divergence(functools.partial(acceptance_weighted, temperature=temperature, base=base,
                                            base_kwargs=base_kwargs))[0]
    log_q, log_p, n = _select(student, teacher, mask, temperature)
    return core(log_q, log_p).sum(), n


def _check_base(base: str) -> None:
    if base not in WEIGHTED_BASES:
        raise ValueError(f"loss.base={base!r} is not a divergence acceptance_weighted can weight; valid: "
                         f"{list(WEIGHTED_BASES)} (the loss= preset names)")


def _check_base_kwargs(base_kwargs) -> None:
    if base_kwargs is not None and not isinstance(base_kwargs, Mapping):
        raise ValueError(f"loss.base_kwargs={base_kwargs!r} must be a mapping of the base's arguments, e.g. "
                         f"loss.base_kwargs={{beta: 0.3}} for loss.base=jsd, or null")


def _base_entry(base: str, base_kwargs: Mapping | None, temperature: float) -> tuple[Callable, dict]:
    """(core, checked arguments) of the weighted base at the wrapper's temperature."""
    func = WEIGHTED_BASES[base]
    kwargs = dict(base_kwargs or {})
    valid = list(_CORES[func][1])
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"loss.base_kwargs has {unknown}, which loss.base={base} does not take; valid: {valid} "
                         f"(the temperature is the wrapper's own loss.temperature)")
    try:
        _, _, values = _menu_entry(functools.partial(func, temperature=temperature, **kwargs))
    except ValueError as err:
        raise ValueError(f"{err} (set in loss.base_kwargs, for loss.base={base})") from err
    return _CORES[func][0], values


def _weighted_core(log_q: Tensor, log_p: Tensor, temperature: float, base: tuple[Callable, dict]) -> Tensor:
    core, values = base
    weight = log_acceptance(log_q, log_p).detach().exp()
    return weight * core(log_q, log_p, temperature, **values)


def softmax_pair_(z_CV: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(log_softmax(z), softmax(z)) over the last dimension from one ``exp``: ``z_CV`` (float32) becomes the
    log-softmax in place, the softmax is one new tensor (or ``out``). ``logsumexp`` followed by ``exp`` of the result
    takes two passes of ``exp`` over [C, V] and two [C, V] temporaries inside ``logsumexp``; on a CPU at V 128k the
    ``exp`` passes are most of a loss chunk's element-wise time."""
    z_CV.sub_(z_CV.amax(dim=-1, keepdim=True))
    prob = torch.exp(z_CV, out=out) if out is not None else torch.exp(z_CV)
    total = prob.sum(dim=-1, keepdim=True)
    prob.div_(total)
    return z_CV.sub_(total.log_()), prob


def _fkl_fused(logits_CV: Tensor, log_p_CV: Tensor, temperature: float, p_CV: Tensor | None = None,
               q_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``_fkl_core(log_softmax(logits / T), log_p)`` (per row) and its gradient w.r.t. the logits, T·(q − p), by hand: four
    [C, V] float32 buffers (log q, q, log p, p) where autograd keeps six or seven, two ``exp`` passes when the
    teacher's ``p_CV`` comes with its log-probs (``TeacherRows.log_probs(probs=True)``), else three. The arguments are
    consumed (overwritten in place); ``q_out``, a buffer for q (the gradient is returned in it)."""
    z = logits_CV.float()
    if temperature != 1:
        z.div_(temperature)
    log_q, q = softmax_pair_(z, q_out)
    p = log_p_CV.exp() if p_CV is None else p_CV
    loss = log_p_CV.sub_(log_q).mul_(p).sum(-1) * temperature**2  # p (log p - log q) summed per row
    return loss, q.sub_(p).mul_(temperature)  # d/dz of T² KL(p || softmax(z / T)), p summing to 1


# The menu's functions -> (core, checks of its own keyword arguments): what ``row_divergence`` unwraps.
_CORES = {forward_kl: (_fkl_core, {}), reverse_kl: (_rkl_core, {}), total_variation: (_tvd_core, {}),
          jsd: (_jsd_core, {"beta": (0.5, _check_beta)}), topk_forward_kl: (_topk_core, {"k": (32, _check_k)}),
          lk: (_lk_core, {"variant": ("alpha", _check_variant), "eta": (3.0, _check_eta)}),
          acceptance_weighted: (_weighted_core, {"base": ("fkl", _check_base),
                                                 "base_kwargs": (None, _check_base_kwargs)})}


def _topk_fused(logits_CV: Tensor, log_p_CV: Tensor, temperature: float, k: int,
                p_CV: Tensor | None = None, q_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``_topk_core(log_softmax(logits / T), log_p)`` (per row) and its gradient w.r.t. the logits, T·(q − p_k) with p_k the
    teacher renormalised on its top k (scattered; it sums to 1), by hand like ``_fkl_fused``: the teacher's rows are
    reduced to k columns first and dropped, so two [C, V] float32 buffers remain. Both arguments are consumed."""
    top = log_p_CV.topk(min(k, log_p_CV.shape[-1]), dim=-1)
    del log_p_CV, p_CV
    log_pk = F.log_softmax(top.values, dim=-1)
    p_k = log_pk.exp()
    z = logits_CV.float()
    if temperature != 1:
        z.div_(temperature)
    log_q, q = softmax_pair_(z, q_out)
    loss = (p_k * (log_pk - log_q.gather(-1, top.indices))).sum(-1) * temperature**2
    del log_q, z
    return loss, q.scatter_add_(-1, top.indices, -p_k).mul_(temperature)


_FUSED = {forward_kl: _fkl_fused, topk_forward_kl: _topk_fused}  # divergences whose logit gradient is written by hand


def _menu_entry(loss_fn) -> tuple[Callable, float, dict] | None:
    """(menu function, temperature, its other keyword arguments, checked) for a menu loss given as the function or a
    ``functools.partial`` of it (what ``loss=`` instantiates); None for any other callable."""
    func, kwargs = (loss_fn.func, dict(loss_fn.keywords)) if isinstance(loss_fn, functools.partial) else (loss_fn, {})
    if isinstance(loss_fn, functools.partial) and loss_fn.args or func not in _CORES:
        return None
    temperature = kwargs.pop("temperature", 1.0)
    if not temperature > 0:
        raise ValueError(f"loss.temperature must be > 0, got {temperature}")
    values = {}
    for name, (default, check) in _CORES[func][1].items():
        values[name] = kwargs.pop(name, default)
        check(values[name])
    if kwargs:
        return None
    if func is acceptance_weighted:  # the base resolved and checked once, with the wrapper's temperature
        values = {"base": _base_entry(values["base"], values["base_kwargs"], temperature)}
    return func, temperature, values


@functools.lru_cache(maxsize=None)
def _compiled(func: Callable, compile_kw: tuple) -> Callable:
    """``func`` compiled once per process (and per ``torch.compile`` settings), its row count dynamic: every chunk
    of every term shares the graph."""
    return torch.compile(func, dynamic=True, **dict(compile_kw))


def fused_divergence(loss_fn, compile_kw: dict | None = None
                     ) -> tuple[Callable[..., tuple[Tensor, Tensor]], float] | None:
    """(fused(logits_CV, log_p_CV, p_CV=None, q_out=None) -> ([C] divergence per row, the gradient of their sum
    w.r.t. the logits: row r's is that row's own), temperature) for a menu loss with a hand-written gradient (forward KL, the default loss, and top-k forward KL);
    None for the others, which autograd differentiates (``lk`` and ``acceptance_weighted`` among them, whatever
    their base: the acceptance weight's minimum over p and q has no closed-form gradient written here). ``p_CV``: the teacher's probabilities, when its log-probs
    came with them (else computed where needed); ``q_out``: a [C, V] float32 buffer the gradient is written into.
    ``fused`` overwrites its arguments. ``compile_kw``: run it ``torch.compile``d with these arguments
    (``trainer.compile``)."""
    entry = _menu_entry(loss_fn)
    if entry is None or entry[0] not in _FUSED:
        return None
    func, temperature, values = entry
    fused = _FUSED[func] if compile_kw is None else _compiled(_FUSED[func], tuple(sorted(compile_kw.items())))
    return (lambda logits_CV, log_p_CV, p_CV=None, q_out=None:
            fused(logits_CV, log_p_CV, temperature, p_CV=p_CV, q_out=q_out, **values)), temperature


def row_divergence(loss_fn) -> tuple[Callable[[Tensor, Tensor], Tensor], float] | None:
    """(core(log_q, log_p) -> [C] divergence per row, temperature) for a menu loss given as the function or
    a ``functools.partial`` of it (what ``loss=`` instantiates); None for any other callable, which
    ``distill.chunked`` then calls on each chunk's logits instead."""
    entry = _menu_entry(loss_fn)
    if entry is None:
        return None
    func, temperature, values = entry
    core = _CORES[func][0]
    return (lambda log_q, log_p: core(log_q, log_p, temperature, **values)), temperature
