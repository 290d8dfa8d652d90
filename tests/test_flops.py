"""FLOP counts from shapes (``distill.flops``, ``heads.flops``) against ``torch.utils.flop_counter`` on real training
steps of every drafter kind, and the ``model`` attention convention against the reference masks' allowed pairs."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

import heads.eagle
from distill.flops import TargetShape, attention, causal_pairs
from distill.losses import forward_kl
from distill.teacher import Teacher
from heads.base import build_drafter
from heads.base import TargetDims
from heads.draft_model import DraftModel
from tests.drafters import NODES, tiny_llama

DIMS = TargetDims(hidden_size=32, vocab_size=128, num_layers=4)

aten = torch.ops.aten
# torch.utils.flop_counter's formulas, plus two it lacks: the in-place addmm_ (a chunked loss accumulates a trainable
# head's weight gradient with it) and a CPU's scaled_dot_product_attention, the flash-for-CPU op (the formulas of the
# GPU kernels: the whole [queries x keys] product per call).
FORMULAS = {**flop_registry, aten.addmm_: flop_registry[aten.addmm],
            aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(
                lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(
                lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v))}


class FlopCounter(TorchDispatchMode):
    """``FlopCounterMode``'s count without its module tracker, whose backward hooks refuse the ``autograd.grad`` a
    chunked loss runs inside a module's forward (Medusa heads)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = FORMULAS.get(func.overloadpacket)
        if formula is None:  # as FlopCounterMode: a composite op (e.g. linear under inference mode) decomposed
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out
MEDUSA2_NODE = {"_target_": "heads.medusa2.Medusa2", "num_heads": 3, "num_layers": 1, "heads_only_steps": 0}
KINDS = {**NODES, "eagle3_ttt1": {**NODES["eagle3"], "ttt_steps": 1}, "eagle3_full_vocab": {
    **NODES["eagle3"], "draft_vocab_size": None, "ttt_steps": 3}, "eagle1_ttt3": {**NODES["eagle1"], "ttt_steps": 3},
    "dflash_distill": {**NODES["dflash"], "objective": "distill"}, "medusa2": MEDUSA2_NODE,
    "eagle3": {**NODES["eagle3"], "ttt_steps": 3}, "peagle_full_vocab": {**NODES["peagle"], "draft_vocab_size": None}}


SIZES = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)  # grouped keys and values


def _teacher() -> Teacher:
    return Teacher(tiny_llama(initializer_range=0.2, **SIZES), tokenizer=None, name="tiny")


def _drafter(kind: str, teacher: Teacher):
    if kind == "draft_model":
        drafter = DraftModel(DIMS, model=tiny_llama(seed=1, **{**SIZES, "num_hidden_layers": 1}))
        drafter.bind_target(teacher, initialize=False)
        return drafter.train()
    torch.manual_seed(0)
    drafter = build_drafter(KINDS[kind], teacher)
    drafter.bind_target(teacher, initialize=True)
    return drafter.train()


def _step(teacher, drafter, batch, loss_fn) -> None:
    """One micro-batch as ``train.loop`` runs it: teacher signals, the drafter's forward with its loss, backward."""
    out = teacher.signals(batch, tuple(drafter.teacher_layers), dense=drafter.dense_teacher_logits)
    loss, _ = drafter(batch, out, loss_fn=loss_fn).loss(loss_fn)
    loss.backward()


def measured(teacher, drafter, B: int, T: int) -> float:
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, teacher.vocab_size, (B, T), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "row_seed": torch.arange(B)}
    loss_fn = functools.partial(forward_kl, temperature=1.0)
    _step(teacher, drafter, batch, loss_fn)  # first batch: the teacher's one-off read-out checks
    with FlopCounter() as counter:
        _step(teacher, drafter, batch, loss_fn)
    return counter.flops


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("T", [24, 64])
def test_dense_count_matches_the_flop_counter(kind, T, monkeypatch):
    # EAGLE's small-CPU attention path computes explicit scores whose per-step columns flop_counter cannot see: run
    # the fused kernel, which the dense convention describes.
    monkeypatch.setattr(heads.eagle, "EXPLICIT_ATTENTION_ELEMENTS", 0)
    teacher = _teacher()
    drafter = _drafter(kind, teacher)
    B = 2
    got = measured(teacher, drafter, B, T)
    want = drafter.train_flops(TargetShape.of(teacher), B, T).total.dense
    assert want == pytest.approx(got, rel=0.05), (kind, T, want / got)
