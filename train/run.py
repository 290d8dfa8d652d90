"""``python -m train``: build the frozen target, the data and the drafter; train; save; evaluate; report."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from distill.teacher import load_teacher
from heads.base import build_drafter, save_drafter
from train.config import to_container, validate
from train.engine import build_engine
from train.logger import MetricsLogger

log = logging.getLogger(__name__)


def training_data(cfg: DictConfig, teacher, drafter):
    """(dataset, what the loop asks for teacher signals, batch_source) for ``data.mode`` (see ``distill.data``):
    fixed rows, the target's regenerated answers, the offline teacher cache, or on-policy rows the draft writes."""
    from distill.data import ON_POLICY_MODES, build_train_dataset

    signals = teacher  # the live target, or the offline cache
    if cfg.data.teacher_cache:
        from distill.cache import open_teacher_cache

        dataset, signals = open_teacher_cache(cfg.data.teacher_cache, teacher, cfg.data, drafter.teacher_layers, cfg.loss)
    elif cfg.data.regenerated and cfg.data.mode != "fixed":
        from distill.regenerate import load_regenerated

        dataset = load_regenerated(cfg.data.regenerated, teacher.tokenizer, cfg.data, teacher)
    else:
        dataset = build_train_dataset(cfg.data, teacher.tokenizer)
    batch_source = None
    if cfg.data.mode in ON_POLICY_MODES:
        from distill.onpolicy import OnPolicyBatches

        batch_source = OnPolicyBatches(drafter, cfg.data, cfg.seed)
    return dataset, signals, batch_source


def run_training(cfg: DictConfig, run_dir: str | Path) -> dict | None:
    """Train the configured drafter into ``<run dir>/drafter/`` and, unless ``eval.enabled=false``, evaluate it."""
    validate(cfg)
    run_dir = Path(run_dir)
    torch.manual_seed(cfg.seed)
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    engine = build_engine(cfg.trainer)
    teacher = load_teacher(cfg.target, device=engine.device)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    plain = to_container(cfg)

    summary = {}
    if any(p.requires_grad for p in drafter.parameters()):
        from distill.data import collate
        from train import checkpoint
        from train.loop import train

        dataset, signals, batch_source = training_data(cfg, teacher, drafter)
        drafter.prepare(dataset)
        log.info("training %s on %d blocks of %d tokens (data.mode=%s)", type(drafter).__name__, len(dataset),
                 cfg.data.max_length, cfg.data.mode)
        resumed = cfg.trainer.resume == "auto" and checkpoint.latest_checkpoint(run_dir) is not None
        logger = MetricsLogger(run_dir, cfg.logger, plain, is_main=engine.is_main, resumed=resumed)
        try:
            summary = train(plain, signals, drafter, dataset, collate, instantiate(cfg.loss), engine, run_dir, logger,
                            batch_source=batch_source)
        finally:
            logger.close()
        summary.update(drafter.after_training(teacher))
    else:
        log.info("%s has no trainable parameters; skipping training", type(drafter).__name__)

    if engine.is_main:
        path = save_drafter(drafter, run_dir / "drafter", plain["drafter"], plain["target"], teacher.identity(),
                            extra={"training": {"steps": cfg.trainer.steps, "loss": plain["loss"], "data": plain["data"],
                                              "final": summary}})
        log.info("saved drafter to %s", path)
    if not cfg.eval.enabled or not engine.is_main:
        return None
    from eval.run import evaluate_saved

    return evaluate_saved(cfg, teacher, run_dir / "drafter", run_dir)
