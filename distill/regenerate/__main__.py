"""Entry point: ``python -m distill.regenerate regenerate.out=<file.jsonl> [hydra overrides]``: the configured
target's answers to the configured data's prompts (format: ``distill.regenerate``). An entry point, so it may read
the layers above ``distill`` (the training config, the engine's device choice)."""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import OmegaConf

from distill.regenerate import WRITE_CMD, check_settings, prompts_from_data, write_regenerated
from distill.teacher import load_teacher
from train.config import register_configs, validate
from train.engine import resolve_device


def regenerate(cfg) -> Path:
    """The jsonl of the target's answers (``regenerate.out``), written or completed."""
    r = cfg.regenerate
    if not r.out:
        raise ValueError(f"regenerate.out is required: {WRITE_CMD} regenerate.out=<file.jsonl>")
    validate(cfg)
    settings = OmegaConf.to_container(r, resolve=True)
    check_settings(settings)
    teacher = load_teacher(cfg.target, device=resolve_device(cfg.trainer.device))
    prompts = prompts_from_data(cfg.data, teacher.tokenizer, int(r.prompt_tokens), r.num_prompts)
    return write_regenerated(r.out, teacher, prompts, cfg.data, settings)


def main() -> None:
    register_configs()
    hydra.main(version_base="1.3", config_path="../../conf", config_name="config")(regenerate)()


if __name__ == "__main__":
    main()
