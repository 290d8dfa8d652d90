"""``trainer.compile``: the training step's regions compiled train to the same losses as eager, graph breaks are
counted and named, the regions are restored afterwards, and the settings are validated.

Fast tests trace with ``aot_eager`` (dynamo and AOT autograd, no code generation); the slow test compiles every
drafter kind with inductor, the backend users get."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict

import pytest
import torch

from distill.data import collate
from distill.losses import forward_kl
from distill.teacher import TargetConfig, Teacher
from heads.base import build_drafter
from tests.conftest import make_tiny_llama
from train.compile import compile_setting, compiled_regions, resolve_compile
from train.config import Config
from train.engine import SingleEngine, TrainerConfig
from train.logger import LoggerConfig, MetricsLogger
from train.loop import train

# Every trainable kind, test-sized (TTT > 1 for EAGLE, stacked layers for P-EAGLE and DFlash).
KINDS = {
    "eagle3": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle3", "layers": [0, 1, 2], "ttt_steps": 3,
               "draft_vocab_size": None},
    "eagle1": {"_target_": "heads.eagle.EagleDrafter", "variant": "eagle1", "layers": [-1], "ttt_steps": 2},
    "medusa": {"_target_": "heads.medusa.MedusaHeads", "num_heads": 2, "num_layers": 1},
    "medusa2": {"_target_": "heads.medusa.Medusa2", "num_heads": 2, "num_layers": 1, "lora": {"r": 4, "alpha": 8},
                "heads_only_steps": 5},
    "dflash": {"_target_": "heads.dflash.DFlashDrafter", "block_size": 4, "num_anchors": 4, "num_layers": 2},
    "dflash2": {"_target_": "heads.dflash2.DFlash2Drafter", "block_size": 4, "num_anchors": 4, "num_layers": 2,
                "conv_group_size": 8, "selector_top_k": 4, "selector_rank": 8, "selector_warmup_steps": 3},
    "peagle": {"_target_": "heads.peagle.PEagleDrafter", "layers": [0, 1, 2], "num_depths": 3,
               "draft_vocab_size": None, "num_layers": 2},
    "draft_model": {"_target_": "heads.draft_model.DraftModel"},
}


def _config(node: dict, steps: int, **trainer) -> Config:
    t = dict(engine="single", device="cpu", steps=steps, micro_batch_size=2, grad_accum=1, lr=1e-2, min_lr_ratio=0.1,
             warmup_steps=2, weight_decay=0.0, grad_clip=1.0, bf16=False, log_every=1, ckpt_every=10**6, keep_last=1,
             resume="never", select="last", eval_every=0)
    t.update(trainer)
    return Config(trainer=TrainerConfig(**t), drafter=node, target=TargetConfig(source="toy", name="tiny-llama"),
                  seed=0, logger=LoggerConfig(name="none"))


def _rows(n: int = 16, T: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 128, (T,), generator=g), "attention_mask": torch.ones(T, dtype=torch.long),
             "loss_mask": torch.ones(T, dtype=torch.bool)} for _ in range(n)]


def train_losses(tmp_path, node: dict, steps: int = 20, **trainer) -> tuple[list[float], dict, object]:
    """(the logged loss of every step, the final metrics, the trained drafter) of a fresh run on a fresh target."""
    cfg = _config(node, steps, **trainer)
    teacher = Teacher(make_tiny_llama(), tokenizer=None, name="tiny-llama")
    torch.manual_seed(0)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    logger = MetricsLogger(tmp_path, cfg.logger, asdict(cfg), resumed=False)
    try:
        last = train(cfg, teacher, drafter, _rows(), collate, functools.partial(forward_kl),
                     SingleEngine(cfg.trainer), tmp_path, logger)
    finally:
        logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r], last, drafter


# DFlash2's selector codebooks have rows whose gradients are near zero (ids that are rarely a candidate): Adam moves
# such a row by about lr whatever the rounding of its tiny gradient, so the two kernels' last-bit differences grow
# faster than in the other kinds (1.1e-3 relative by the 20th step here).
TOLERANCE = {"dflash2": 3e-3}


def _assert_same_losses(eager: list[float], compiled: list[float], tolerance: float = 1e-4) -> None:
    assert len(eager) == len(compiled) == 20
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager, compiled))
    assert worst <= tolerance, f"compiled losses differ from eager by {worst:.2e} relative (eager {eager}, compiled {compiled})"


def test_compiled_eagle3_trains_to_eager_losses_without_graph_breaks(tmp_path):
    eager, _, _ = train_losses(tmp_path / "eager", KINDS["eagle3"], compile="off")
    compiled, last, drafter = train_losses(tmp_path / "compiled", KINDS["eagle3"], compile="on",
                                           compile_backend="aot_eager")
    _assert_same_losses(eager, compiled)
    assert last["compile/regions"] == 3 and last["compile/graph_breaks"] == 0
    assert "_layer_input" not in vars(drafter) and "qkv" not in vars(drafter.layer)  # restored after training


def test_compiled_eagle31_norms_train_to_eager_losses_without_graph_breaks(tmp_path):
    node = {**KINDS["eagle3"], "fc_norm": True, "norm_output": True, "sliding_window": 6}
    eager, _, _ = train_losses(tmp_path / "eager", node, compile="off")
    compiled, last, drafter = train_losses(tmp_path / "compiled", node, compile="on", compile_backend="aot_eager")
    _assert_same_losses(eager, compiled)
    assert last["compile/regions"] == 5 and last["compile/graph_breaks"] == 0
    assert "_first_hidden" not in vars(drafter) and "_output" not in vars(drafter)  # restored after training


def test_eager_runs_report_no_compilation(tmp_path):
    _, last, _ = train_losses(tmp_path, KINDS["medusa"], steps=3, compile="off")
    assert not any(k.startswith("compile/") for k in last)
    assert 0 <= last["perf/data_wait_s"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_trains_compiled_by_inductor_to_eager_losses(tmp_path, kind, capsys):
    eager, _, _ = train_losses(tmp_path / "eager", KINDS[kind], compile="off")
    compiled, last, _ = train_losses(tmp_path / "compiled", KINDS[kind], compile="on")
    _assert_same_losses(eager, compiled, TOLERANCE.get(kind, 1e-4))
    with capsys.disabled():
        print(f"\n{kind}: {last['compile/regions']} regions, {last['compile/graphs']} graphs, "
              f"{last['compile/graph_breaks']} graph breaks, first step {last['compile/first_step_s']:.1f} s")
    assert last["compile/graph_breaks"] == 0


class _Breaking:
    """A region with a graph break in it (a print, which dynamo cannot trace), to see it counted and named."""

    def step(self, x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1


def test_a_graph_break_in_a_region_is_counted_and_named(caplog):
    torch._dynamo.reset()
    owner = _Breaking()
    with caplog.at_level(logging.INFO, logger="train.compile"):
        with compiled_regions([(owner, "step")], True, backend="aot_eager") as report:
            assert torch.equal(owner.step(torch.ones(3)), torch.full((3,), 3.0))
            report.log_first_step(0.1)
    assert sum(report.graph_breaks.values()) == 1
    assert any("graph break x1" in r.message for r in caplog.records)
    assert "step" not in vars(owner)  # restored


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("on", "on"), (True, "on"), ("false", "off")])
def test_compile_setting_reads_auto_on_off_and_booleans(value, expected):
    assert compile_setting(value) == expected


def test_compile_setting_refuses_an_unknown_value_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer.compile='fast'.*valid"):
        compile_setting("fast")


def test_auto_compiles_on_cuda_only_and_zero3_is_refused_or_skipped():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not resolve_compile("auto", cpu, "single", 2)
    assert resolve_compile("auto", cuda, "single", 2) and resolve_compile("on", cpu, "ddp", 2)
    assert not resolve_compile("auto", cuda, "deepspeed", 3)
    with pytest.raises(ValueError, match="trainer.compile=on cannot run under DeepSpeed ZeRO-3"):
        resolve_compile("on", cuda, "deepspeed", 3)


class _Doubling:
    def step(self, x):
        return x * 2


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


def test_under_auto_a_region_that_fails_to_compile_runs_eagerly_and_under_on_it_stops():
    torch._dynamo.reset()
    owner = _Doubling()
    with compiled_regions([(owner, "step")], True, backend=_failing_backend, strict=False):
        assert torch.equal(owner.step(torch.ones(2)), torch.full((2,), 2.0))
    torch._dynamo.reset()
    with compiled_regions([(owner, "step")], True, backend=_failing_backend, strict=True):
        with pytest.raises(Exception, match="cannot compile anything"):
            owner.step(torch.ones(2))
    assert not torch._dynamo.config.suppress_errors  # restored
