"""On-policy and mixed data (distill.onpolicy): the draft writes the continuations it learns from; the target is
only ever read. Plus the data-mode and loss checks ``train.config.validate`` runs before anything is built."""

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from distill.data import DataConfig, TokenBlockDataset, collate
from distill.losses import forward_kl
from distill.onpolicy import OnPolicyBatches
from heads.draft_model.model import DraftModel
from heads.medusa.model import MedusaHeads
from tests.drafters import DIMS, truncated
from train.config import Config, load_config, register_configs
from train.engine import SingleEngine, TrainerConfig
from train.loop import train

CONF = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()

DATA = DataConfig(mode="on_policy", on_policy_fraction=0.5, on_policy_prompt_tokens=6, on_policy_temperature=1.0)


def rows(n=8, T=16, seed=0):
    ids = torch.randint(0, 128, (n, T), generator=torch.Generator().manual_seed(seed))
    return TokenBlockDataset(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))


def draft(teacher):
    drafter = DraftModel(DIMS, model=truncated(teacher.model))
    drafter.bind_target(teacher, initialize=True)
    return drafter


def test_on_policy_rows_keep_the_prompt_and_learn_only_the_drafts_tokens(teacher):
    drafter = draft(teacher)
    source = OnPolicyBatches(drafter, DATA, seed=3)
    batch = collate([rows()[i] for i in range(4)])
    out = source(batch, number=5)
    assert torch.equal(out["input_ids"][:, :6], batch["input_ids"][:, :6])
    assert out["input_ids"].shape == batch["input_ids"].shape and out["attention_mask"].all()
    assert not out["loss_mask"][:, :6].any() and out["loss_mask"][:, 6:].all()
    # The continuation is the draft's own sample with the micro-batch's seeded generator: resume-exact.
    expected = drafter.sample_continuations(batch["input_ids"][:, :6], 10, 1.0,
                                            torch.Generator().manual_seed(3 * 1_000_003 + 5))
    assert torch.equal(out["input_ids"][:, 6:], expected)
    assert torch.equal(source(batch, number=5)["input_ids"], out["input_ids"])
    assert not torch.equal(out["input_ids"][:, 6:], batch["input_ids"][:, 6:])


def test_mixed_draws_about_the_fraction_deterministically(teacher):
    source = OnPolicyBatches(draft(teacher), replace(DATA, mode="mixed", on_policy_fraction=0.25), seed=0)
    picks = [source.is_on_policy(n) for n in range(400)]
    assert 60 <= sum(picks) <= 140 and picks == [source.is_on_policy(n) for n in range(400)]
    batch = collate([rows()[i] for i in range(2)])
    off = picks.index(False)
    assert all(torch.equal(source(batch, off)[k], batch[k]) for k in batch)  # off-policy micro-batches: data as is


def test_a_drafter_that_cannot_sample_is_refused(teacher):
    with pytest.raises(ValueError, match="data.mode=on_policy needs a drafter that samples.*drafter=medusa"):
        OnPolicyBatches(MedusaHeads(DIMS), DATA, seed=0)


class _NoLog:
    def log(self, *a, **k):
        pass


def test_on_policy_training_updates_the_draft_never_the_target(teacher, tmp_path):
    drafter = draft(teacher)
    target_before = copy.deepcopy(teacher.model.state_dict())
    draft_before = copy.deepcopy(drafter.model.state_dict())
    source = OnPolicyBatches(drafter, DATA, seed=0)
    cfg = Config(seed=0, trainer=TrainerConfig(device="cpu", bf16=False, steps=3, micro_batch_size=4, grad_accum=1,
                                               lr=1e-2, min_lr_ratio=0.1, warmup_steps=1, weight_decay=0.0,
                                               grad_clip=1.0, log_every=1, ckpt_every=100, keep_last=1,
                                               resume="never"))
    engine = SingleEngine(cfg.trainer)
    train(cfg, teacher, drafter, rows(), collate, forward_kl, engine, tmp_path, _NoLog(), batch_source=source)
    assert source.sampled == 3
    for name, tensor in teacher.model.state_dict().items():
        assert torch.equal(tensor, target_before[name]), name
    assert any(not torch.equal(t, draft_before[n]) for n, t in drafter.model.state_dict().items())


def load(overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["data.mode=onpolicy"], r"data.mode='onpolicy' is not a data mode; valid: \[.*'on_policy'"),
    (["data.mode=regenerated"], "data.mode=regenerated needs data.regenerated=<file.jsonl>"),
    (["data.regenerated=x.jsonl"], "data.mode=fixed ignores it"),
    (["data.mode=on_policy", "data.teacher_cache=/tmp/c"], "cannot use data.teacher_cache"),
    (["data.mode=on_policy", "data.packing=false"], "needs packed rows"),
    (["data.mode=mixed", "data.on_policy_prompt_tokens=256"], r"must lie in \[1, data.max_length=256\)"),
    (["data.mode=mixed", "data.on_policy_fraction=1.5"], r"data.on_policy_fraction=1.5 must lie in \[0, 1\]"),
    (["loss=jsd", "loss.beta=1.5"], r"loss.beta=1.5 must lie in \[0, 1\]"),
    (["loss=jsd", "loss.beta=-0.1"], r"loss.beta=-0.1 must lie in \[0, 1\]"),
    (["loss=topk_fkl", "loss.k=0"], "loss.k=0 must be >= 1"),
    (["loss=rkl", "loss.temperature=0"], "loss.temperature=0.* must be > 0"),
])
def test_bad_data_modes_and_loss_values_are_refused_at_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(load(overrides))


def test_valid_modes_pass():
    for overrides in (["data.mode=on_policy", "drafter=draft_model"], ["data.mode=mixed", "loss=jsd", "loss.beta=0.9"]):
        load_config(load(overrides))
