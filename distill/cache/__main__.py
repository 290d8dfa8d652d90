"""Entry point: ``python -m distill.cache cache.dir=<dir> [hydra overrides]``: the offline teacher cache of the
configured target over the configured training rows (format: ``distill.cache``); under ``torchrun --nproc-per-node N``
the ranks share the shards. An entry point, so it may read the
layers above ``distill`` (the training config, the engine's device choice, the drafter's teacher layers)."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from distill.environment import check_run_dir_override, one_line_errors
from distill.cache import STORE_DTYPES, write_cache
from distill.data import build_train_dataset
from distill.ranks import job_ranks, leave
from distill.teacher import load_teacher
from train.config import Config, load_config, register_configs
from train.engine import resolve_device, world_from_env
from train.run import drafter_teacher_layers

log = logging.getLogger(__name__)


def build_cache(cfg: Config) -> dict:
    """The cache of the configured target over the configured training rows; returns its manifest."""
    c = cfg.cache
    if not c.dir:
        raise ValueError("cache.dir is null; set cache.dir=<directory to write the teacher cache to>, then train "
                         "with data.teacher_cache=<that directory>")
    if c.dtype not in STORE_DTYPES:
        raise ValueError(f"cache.dtype={c.dtype!r} is not supported; valid: {sorted(STORE_DTYPES)}")
    ranks = job_ranks()  # under torchrun: shard i is rank (i mod N)'s
    try:
        teacher = load_teacher(cfg.target, device=resolve_device(cfg.trainer.device, world_from_env()[2]))
        dataset = build_train_dataset(cfg.data, teacher.tokenizer)
        if c.layers is not None:
            layers = list(c.layers)
        else:  # only what the configured drafter reads
            layers = drafter_teacher_layers(cfg, teacher)
            log.info("cache.layers is null: caching the drafter's teacher_layers %s", layers)
        return write_cache(c.dir, teacher, dataset, cfg.data, layers, topk=c.topk, dtype=c.dtype,
                           shard_rows=c.shard_rows, batch_size=c.batch_size, ranks=ranks)
    finally:
        leave(ranks)


def main() -> None:
    register_configs()
    check_run_dir_override()

    @one_line_errors
    def run(cfg: DictConfig) -> None:
        build_cache(load_config(cfg))

    hydra.main(version_base="1.3", config_path="../../conf", config_name="config")(run)()


if __name__ == "__main__":
    main()
