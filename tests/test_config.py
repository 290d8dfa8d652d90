"""Every experiment composes, validates and instantiates; bad keys fail early with a useful message."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf
import torch

from tests.conftest import make_tiny_llama
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

from heads.base import TargetDims
from train.config import load_config, register_configs

CONF = str(Path(__file__).resolve().parents[1] / "conf")
EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml"))
DRAFTERS = sorted(p.stem for p in (Path(CONF) / "drafter").glob("*.yaml"))

register_configs()

HUB_DIMS = {  # config.json of each hub target the experiments name
    "meta-llama/Llama-3.1-8B-Instruct": TargetDims(hidden_size=4096, vocab_size=128256, num_layers=32),
    "Qwen/Qwen2.5-7B-Instruct": TargetDims(hidden_size=3584, vocab_size=152064, num_layers=28),
    "Qwen/Qwen3-8B": TargetDims(hidden_size=4096, vocab_size=151936, num_layers=36),
    "mistralai/Mistral-7B-Instruct-v0.3": TargetDims(hidden_size=4096, vocab_size=32768, num_layers=32),
    "google/gemma-2-9b-it": TargetDims(hidden_size=3584, vocab_size=256000, num_layers=42),
    "google/gemma-3-1b-it": TargetDims(hidden_size=1152, vocab_size=262144, num_layers=26),
    "microsoft/Phi-4-mini-instruct": TargetDims(hidden_size=3072, vocab_size=200064, num_layers=32),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": TargetDims(hidden_size=4096, vocab_size=32000, num_layers=32),
    "Qwen/Qwen3-30B-A3B": TargetDims(hidden_size=2048, vocab_size=151936, num_layers=48),
    "allenai/OLMo-2-1124-7B-Instruct": TargetDims(hidden_size=4096, vocab_size=100352, num_layers=32),
    "EleutherAI/pythia-1.4b": TargetDims(hidden_size=2048, vocab_size=50304, num_layers=24),
    "specdraft/toy-stdlib": TargetDims(hidden_size=256, vocab_size=4096, num_layers=4),  # conf/target/toy.yaml
}


def load(overrides=()):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_composes():
    cfg = load()
    load_config(cfg)
    assert cfg.target.source == "toy" and cfg.drafter._target_ == "heads.eagle.EagleDrafter"
    assert cfg.drafter.variant == "eagle1"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_instantiates(experiment):
    cfg = load([f"experiment={experiment}"])
    if cfg.data.source == "file":
        cfg.data.path = "/data/chat.jsonl"  # the user supplies it; everything else must already be there
    if cfg.data.mode == "regenerated" and (OmegaConf.is_missing(cfg.data, "regenerated") or not cfg.data.regenerated):
        cfg.data.regenerated = "/data/regen.jsonl"  # likewise: python -m distill.regenerate writes it first
    load_config(cfg)
    # Hub targets get their real sizes (drafters check layer ids and vocab sizes against them); built on the meta
    # device, so an 8B-sized drafter costs nothing.
    dims = HUB_DIMS.get(cfg.target.name, TargetDims(hidden_size=64, vocab_size=512, num_layers=2))
    with torch.device("meta"):
        drafter = instantiate(cfg.drafter, dims=dims)
    assert drafter.dims == dims
    assert callable(instantiate(cfg.loss))


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_every_drafter_preset_instantiates(drafter, monkeypatch):
    # The draft model preset builds a small toy LM (minutes); a tiny stand-in checks the config plumbing.
    monkeypatch.setattr("heads.draft_model.model.load_or_build_toy_target", lambda cfg, cache_dir=None: (make_tiny_llama(), None))
    cfg = load([f"drafter={drafter}"])
    load_config(cfg)
    instantiate(cfg.drafter, dims=TargetDims(32, 4096, 4))  # the toy target's vocabulary and depth


def test_smoke_uses_a_tiny_target():
    cfg = load(["experiment=smoke"])
    assert cfg.target.toy.hidden_size <= 64 and cfg.eval.num_prompts == 3


def test_unknown_schema_key_fails():
    with pytest.raises(ConfigCompositionException, match="lrr"):
        load(["trainer.lrr=1e-3"])


def test_unknown_drafter_key_lists_valid_ones():
    cfg = load(["+drafter.num_headz=3"])
    with pytest.raises(ValueError, match=r"unknown key drafter.num_headz.*num_heads"):
        load_config(cfg)


def test_unknown_group_option_is_rejected():
    with pytest.raises(ConfigCompositionException, match="medusaa"):
        load(["drafter=medusaa"])


def test_cross_field_checks():
    cfg = load(["data.max_length=1024"])
    with pytest.raises(ValueError, match="target.toy.max_seq_len"):
        load_config(cfg)
    with pytest.raises(ValueError, match="trainer.steps must be >= 1"):
        load_config(load(["trainer.steps=0"]))
    with pytest.raises(ValueError, match="trainer.engine='ddpp'.*single"):
        load_config(load(["trainer.engine=ddpp"]))


LOSSES = sorted(p.stem for p in (Path(CONF) / "loss").glob("*.yaml"))


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_preset_validates_and_instantiates(loss):
    cfg = load([f"loss={loss}"])
    load_config(cfg)
    fn = instantiate(cfg.loss)
    import torch

    s = torch.randn(3, 8)
    value, n = fn(s, torch.randn(3, 8), torch.ones(3, dtype=torch.bool))
    assert value >= 0 and n == 3


def test_unknown_loss_lists_the_valid_ones():
    with pytest.raises(ConfigCompositionException, match="(?s)Available options.*fkl.*jsd.*rkl.*topk_fkl.*tvd"):
        load(["loss=kld"])
