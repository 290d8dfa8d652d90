"""The drafter interface. Training: ``count_valid(batch)`` (summed over micro-batches and ranks before any forward)
is what forward normalises by, and each draft term's rows are exactly the positions ``train_mask(batch, k)`` selects,
under padding and partial loss masks. Decoding: every drafter kind is an ``inference.proposer.Proposer``."""

from __future__ import annotations

import pytest
import torch

from heads.base import build_drafter

DRAFTERS = {
    "medusa": {"_target_": "heads.medusa.MedusaHeads", "num_heads": 3, "num_layers": 1},
    "medusa2": {"_target_": "heads.medusa.Medusa2", "num_heads": 3, "num_layers": 1, "lora": {"r": 4, "alpha": 8},
                "heads_only_steps": 0},
    "eagle1": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "ttt_steps": 3},
    "eagle3": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "ttt_steps": 3, "draft_vocab_size": 96},
    "draft_model": {"_target_": "heads.draft_model.DraftModel", "source": "config"},
}
# How many tokens past position t draft term k predicts: Medusa head k + 1 and EAGLE step k read position t's
# features (and for EAGLE tokens up to t + 1 + k) and predict t + k + 2; the draft model predicts t + 1.
AHEAD = {"medusa": lambda k: k + 2, "medusa2": lambda k: k + 2, "eagle1": lambda k: k + 2,
         "eagle3": lambda k: k + 2, "draft_model": lambda k: 1}


def ragged_batch(B: int = 3, T: int = 14, seed: int = 0) -> dict:
    """Right-padded rows of different lengths whose loss masks cover only an answer span (a chat-style row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (B, T), generator=gen)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    for b, (length, start) in enumerate([(T, 5), (T - 4, 3), (7, 6)][:B]):
        attn[b, :length] = 1
        loss[b, start:length] = True
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


def bound(name: str, teacher):
    drafter = build_drafter(DRAFTERS[name], teacher)
    drafter.bind_target(teacher, initialize=True)
    if name == "eagle3":
        drafter.prepare(type("Rows", (), {k: v for k, v in ragged_batch(seed=1).items()})())
    return drafter


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_count_valid_is_what_forward_normalises_by(tiny_teacher, name):
    drafter = bound(name, tiny_teacher)
    batch = ragged_batch()
    out = drafter(batch, tiny_teacher(batch["input_ids"], batch["attention_mask"], drafter.teacher_layers))
    valid_BT = batch["loss_mask"] & batch["attention_mask"].bool()
    assert out.terms
    for k, term in enumerate(out.terms):
        # derived here from the data alone: one row per real, loss-bearing token term k predicts
        expected = int(valid_BT[:, AHEAD[name](k):].sum())
        assert int(term.mask_N.sum()) == int(drafter.train_mask(batch, k).sum()) == expected, f"term {k}"
        assert term.student_ND.shape[0] == term.mask_N.shape[0]  # one weight per row of the term's static slice
    assert int(drafter.count_valid(batch)) == int(out.terms[0].mask_N.sum()) == int(out.num_valid) > 0


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_masking_everything_leaves_nothing_to_train(tiny_teacher, name):
    drafter = bound(name, tiny_teacher)
    batch = ragged_batch()
    batch["loss_mask"][:] = False
    assert int(drafter.count_valid(batch)) == 0


@pytest.mark.parametrize("name", [*sorted(DRAFTERS), "lookup"])
def test_every_drafter_is_a_proposer(tiny_teacher, name):
    """The decoders type against ``inference.proposer.Proposer`` only: every drafter kind must provide all of it."""
    from inference.proposer import Proposer

    cfg = {"_target_": "heads.lookup.PromptLookup"} if name == "lookup" else DRAFTERS[name]
    drafter = build_drafter(cfg, tiny_teacher)
    assert isinstance(drafter, Proposer)
    assert isinstance(drafter.dynamic_tree, bool)


def test_the_base_type_a_new_kind_implements_stays_narrow():
    """``Drafter`` itself declares only what every kind must have; the optional hooks (training, decoding,
    persistence) live in mixins with defaults. docs/design.md ("Add a drafter") quotes this count."""
    from heads.base import Drafter

    own = sorted(k for k in vars(Drafter) if not k.startswith("__") or k == "__init__")
    assert own == ["__init__", "bind_target", "forward", "name", "observe", "propose", "reset", "teacher_layers",
                   "train_mask"]
    assert len(own) <= 12
