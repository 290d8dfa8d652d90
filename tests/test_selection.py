"""trainer.select=best_tau: the weights with the best held-out τ become drafter/, and a resume keeps the selection."""

import functools
import json
import os
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from distill.data import TokenBlockDataset, collate
from distill.losses import forward_kl
from heads.base import build_drafter
from heads.saved import WEIGHTS
from train import checkpoint
from train.engine import SingleEngine
from train.logger import MetricsLogger
from train.loop import train
from train.selection import BEST_DIR, HeldoutTau, Selection
from tests.test_checkpoint import DyingEngine, Killed, make_cfg, make_dataset


class ScriptedTau:
    """A held-out τ that is a fixed function of the step, recording the weights it saw at each evaluation."""

    def __init__(self, taus):
        self.taus, self.seen = taus, {}

    def __call__(self, step, model, drafter, loss_fn, engine):
        self.seen[step] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        return self.taus[step]


def run(teacher, run_dir, cfg, taus, engine=None, select="best_tau"):
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    scripted = ScriptedTau(taus)
    selection = Selection(scripted, select, run_dir, {"drafter_cfg": cfg.drafter, "target_cfg": asdict(cfg.target),
                                                      "target_identity": teacher.identity()})
    logger = MetricsLogger(run_dir, cfg.logger, asdict(cfg), resumed=(run_dir / "metrics.jsonl").exists())
    try:
        train(cfg, teacher, drafter, make_dataset(), collate, functools.partial(forward_kl),
              engine or SingleEngine(cfg.trainer), run_dir, logger, selection=selection)
    finally:
        logger.close()
    return selection, scripted


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


PEAK_AT_2 = {1: 1.0, 2: 2.0, 3: 1.2, 4: 1.5, 5: 1.4, 6: 1.1}  # the best before the step-3 checkpoint
PEAK_AT_4 = {1: 1.0, 2: 1.5, 3: 1.2, 4: 2.0, 5: 1.9, 6: 1.1}  # the best after it, before the kill


@pytest.mark.parametrize("taus", [PEAK_AT_2, PEAK_AT_4], ids=["best-before-checkpoint", "best-after-checkpoint"])
def test_best_tau_weights_are_selected_and_survive_a_resume(tiny_teacher, tmp_path, taus):
    cfg = make_cfg(eval_every=1)  # 6 steps, a checkpoint every 3
    best = max(taus, key=taus.get)
    reference, seen = run(tiny_teacher, tmp_path / "a", cfg, taus)
    assert (reference.best_step, reference.best_tau) == (best, taus[best])
    assert_same(reference.final_weights(), seen.seen[best])  # the best step's weights, not the last step's
    assert json.loads((tmp_path / "a" / BEST_DIR / "config.json").read_text())["step"] == best
    with pytest.raises(AssertionError):
        assert_same(reference.final_weights(), seen.seen[6])
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/heldout_sim_tau"] for r in rows] == [taus[s] for s in range(1, 7)]

    # Killed after five steps: the run dir's best_tau/ is the one of step 4 or earlier; the resume starts at step 3.
    with pytest.raises(Killed):
        run(tiny_teacher, tmp_path / "b", cfg, taus, DyingEngine(cfg.trainer, die_at=5))
    assert checkpoint.saved_selection(tmp_path / "b" / "checkpoints" / "step_0000003")["best_step"] == 2
    resumed, _ = run(tiny_teacher, tmp_path / "b", cfg, taus)
    assert (resumed.best_step, resumed.best_tau) == (best, taus[best])
    assert_same(resumed.final_weights(), reference.final_weights())


def test_select_last_keeps_the_last_weights_but_logs_the_evaluation(tiny_teacher, tmp_path):
    selection, _ = run(tiny_teacher, tmp_path, make_cfg(eval_every=2), PEAK_AT_2, select="last")
    assert selection.final_weights() is None and not (tmp_path / BEST_DIR).exists()
    assert selection.best_step == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/heldout_sim_tau" in r] == [1, 3, 5]  # after steps 2, 4, 6


def test_heldout_tau_is_a_tau_and_leaves_training_state_alone(tiny_teacher):
    cfg = make_cfg()
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, tiny_teacher)
    drafter.bind_target(tiny_teacher, initialize=True)
    rows = make_dataset(n=5)
    dataset = TokenBlockDataset(torch.stack([r["input_ids"] for r in rows]), torch.stack([r["attention_mask"] for r in rows]),
                                torch.stack([r["loss_mask"] for r in rows]))
    engine = SingleEngine(cfg.trainer)
    model, _ = engine.setup(drafter, lambda groups: torch.optim.SGD(groups, lr=0.1))
    model.train()
    rng = torch.get_rng_state()
    tau = HeldoutTau(tiny_teacher, dataset, batch_size=2, depth=None)(1, model, drafter, forward_kl, engine)
    assert 1.0 <= tau <= 1.0 + drafter.num_heads
    assert model.training and torch.equal(rng, torch.get_rng_state())
    again = HeldoutTau(tiny_teacher, dataset, batch_size=5, depth=None)(1, model, drafter, forward_kl, engine)
    assert again == pytest.approx(tau)  # the batch size does not change the figure


def test_python_m_train_writes_drafter_from_the_best_heldout_tau(tmp_path, tiny_toy_target):
    from tests.test_reliability_run import compose_cfg
    from train.run import run_training

    # The session's cache, where tiny_toy_target built the target once (a cache of its own would build it again).
    cfg = compose_cfg(os.environ["SPECDRAFT_CACHE"], "trainer.eval_every=2", "trainer.eval_rows=2")
    run_training(cfg, tmp_path / "run")
    best = json.loads((tmp_path / "run" / BEST_DIR / "config.json").read_text())
    final = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())["training"]["final"]
    assert final["selected_step"] == best["step"] in (2, 4)
    assert final["selected_heldout_sim_tau"] == best["heldout_sim_tau"] == final["eval/best_heldout_sim_tau"]
    assert_same(load_file(str(tmp_path / "run" / "drafter" / WEIGHTS)), load_file(str(tmp_path / "run" / BEST_DIR / WEIGHTS)))


@pytest.mark.parametrize("overrides,match", [
    (["trainer.select=best"], r"trainer.select='best'; valid: \['last', 'best_tau'\]"),
    (["trainer.eval_every=0"], r"trainer.select=best_tau needs the held-out evaluation"),
    (["trainer.eval_rows=0"], r"trainer.eval_rows=0 >= 1"),
    (["data.mode=regenerate", "target.shard=fsdp"], r"data.mode=regenerate .*\(target.shard=fsdp\) cannot"),
])
def test_selection_and_regenerate_settings_are_checked_at_start_up(overrides, match):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from train.config import load_config, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(ValueError, match=match):
        load_config(cfg)
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        assert load_config(compose(config_name="config", overrides=["trainer.select=last", "trainer.eval_every=0"]))
