"""bf16 only where the device computes it natively: training autocast, the toy target's pretraining, proposal dtype."""

import torch

from distill.toy import build
from distill.toy.config import ToyTargetConfig
from eval.run import proposal_dtype
from train.engine import SingleEngine, TrainerConfig


def test_emulated_bf16_trains_in_float32(monkeypatch):
    monkeypatch.setattr("train.engine.native_bf16", lambda device: False)
    engine = SingleEngine(TrainerConfig(device="cpu"))
    with engine.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    monkeypatch.setattr("train.engine.native_bf16", lambda device: True)
    with SingleEngine(TrainerConfig(device="cpu")).autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_toy_target_builds_in_float32_without_native_bf16(monkeypatch, tmp_path):
    cfg = ToyTargetConfig(autocast_bf16=True)
    monkeypatch.setattr(build, "native_bf16", lambda device: False)
    assert build._as_built(cfg).autocast_bf16 is False
    assert build.toy_cache_path(cfg, tmp_path) == build.toy_cache_path(ToyTargetConfig(autocast_bf16=False), tmp_path)
    monkeypatch.setattr(build, "native_bf16", lambda device: True)
    assert build._as_built(cfg).autocast_bf16 is True
    assert build.toy_cache_path(cfg, tmp_path) != build.toy_cache_path(ToyTargetConfig(autocast_bf16=False), tmp_path)


def test_proposal_dtype_follows_native_bf16(monkeypatch):
    monkeypatch.setattr("eval.run.native_bf16", lambda device: False)
    assert proposal_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr("eval.run.native_bf16", lambda device: True)
    assert proposal_dtype("auto", torch.device("cpu")) == torch.bfloat16
