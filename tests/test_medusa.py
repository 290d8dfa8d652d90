import functools

import pytest
import torch

from distill.losses import forward_kl
from distill.teacher import Teacher
from heads.base import build_drafter
from heads.saved import load_drafter, save_drafter
from tests.conftest import make_tiny_llama

MEDUSA = {"_target_": "heads.medusa.MedusaHeads", "num_heads": 3, "num_layers": 2, "loss_decay": 0.8}
TARGET_CFG = {"source": "toy", "name": "tiny-llama"}


def make_batch(T=24, B=2, seed=0):
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(B, T, dtype=torch.bool)}


def fresh_medusa(teacher, cfg=MEDUSA):
    drafter = build_drafter(cfg, teacher)
    drafter.bind_target(teacher, initialize=True)
    return drafter


def test_heads_have_separate_weights_and_start_at_lm_head(tiny_teacher):
    drafter = fresh_medusa(tiny_teacher)
    ptrs = {p.data_ptr() for p in drafter.parameters()}
    assert len(ptrs) == len(list(drafter.parameters()))  # no `[block] * n` sharing
    hidden = torch.randn(1, 5, 32)
    for logits in drafter.head_logits(hidden):  # zero-init blocks: every head starts as the target's lm_head
        torch.testing.assert_close(logits, tiny_teacher.lm_head(hidden))


def test_head_k_is_aligned_with_teacher_position_t_plus_k(tiny_teacher):
    drafter = fresh_medusa(tiny_teacher)
    batch = make_batch(T=10, B=1)
    out = drafter(batch, tiny_teacher(batch["input_ids"], None, drafter.teacher_layers))
    teacher_logits = tiny_teacher(batch["input_ids"]).logits_BTV[0]
    for i, term in enumerate(out.terms):  # head k = i + 1 at t -> teacher at t + k, t in [0, T - k - 1)
        torch.testing.assert_close(term.teacher_NV, teacher_logits[i + 1 : 10 - 1])
        assert term.weight == pytest.approx(0.8**i)
    assert int(out.num_valid) == out.terms[0].student_NV.shape[0] == 8


def test_loss_mask_selects_positions(tiny_teacher):
    drafter = fresh_medusa(tiny_teacher)
    batch = make_batch(T=12, B=1)
    batch["loss_mask"][:, :8] = False  # only tokens 8..11 are learnable
    out = drafter(batch, tiny_teacher(batch["input_ids"], None, drafter.teacher_layers))
    # head k at t predicts t + k + 1: head 1 trains t in 6..9, head 2 t in 5..8, head 3 t in 4..7; every other
    # row of the term's slice weighs 0
    assert [t.mask_N.nonzero().squeeze(1).tolist() for t in out.terms] == [[6, 7, 8, 9], [5, 6, 7, 8], [4, 5, 6, 7]]
    assert [t.student_NV.shape[0] for t in out.terms] == [10, 9, 8]  # every position t < T - k - 1


def test_gradients_reach_heads_but_never_the_target(tiny_teacher):
    drafter = fresh_medusa(tiny_teacher)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    batch = make_batch()
    out = drafter(batch, tiny_teacher(batch["input_ids"], batch["attention_mask"], drafter.teacher_layers))
    loss, n = out.loss(functools.partial(forward_kl, temperature=1.0))
    (loss / n).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert all(not p.requires_grad and p.grad is None for p in tiny_teacher.model.parameters())


def test_save_load_round_trip(tiny_teacher, tmp_path):
    drafter = fresh_medusa(tiny_teacher)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p))
    save_drafter(drafter, tmp_path / "d", MEDUSA, TARGET_CFG, tiny_teacher.identity())
    loaded = load_drafter(tmp_path / "d", tiny_teacher)
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    hidden = torch.randn(1, 3, 32)
    for x, y in zip(drafter.head_logits(hidden), loaded.head_logits(hidden)):
        torch.testing.assert_close(x, y)


def test_load_refuses_a_target_of_other_sizes(tiny_teacher, tmp_path):
    save_drafter(fresh_medusa(tiny_teacher), tmp_path / "d", MEDUSA, TARGET_CFG, tiny_teacher.identity())
    other = Teacher(make_tiny_llama(vocab_size=96), None, name="other")
    with pytest.raises(ValueError, match="vocab_size=128.*vocab_size=96"):
        load_drafter(tmp_path / "d", other)


def test_load_errors_name_the_problem(tiny_teacher, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path / "nothing", tiny_teacher)
    save_drafter(fresh_medusa(tiny_teacher), tmp_path / "d", MEDUSA, TARGET_CFG, tiny_teacher.identity())
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(tmp_path / "d", tiny_teacher)


def test_bad_constructor_values(tiny_teacher):
    with pytest.raises(ValueError, match="drafter.num_heads must be >= 1, got 0"):
        build_drafter({**MEDUSA, "num_heads": 0}, tiny_teacher)
