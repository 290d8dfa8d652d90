"""A training step at sequence 2048 allocates no [seq, seq] tensor: no mask (bool, seq x seq elements or more) and no
score matrix (last two dims both >= seq), for every drafter kind: the teacher's forward, the drafter's forward, its
loss and its backward, recorded op by op. The dense kernel (``trainer.attention=dense``) and the masked HF forward
are shown to trip the same probe."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import heads.eagle.model
from distill.losses import forward_kl
from distill.teacher import Teacher
from heads.base import build_drafter
from heads.draft_model.model import DraftModel
from heads.train_attention import train_attention
from tests.drafters import DFLASH_NODE, DIMS, EAGLE1_NODE, EAGLE3_NODE, MEDUSA_NODE, PEAGLE_NODE, tiny_llama

SEQ = 2048
KL = functools.partial(forward_kl, temperature=1.0)
LAYERS = {"layers": [1, 2, 2]}  # three feature layers of the 2-layer tiny target
NODES = {
    "medusa": MEDUSA_NODE,
    "medusa2": {"_target_": "heads.medusa.Medusa2", "num_heads": 3, "num_layers": 1, "tree": "small",
                "lora": {"r": 4, "alpha": 8}, "heads_only_steps": 0},
    "eagle1": EAGLE1_NODE,
    "eagle3": {**EAGLE3_NODE, **LAYERS},  # training-time test: 7 steps
    "dflash": {**DFLASH_NODE, "sliding_window": 1024},  # 512 anchors: 3072 block queries
    "peagle": {**PEAGLE_NODE, **LAYERS, "num_layers": 2},
    "draft_model": None,
}


class SquareProbe(TorchDispatchMode):
    """Records every tensor an op produces whose storage holds seq x seq elements or more and which is a mask (bool)
    or a matrix over two sequence axes (last two dims >= seq). Views of smaller storage (an expanded row) are not
    allocations and are not recorded."""

    def __init__(self, seq: int):
        super().__init__()
        self.seq, self.found, self.backward_ops = seq, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.backward_ops += "backward" in func.__name__
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.dim() < 2:
                continue
            big = t.untyped_storage().nbytes() >= self.seq * self.seq * t.element_size()
            square = t.shape[-1] >= self.seq and t.shape[-2] >= self.seq
            if big and (t.dtype == torch.bool or square):
                self.found.append(f"{func.__name__} -> {t.dtype} {tuple(t.shape)}")
        return out


def right_padded_batch(B=1, T=SEQ, pad=40):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[:, T - pad:] = 0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.bool()}


def drafter_for(kind: str, teacher: Teacher, **overrides):
    torch.manual_seed(0)
    if kind == "draft_model":
        drafter = DraftModel(DIMS, model=tiny_llama(seed=1, num_hidden_layers=1, max_position_embeddings=4096))
    else:
        drafter = build_drafter({**NODES[kind], **overrides}, teacher)
    drafter.bind_target(teacher, initialize=True)
    drafter.train()
    drafter.begin_step(0)
    return drafter


def step(kind: str, **overrides) -> SquareProbe:
    """One training step of ``kind`` at SEQ under the probe: the teacher's forward, the drafter's, loss, backward."""
    teacher = Teacher(tiny_llama(max_position_embeddings=4096), tokenizer=None, name="tiny")
    drafter = drafter_for(kind, teacher, **overrides)
    data = right_padded_batch()
    probe = SquareProbe(SEQ)
    with probe:
        signals = teacher.signals(data, drafter.teacher_layers, dense=drafter.dense_teacher_logits)
        total, n = drafter(data, signals).loss(KL)
        (total / n).backward()
    return probe


@pytest.mark.parametrize("kind", list(NODES))
def test_a_training_step_allocates_no_square_tensor(kind, monkeypatch):
    explicit = []  # EAGLE's explicit-scores CPU path holds [T, T + j] scores: never chosen at this length
    monkeypatch.setattr(heads.eagle.model, "explicit_ttt_attention", lambda *a: explicit.append(1))
    probe = step(kind)
    assert probe.backward_ops > 0  # the backward ran under the probe too
    assert not probe.found, probe.found[:5]
    assert not explicit


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "dflash", "peagle"])
def test_the_dense_kernel_trips_the_probe(kind):
    with train_attention("dense"):
        probe = step(kind, **({"ttt_steps": 2} if kind == "eagle3" else {}))  # 2 steps show it; 7 take long dense
    assert any(f.endswith(f"{SEQ}, {SEQ})") or "bool" in f for f in probe.found), probe.found[:5]


def test_the_masked_hf_forward_trips_the_probe():
    """What the teacher's forward did with the rows' mask: HF builds a [B, 1, T, T] mask for right-padded rows."""
    teacher = Teacher(tiny_llama(max_position_embeddings=4096), tokenizer=None, name="tiny")
    data = right_padded_batch()
    probe = SquareProbe(SEQ)
    with probe:
        teacher(data["input_ids"], data["attention_mask"], layers=(1,))
    assert any("bool" in f for f in probe.found), probe.found
