"""Trainer presets, the generated DeepSpeed JSON, batch arithmetic over ranks, and the bad inputs a multi-GPU run
meets: each fails before training with the key, the value and the fix, and no run silently starts over."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from distill.fingerprint import write_digest
from distill.teacher import Teacher
from heads.base import build_drafter
from tests.conftest import make_tiny_llama
from tests.test_checkpoint import DyingEngine, Killed, make_cfg, run
from train import checkpoint
from train.config import load_config, register_configs
from train.engine import SingleEngine, TrainerConfig, build_engine, deepspeed_config, resolve_batch

CONF = str(Path(__file__).resolve().parents[1] / "conf")
PRESETS = {"single": ("single", None), "ddp": ("ddp", None), "fsdp": ("fsdp", None), "zero1": ("deepspeed", 1),
           "zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}
register_configs()


def load(overrides=()):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_trainer_preset_composes_and_validates(preset):
    cfg = load([f"trainer={preset}"])
    load_config(cfg)
    engine, stage = PRESETS[preset]
    assert cfg.trainer.engine == engine
    if stage is not None:
        assert cfg.trainer.zero_stage == stage
    assert cfg.trainer.steps == load().trainer.steps  # every preset starts from single's schedule


def test_unknown_trainer_preset_lists_the_valid_ones():
    with pytest.raises(ConfigCompositionException, match="(?s)Available options.*ddp.*fsdp.*single.*zero1.*zero2.*zero3"):
        load(["trainer=zero4"])


def test_deepspeed_json_comes_from_the_trainer_config_and_is_overridable():
    cfg = load(["trainer=zero3", "trainer.micro_batch_size=4", "trainer.grad_accum=2", "trainer.grad_clip=0.5",
                "trainer.bf16=false", "trainer.fp16=true",
                "+trainer.deepspeed.zero_optimization.offload_optimizer.device=cpu"])
    load_config(cfg)
    ds = deepspeed_config(cfg.trainer, world_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 32 and ds["gradient_clipping"] == 0.5
    assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"] and ds["fp16"]["loss_scale"] == 0  # dynamic
    # The override merges into the generated section instead of replacing it.
    assert ds["zero_optimization"]["stage"] == 3 and ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    with pytest.raises(ValueError, match="trainer.deepspeed.gradient_accumulation_steps.*grad_accum"):
        deepspeed_config(load(["trainer=zero2", "+trainer.deepspeed.gradient_accumulation_steps=8"]).trainer, 1)


def test_global_batch_sets_accumulation_per_world_size():
    t = TrainerConfig(micro_batch_size=4, grad_accum=1, global_batch_size=32)
    assert resolve_batch(t, 1).grad_accum == 8
    assert resolve_batch(t, 8).grad_accum == 1
    assert resolve_batch(replace(t, global_batch_size=None, grad_accum=3), 2).grad_accum == 3


def test_world_size_not_dividing_the_batch_is_refused():
    with pytest.raises(ValueError, match=r"global_batch_size=32 is not a multiple of.*micro_batch_size=4.*world size 3"):
        resolve_batch(TrainerConfig(micro_batch_size=4, grad_accum=1, global_batch_size=32), 3)


@pytest.mark.parametrize("overrides, match", [
    (["trainer.fp16=true"], "bf16=true and trainer.fp16=true"),
    (["trainer=zero2", "trainer.zero_stage=4"], "zero_stage=4"),
    (["target.shard=tp"], r"target.shard='tp'.*replicate.*fsdp.*zero3"),
    (["trainer=fsdp", "drafter=draft_model", "data.mode=on_policy"], "data.mode=on_policy samples from the draft"),
    (["trainer.global_batch_size=0"], "global_batch_size must be >= 1"),
    (["trainer.peak_tflops=0"], r"trainer.peak_tflops must be > 0 .*got 0"),
])
def test_bad_trainer_values_fail_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(load(overrides))


def test_single_engine_refuses_a_multi_process_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="trainer=single but the launcher started WORLD_SIZE=2.*trainer=ddp"):
        SingleEngine(make_cfg().trainer)


def test_fsdp_without_a_process_group_says_how_to_launch(tiny_teacher):
    engine = build_engine(make_cfg(engine="fsdp").trainer)
    drafter = build_drafter(make_cfg().drafter, tiny_teacher)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 1 -m train trainer=fsdp"):
        engine.setup(drafter, lambda groups: torch.optim.AdamW(groups))


def test_medusa2_lora_is_not_sharded(tiny_teacher):
    from tests.test_medusa2 import CFG

    drafter = build_drafter(CFG, tiny_teacher)
    engine = build_engine(make_cfg(engine="fsdp").trainer)
    with pytest.raises(ValueError, match="trainer=fsdp shards.*medusa2.*inside the target.*trainer=ddp"):
        engine.setup(drafter, lambda groups: torch.optim.AdamW(groups))


def _killed_run(teacher, run_dir, cfg):
    with pytest.raises(Killed):
        run(teacher, run_dir, cfg, DyingEngine(cfg.trainer, die_at=4))


def test_resume_refuses_a_target_with_other_weights(tiny_teacher, tmp_path):
    cfg = make_cfg()
    _killed_run(tiny_teacher, tmp_path, cfg)
    other = Teacher(make_tiny_llama(seed=1), tokenizer=None, name="tiny-llama")  # same name and sizes
    with pytest.raises(ValueError, match="target with other weights.*fresh hydra.run.dir"):
        run(other, tmp_path, cfg)


def test_resume_refuses_another_global_batch(tiny_teacher, tmp_path):
    _killed_run(tiny_teacher, tmp_path, make_cfg())
    with pytest.raises(ValueError, match="global_batch=4, this run has 2.*trainer.global_batch_size"):
        run(tiny_teacher, tmp_path, make_cfg(grad_accum=1))


def test_corrupt_optimizer_state_is_an_error_not_a_fresh_start(tiny_teacher, tmp_path):
    cfg = make_cfg()
    _killed_run(tiny_teacher, tmp_path, cfg)
    path = tmp_path / "checkpoints" / "step_0000003" / checkpoint.OPTIMIZER
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="step_0000003 is unreadable"):
        run(tiny_teacher, tmp_path, cfg)


def test_deepspeed_checkpoint_is_not_resumed_by_another_engine(tiny_teacher, tmp_path):
    cfg = make_cfg()
    _killed_run(tiny_teacher, tmp_path, cfg)
    state_file = tmp_path / "checkpoints" / "step_0000003" / checkpoint.STATE
    state = torch.load(state_file, weights_only=True)
    torch.save({**state, "engine": "deepspeed"}, state_file)  # as a trainer=zero2 run would have written it
    write_digest(state_file)  # with its digest, as every checkpoint file is written
    with pytest.raises(ValueError, match="written by trainer engine deepspeed on 1 ranks.*same engine"):
        run(tiny_teacher, tmp_path, cfg)


def test_checkpoint_records_the_data_position_and_scheduler(tiny_teacher, tmp_path):
    cfg = make_cfg()
    _killed_run(tiny_teacher, tmp_path, cfg)
    state = torch.load(tmp_path / "checkpoints" / "step_0000003" / checkpoint.STATE, weights_only=True)
    assert state["step"] == 3 and state["scheduler"] == {"name": "warmup_cosine", "step": 3}
    assert state["data"]["global_batch"] == 4 and state["next_micro_batch"] == 6  # 3 steps x 2 micro-batches
    assert len(state["rng"]) == 1 and state["world_size"] == 1
    assert not list((tmp_path / "checkpoints").glob(".*partial"))  # no debris of the atomic write


def test_throughput_metrics_are_logged(tiny_teacher, tmp_path):
    import json

    run(tiny_teacher, tmp_path, make_cfg(steps=3))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["perf/tokens_per_s"] > 0 and row["perf/peak_mem_gb"] > 0
        assert row["perf/teacher_s"] > 0 and row["perf/drafter_s"] > 0


def test_only_drafter_parameters_reach_the_optimizer(tiny_teacher):
    engine = SingleEngine(make_cfg().trainer)
    drafter = build_drafter(make_cfg().drafter, tiny_teacher)
    drafter.bind_target(tiny_teacher, initialize=True)
    _, optimizer = engine.setup(drafter, lambda groups: torch.optim.AdamW(groups))
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in drafter.parameters() if p.requires_grad}
    assert not in_optimizer & {id(p) for p in tiny_teacher.model.parameters()}


def test_fp16_loss_scaling_trains_checkpoints_and_resumes(tiny_teacher, tmp_path):
    """fp16 autocast with a dynamic loss scale: the scaler's state is checkpointed, and a killed run resumes onto
    the uninterrupted curve."""
    cfg = make_cfg(bf16=False, fp16=True)
    reference = run(tiny_teacher, tmp_path / "a", cfg)
    _killed_run(tiny_teacher, tmp_path / "b", cfg)
    state = torch.load(tmp_path / "b" / "checkpoints" / "step_0000003" / checkpoint.STATE, weights_only=True)
    assert state["grad_scaler"]["scale"] > 1  # the dynamic loss scale, saved with the step
    resumed = run(tiny_teacher, tmp_path / "b", cfg)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)
    torch.manual_seed(0)  # the steps were taken, not all skipped as overflowing
    initial = build_drafter(cfg.drafter, tiny_teacher).state_dict()
    assert max((initial[k] - v).abs().max() for k, v in reference.state_dict().items()) > 1e-3
