"""Entry point: ``python -m distill.regenerate regenerate.out=<file.jsonl> [hydra overrides]``: the configured
target's answers to the configured data's prompts (format: ``distill.regenerate``). Under ``torchrun
--nproc-per-node N`` each rank decodes its share into a shard and the shards merge into the same file
(``distill.regenerate.ranks``); with ``regenerate.shard=tensor`` the ranks split the target instead and decode every
prompt together. An entry point, so it may read the layers above ``distill`` (the training config,
the engine's device choice)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import hydra
from omegaconf import DictConfig

from distill.environment import check_run_dir_override, one_line_errors
from distill.ranks import job_ranks, leave
from distill.regenerate import WRITE_CMD, check_placement, check_settings, prompts_from_data, write_regenerated
from distill.teacher import load_teacher
from train.config import Config, load_config, register_configs
from train.engine import resolve_device, world_from_env


def regenerate(cfg: Config) -> Path:
    """The jsonl of the target's answers (``regenerate.out``), written or completed."""
    r = cfg.regenerate
    if not r.out:
        raise ValueError(f"regenerate.out is required: {WRITE_CMD} regenerate.out=<file.jsonl>")
    settings = asdict(r)
    check_settings(settings)
    _, world, local_rank = world_from_env()
    check_placement(settings, world)
    ranks = job_ranks(split_target=r.shard == "tensor")
    try:
        teacher = load_teacher(cfg.target, device=resolve_device(cfg.trainer.device, local_rank), placement=r.shard)
        prompts = prompts_from_data(cfg.data, teacher.tokenizer, r.prompt_tokens, r.num_prompts)
        return write_regenerated(r.out, teacher, prompts, cfg.data, settings, ranks)
    finally:
        leave(ranks)


def main() -> None:
    register_configs()
    check_run_dir_override()

    @one_line_errors
    def run(cfg: DictConfig) -> None:
        regenerate(load_config(cfg))

    hydra.main(version_base="1.3", config_path="../../conf", config_name="config")(run)()


if __name__ == "__main__":
    main()
