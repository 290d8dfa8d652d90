"""Checkpoint/resume through the real loop: a killed run resumes to exactly where an uninterrupted one ends."""

import functools
from dataclasses import asdict

import pytest
import torch

from distill.data import collate
from distill.losses import forward_kl
from distill.teacher import TargetConfig
from heads.base import build_drafter
from train import checkpoint
from train.config import Config
from train.engine import SingleEngine, TrainerConfig
from train.logger import LoggerConfig, MetricsLogger
from train.loop import BatchOrder, train

MEDUSA = {"_target_": "heads.medusa.MedusaHeads", "num_heads": 2, "num_layers": 1, "loss_decay": 0.8}
# DFlash draws random anchors (4 of a row's 14): a resume must draw the ones the uninterrupted run draws.
DFLASH = {"_target_": "heads.dflash.DFlashDrafter", "block_size": 4, "num_anchors": 4}
PEAGLE = {"_target_": "heads.peagle.PEagleDrafter", "layers": [0, 1, 2], "num_depths": 3, "draft_vocab_size": None}


def make_cfg(drafter=MEDUSA, **trainer) -> Config:
    t = {"engine": "single", "device": "cpu", "steps": 6, "micro_batch_size": 2, "grad_accum": 2, "lr": 1e-2,
         "min_lr_ratio": 0.1, "warmup_steps": 2, "weight_decay": 0.0, "grad_clip": 1.0, "bf16": False,
         "log_every": 1, "ckpt_every": 3, "keep_last": 2, "resume": "auto", "num_threads": None}
    t.update(trainer)
    return Config(trainer=TrainerConfig(**t), drafter=drafter, target=TargetConfig(source="toy", name="tiny-llama"),
                  seed=0, logger=LoggerConfig(name="none"))


def make_dataset(n=10, T=16):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 128, (T,), generator=g), "attention_mask": torch.ones(T, dtype=torch.long),
             "loss_mask": torch.ones(T, dtype=torch.bool)} for _ in range(n)]


class Killed(Exception):
    pass


class DyingEngine(SingleEngine):
    """Dies at the start of optimizer step number ``die_at`` (0-based), like a pre-empted job."""

    def __init__(self, cfg, die_at):
        super().__init__(cfg)
        self.calls, self.die_at = 0, die_at

    def step(self, *args, **kwargs):
        if self.calls == self.die_at:
            raise Killed()
        self.calls += 1
        return super().step(*args, **kwargs)


def run(teacher, run_dir, cfg, engine=None):
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    logger = MetricsLogger(run_dir, cfg.logger, asdict(cfg), resumed=(run_dir / "metrics.jsonl").exists())
    try:
        train(cfg, teacher, drafter, make_dataset(), collate, functools.partial(forward_kl), engine or SingleEngine(cfg.trainer),
              run_dir, logger)
    finally:
        logger.close()
    return drafter


@pytest.mark.parametrize("drafter", [MEDUSA, DFLASH, PEAGLE], ids=["medusa", "dflash", "peagle"])
def test_kill_and_resume_matches_uninterrupted(tiny_teacher, tmp_path, drafter):
    cfg = make_cfg(drafter)
    reference = run(tiny_teacher, tmp_path / "a", cfg)
    with pytest.raises(Killed):
        run(tiny_teacher, tmp_path / "b", cfg, DyingEngine(cfg.trainer, die_at=4))
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == "step_0000003"
    resumed = run(tiny_teacher, tmp_path / "b", cfg)
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    # The loss curve after the resume point matches too.
    def losses(path):
        import json
        return {r["step"]: r["train/loss"] for r in map(json.loads, path.read_text().splitlines())}
    ref_curve, res_curve = losses(tmp_path / "a" / "metrics.jsonl"), losses(tmp_path / "b" / "metrics.jsonl")
    assert ref_curve.keys() == res_curve.keys()
    for step in ref_curve:
        assert ref_curve[step] == pytest.approx(res_curve[step], abs=1e-5)


def test_keep_last_prunes_old_checkpoints(tiny_teacher, tmp_path):
    run(tiny_teacher, tmp_path, make_cfg(steps=9, ckpt_every=2, keep_last=2))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert kept == ["step_0000008", "step_0000009"]  # every 2 steps, plus the final one


def test_rerunning_a_finished_run_trains_nothing_more(tiny_teacher, tmp_path):
    cfg = make_cfg()
    first = run(tiny_teacher, tmp_path, cfg)
    again = run(tiny_teacher, tmp_path, cfg)
    for a, b in zip(first.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_resume_refuses_another_drafter(tiny_teacher, tmp_path):
    cfg = make_cfg()
    with pytest.raises(Killed):
        run(tiny_teacher, tmp_path, cfg, DyingEngine(cfg.trainer, die_at=4))
    other = make_cfg()
    other.drafter = {**MEDUSA, "num_heads": 3}
    with pytest.raises(ValueError, match="another drafter"):
        run(tiny_teacher, tmp_path, other)


def test_corrupt_checkpoint_is_an_error_not_a_fresh_start(tiny_teacher, tmp_path):
    cfg = make_cfg()
    with pytest.raises(Killed):
        run(tiny_teacher, tmp_path, cfg, DyingEngine(cfg.trainer, die_at=4))
    state = tmp_path / "checkpoints" / "step_0000003" / checkpoint.STATE
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(RuntimeError, match="unreadable"):
        run(tiny_teacher, tmp_path, cfg)


def test_batch_order_is_deterministic_and_covers_each_epoch():
    order = BatchOrder(10, 3, seed=1)
    epoch0 = [i for m in range(3) for i in order.indices(m)]
    assert len(set(epoch0)) == 9  # no duplicates within an epoch
    assert BatchOrder(10, 3, seed=1).indices(4) == order.indices(4)
    with pytest.raises(ValueError, match="micro_batch_size"):
        BatchOrder(2, 3, seed=0)


class GradSpyEngine(SingleEngine):
    """Records the gradient the optimizer is about to apply (after the loop's per-token normalisation)."""

    def step(self, optimizer, grad_clip):
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.grads = [p.grad.clone() for p in params]
        optimizer.zero_grad(set_to_none=True)
        return torch.zeros(())


def test_accumulated_gradient_is_the_mean_over_all_valid_tokens(tiny_teacher, tmp_path):
    """Micro-batches with very different valid-token counts weigh each token equally, not each micro-batch."""
    data = make_dataset(n=2)
    data[0]["loss_mask"][:12] = False  # 4 learnable tokens vs 16
    cfg = make_cfg(steps=1, micro_batch_size=1, grad_accum=2, ckpt_every=100, resume="never")
    torch.manual_seed(0)
    drafter = build_drafter(MEDUSA, tiny_teacher)
    drafter.bind_target(tiny_teacher, initialize=True)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    reference = {k: v.clone() for k, v in drafter.state_dict().items()}
    engine = GradSpyEngine(cfg.trainer)
    logger = MetricsLogger(tmp_path, cfg.logger, asdict(cfg))
    train(cfg, tiny_teacher, drafter, data, collate, forward_kl, engine, tmp_path, logger)
    logger.close()

    drafter.load_state_dict(reference)  # the spy never stepped, but be explicit
    batch = collate(data)
    out = drafter(batch, tiny_teacher(batch["input_ids"], batch["attention_mask"], drafter.teacher_layers))
    loss_sum, n = out.loss(forward_kl)
    drafter.zero_grad()
    (loss_sum / n).backward()
    for spied, p in zip(engine.grads, [p for p in drafter.parameters() if p.grad is not None]):
        torch.testing.assert_close(spied, p.grad, rtol=1e-4, atol=1e-6)
