"""A target too large for one device (``regenerate.shard``): what ``from_pretrained`` receives, the tensor-parallel
group taking every prompt with only its main rank writing, the refusals of impossible combinations, and, for real on
2 CPU ranks (gloo), transformers' tensor parallelism writing the bytes one unsplit process writes."""

import pytest
import torch

from distill.ranks import Ranks
from distill.regenerate import (batch_plan, check_placement, check_settings, meta_path, prompts_from_data,
                                write_regenerated)
from distill.teacher import TargetConfig, load_teacher, placement_kwargs
from tests import torchrun
from tests.torchrun import ROOT
from tests.test_regenerate import compose, make_teacher, make_tokenizer, text_data


def test_from_pretrained_gets_the_placement():
    from transformers import DistributedConfig

    assert placement_kwargs("none") == {}
    assert placement_kwargs("device_map") == {"device_map": "auto"}
    tensor = placement_kwargs("tensor")
    assert list(tensor) == ["distributed_config"] and isinstance(tensor["distributed_config"], DistributedConfig)
    assert tensor["distributed_config"].tp_plan == "auto"
    with pytest.raises(ValueError, match=r"regenerate.shard='pipeline'; valid: \['none', 'tensor', 'device_map'\]"):
        placement_kwargs("pipeline")


def test_a_split_target_is_loaded_by_transformers_and_never_moved(monkeypatch, tiny_toy_target):
    """The toy target is loaded again from its cache dir with the placement's arguments; ``device`` is not applied
    afterwards (transformers placed every weight)."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    seen, real = [], AutoModelForCausalLM.from_pretrained

    def recording(path, **kwargs):
        seen.append(kwargs)
        return real(path, dtype=kwargs["dtype"])

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TargetConfig),
                                              OmegaConf.load(ROOT / "conf" / "target" / "tiny.yaml")))
    teacher = load_teacher(cfg, device="meta", placement="device_map")
    assert seen == [{"dtype": torch.float32, "device_map": "auto"}]
    assert teacher.device.type == "cpu"  # device="meta" was ignored
    assert load_teacher(cfg, device="meta").device.type == "meta" and len(seen) == 1  # none: moved, not reloaded


@pytest.mark.parametrize("settings,world,match", [
    ({"shard": "device_map"}, 2, r"regenerate.shard=device_map .* this launch has 2 ranks; run it as one process"),
    ({"shard": "device_map", "engine": "vllm"}, 1, r"regenerate.shard=device_map .* regenerate.engine=vllm"),
    ({"shard": "tensor", "engine": "vllm"}, 2, r"regenerate.shard=tensor .* regenerate.engine=vllm"),
    ({"shard": "tensor"}, 1, r"regenerate.shard=tensor .* this is one process; launch it with `torchrun"),
])
def test_impossible_placements_are_refused_before_the_target_loads(settings, world, match):
    with pytest.raises(ValueError, match=match):
        check_placement(settings, world)
    check_placement({**settings, "shard": "none"}, world)  # the same launch unsplit is fine
    with pytest.raises(ValueError, match=r"regenerate.shard='pipeline'; valid"):
        check_settings({"batch_size": 2, "temperature": 0.0, "top_p": 1.0, "shard": "pipeline"})


def test_training_refuses_a_split_regeneration_in_data_mode_regenerate():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from train.config import load_config, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["data.mode=regenerate", "regenerate.shard=tensor"])
    with pytest.raises(ValueError, match=r"regenerate.shard=tensor is for a separate regeneration job"):
        load_config(cfg)


def test_a_tensor_group_decodes_every_prompt_and_only_its_main_rank_writes(tmp_path, monkeypatch):
    """In-process stand-ins for the 2 ranks of a tensor-parallel group (the collectives are tested for real below):
    each decodes every batch, rank 1 writes nothing, and rank 0 writes the file one process writes."""
    import random
    from dataclasses import asdict

    import distill.regenerate.ranks as ranks_module
    from distill.regenerate.__main__ import regenerate
    from tests.test_regenerate import _words

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_words(random.Random(0), 300))
    teacher = make_teacher(make_tokenizer())
    monkeypatch.setattr("distill.regenerate.__main__.load_teacher",
                        lambda target_cfg, device="cpu", placement="none": teacher)
    single = tmp_path / "single.jsonl"
    regenerate(compose(text_data(corpus), single, temperature=1.0))

    cfg = compose(text_data(corpus), None, temperature=1.0, shard="tensor")
    settings = asdict(cfg.regenerate)
    prompts = prompts_from_data(cfg.data, teacher.tokenizer, cfg.regenerate.prompt_tokens, cfg.regenerate.num_prompts)
    decode, plans = ranks_module.decode_batches, []

    def recording(out, teacher, prompts, data_cfg, settings, plan, done, write=True):
        plans.append(([list(b) for b in plan], done, write))
        return decode(out, teacher, prompts, data_cfg, settings, plan, done, write)

    monkeypatch.setattr(ranks_module, "decode_batches", recording)
    everything = [list(b) for b in batch_plan(len(prompts), cfg.regenerate.batch_size)]
    for rank in (1, 0):
        out = tmp_path / f"rank{rank}" / "regen.jsonl"
        group = Ranks(rank=rank, world=2, barrier=lambda: None, broadcast=lambda value: (0, None))
        write_regenerated(out, teacher, prompts, cfg.data, {**settings, "out": str(out)}, group)
        assert plans[-1] == (everything, 0, rank == 0)
        assert out.exists() == (rank == 0)
    assert (tmp_path / "rank0" / "regen.jsonl").read_bytes() == single.read_bytes()
    assert meta_path(tmp_path / "rank0" / "regen.jsonl").read_bytes() == meta_path(single).read_bytes()


def test_a_main_rank_that_cannot_start_stops_the_whole_group(tmp_path):
    from distill.data import DataConfig

    teacher = make_teacher(make_tokenizer())
    out = tmp_path / "taken"
    out.mkdir()  # regenerate.out names a directory: the main rank refuses it, and rank 1 must not wait for it
    group = Ranks(rank=1, world=2, barrier=lambda: None, broadcast=lambda value: (0, "IsADirectoryError: taken"))
    settings = {"out": str(out), "batch_size": 2, "temperature": 0.0, "top_p": 1.0, "seed": 0, "shard": "tensor",
                "max_new_tokens": 4, "prompt_tokens": 4, "num_prompts": None, "engine": "batched"}
    with pytest.raises(RuntimeError, match="the main rank could not start .*IsADirectoryError"):
        write_regenerated(out, teacher, [], DataConfig(), settings, group)


def command(out, ranks: int, shard: str) -> list[str]:
    return torchrun.command("distill.regenerate", [
        "target=tiny", "trainer.device=cpu", "data.max_length=64", "data.corpus_max_bytes=20000",
        "regenerate.prompt_tokens=12", "regenerate.num_prompts=5", "regenerate.batch_size=2",
        "regenerate.temperature=0.0", "regenerate.max_new_tokens=12", f"regenerate.shard={shard}",
        f"regenerate.out={out}", f"hydra.run.dir={out.parent / 'hydra'}"], ranks)


@pytest.mark.slow
def test_tensor_parallel_ranks_write_the_greedy_bytes_of_one_unsplit_process(tmp_path, tiny_toy_target):
    """transformers' tensor parallelism (tp_plan "auto") on 2 gloo ranks: split matmuls round differently from whole
    ones (by ~1e-6 on the tiny target), which leaves its greedy answers, and so the file, unchanged."""
    one, two = tmp_path / "one" / "regen.jsonl", tmp_path / "two" / "regen.jsonl"
    torchrun.run(command(one, 1, "none"))
    torchrun.run(command(two, 2, "tensor"))
    assert len(one.read_text().splitlines()) == 5
    assert two.read_bytes() == one.read_bytes()
    assert meta_path(two).read_bytes() == meta_path(one).read_bytes()
