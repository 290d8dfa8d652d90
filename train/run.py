"""``python -m train``: build the frozen target, the data and the drafter; train; save; evaluate; report."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from hydra.utils import instantiate

from distill.cache import open_teacher_cache
from distill.data import ON_POLICY_MODES, build_train_dataset, collate
from distill.lock import WriterLockedError, writer_lock
from distill.onpolicy import OnPolicyBatches
from distill.ranks import Ranks
from distill.regenerate import (check_settings, load_regenerated, prompts_from_data, regenerated_path,
                                write_regenerated)
from distill.teacher import load_teacher
from distill.toy import default_cache_dir
from heads.base import build_drafter
from heads.saved import save_drafter
from inference.batch_memory import check_batch_sizes_fit
from train import checkpoint
from train.config import Config
from train.engine import build_engine, resolve_batch, shard_target, world_from_env
from train.logger import MetricsLogger
from train.loop import train
from train.preemption import Preempted
from train.selection import HeldoutTau, Selection, heldout_rows

log = logging.getLogger(__name__)

REGENERATE_WAIT_S = 1200.0  # data.mode=regenerate: the wait for another job writing the same answers


def drafter_teacher_layers(cfg: Config, teacher) -> list[int]:
    """The hidden-state indices the configured drafter reads: what an offline teacher cache must hold."""
    return list(build_drafter(cfg.drafter, teacher).teacher_layers)


def training_data(cfg: Config, teacher, drafter, engine=None):
    """(dataset, what the loop asks for teacher signals, batch_source) for ``data.mode`` (see ``distill.data``):
    fixed rows, the target's regenerated answers (``regenerate``: written first, over ``engine``'s ranks), the offline
    teacher cache, or on-policy rows the draft writes."""
    signals = teacher  # the live target, or the offline cache
    if cfg.data.teacher_cache:
        dataset, signals = open_teacher_cache(cfg.data.teacher_cache, teacher, cfg.data, drafter.teacher_layers, cfg.loss)
    elif cfg.data.mode == "regenerate":
        dataset = load_regenerated(regenerate_first(cfg, teacher, engine), teacher.tokenizer, cfg.data, teacher)
    elif cfg.data.regenerated and cfg.data.mode != "fixed":
        dataset = load_regenerated(cfg.data.regenerated, teacher.tokenizer, cfg.data, teacher)
    else:
        dataset = build_train_dataset(cfg.data, teacher.tokenizer)
    batch_source = None
    if cfg.data.mode in ON_POLICY_MODES:
        batch_source = OnPolicyBatches(drafter, cfg.data, cfg.seed)
    return dataset, signals, batch_source


def regenerate_first(cfg: Config, teacher, engine=None) -> Path:
    """``data.mode=regenerate``: the target's answers to the data's prompts, written (or finished, or found done) by
    every rank together before training; the jsonl's path."""
    settings = dataclasses.asdict(cfg.regenerate)
    check_settings(settings)
    prompts = prompts_from_data(cfg.data, teacher.tokenizer, cfg.regenerate.prompt_tokens, cfg.regenerate.num_prompts)
    # Keyed by the prompts' content, not data.path: a data file edited in place gets answers of its own.
    out = Path(cfg.data.regenerated or regenerated_path(teacher, cfg.data, settings, prompts,
                                                        cfg.target.cache_dir or default_cache_dir()))
    log.info("data.mode=regenerate: the target's answers in %s (written once, then reused)", out)
    ranks = None
    if engine is not None and engine.world_size > 1:
        ranks = Ranks(rank=engine.rank, world=engine.world_size, barrier=engine.barrier,
                      broadcast=engine.broadcast_object)
    # Another training regenerating the same answers (the same key) is waited for, and its answers reused: neither
    # job chose this file, so neither is told to write elsewhere. Bounded below the ranks' collective timeout.
    what = "data.regenerated" if cfg.data.regenerated else "data.mode=regenerate: its answers file"
    writer = {"what": what, "wait": REGENERATE_WAIT_S,
              "advice": f"another job is regenerating the same answers, and this one waited {REGENERATE_WAIT_S:.0f} s "
                        f"for it; rerun the same command once it is done: its answers are then reused"}
    return write_regenerated(out, teacher, prompts, cfg.data, settings, ranks, writer)


def run_training(cfg: Config, run_dir: str | Path, evaluate: Callable | None = None) -> dict | None:
    """Train the configured drafter into ``<run dir>/drafter/`` and, given ``evaluate`` and unless
    ``eval.enabled=false``, evaluate it. Every rank of a multi-process launch runs this; only the main rank logs,
    writes and evaluates. ``evaluate(cfg, teacher, drafter_dir, run_dir) -> report``: passed in by the entry point
    (``python -m train`` passes ``eval.run.evaluate_saved``), since evaluation is a layer above training.
    ``cfg``: the validated, typed config (``train.config.load_config``)."""
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    trainer = resolve_batch(cfg.trainer, world_from_env()[1])
    cfg = dataclasses.replace(cfg, trainer=trainer)
    engine = build_engine(trainer)
    if not engine.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # rank-0 logging; other ranks still report problems
    run_dir = _shared_run_dir(engine, Path(run_dir))
    with _one_writer(engine, run_dir):
        return _run(cfg, trainer, engine, run_dir, evaluate)


def _run(cfg: Config, trainer, engine, run_dir: Path, evaluate: Callable | None) -> dict | None:
    # Refuses, before anything is loaded or written, a fresh start over an earlier run's outputs or a checkpoint past
    # trainer.steps; the loop resumes from the same checkpoint.
    ckpt = checkpoint.resume_point(run_dir, trainer.resume, trainer.steps)
    if engine.name == "deepspeed" and (problem := checkpoint.signing_key_problem(engine)):
        raise ValueError(problem)  # its checkpoints are signed: a key that cannot sign is refused before training
    sharded = cfg.target.shard != "replicate"
    # A sharded target is loaded on the CPU and only its shards move to the device. Rank 0 goes first: a toy target
    # missing from the cache is built once, not by every rank at the same time.
    for turn in (True, False):
        if engine.is_main == turn:
            teacher = load_teacher(cfg.target, device="cpu" if sharded else engine.device)
        engine.barrier()
    shard_target(teacher, cfg.target.shard, engine)
    teacher.model.to(engine.device)
    if cfg.eval.enabled:  # a batch sweep the evaluation after training could not hold: refused now, not then
        check_batch_sizes_fit(teacher, cfg.decoder.batch_sizes, cfg.decoder.max_batch_rows, cfg.eval.prompt_tokens,
                              cfg.eval.max_new_tokens, cfg.eval.num_draft)
    # Seeded after the target is loaded: building a missing toy target draws random numbers, loading a cached one
    # does not, and the first run on a machine must train exactly as every later one. The same on every rank:
    # sharding engines need identical initial weights.
    torch.manual_seed(cfg.seed)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    if engine.is_main and hasattr(engine, "config"):  # the DeepSpeed JSON actually used
        (run_dir / "deepspeed_config.json").write_text(json.dumps(engine.config, indent=2))

    summary = {}
    finished = ckpt is not None and checkpoint.step_of(ckpt) == trainer.steps and (run_dir / "drafter").is_dir()
    logger = MetricsLogger(run_dir, cfg.logger, dataclasses.asdict(cfg), is_main=engine.is_main, resumed=ckpt is not None,
                           resume_step=checkpoint.step_of(ckpt) if ckpt is not None else None)
    identity = {**teacher.identity(), "weights_digest": teacher.weights_digest(),  # checked again at evaluation
                "model_type": teacher.model.config.model_type}  # exports check the engines' family support by it
    try:
        if any(p.requires_grad for p in drafter.parameters()):
            dataset, signals, batch_source = training_data(cfg, teacher, drafter, engine)
            drafter.prepare(dataset)
            log.info("training %s on %d blocks of %d tokens (data.mode=%s, trainer.engine=%s, %d rank(s), global "
                     "batch %d rows)", type(drafter).__name__, len(dataset), cfg.data.max_length, cfg.data.mode,
                     engine.name, engine.world_size, trainer.micro_batch_size * trainer.grad_accum * engine.world_size)
            selection = _selection(cfg, teacher, drafter, run_dir, identity)
            try:
                summary = train(cfg, signals, drafter, dataset, collate, instantiate(cfg.loss), engine, run_dir, logger,
                                batch_source=batch_source, selection=selection)
            except Preempted:  # checkpointed on every rank: leave the process group together, then exit
                engine.close()
                raise
            weights = engine.model_state_dict()  # collective: the full weights, gathered on the main rank
            best = selection.final_weights() if selection is not None and engine.is_main else None
            summary.update(drafter.after_training(teacher, weights=best))  # measured on what drafter/ gets
            if best is not None:
                log.info("drafter/ takes the weights of step %d (held-out simulated tau %.3f; trainer.select=%s)",
                         selection.best_step, selection.best_tau, trainer.select)
                weights = best
                summary.update({"selected_step": selection.best_step, "selected_heldout_sim_tau": selection.best_tau})
        else:
            log.info("%s has no trainable parameters; skipping training", type(drafter).__name__)
            weights = None
        if engine.is_main and finished:  # a rerun of a finished run: resumed to done, drafter/ stays byte for byte
            log.info("%s is a finished run (step %d of %d); %s left as it is", run_dir, trainer.steps,
                     trainer.steps, run_dir / "drafter")
        elif engine.is_main:
            path = save_drafter(drafter, run_dir / "drafter", cfg.drafter, dataclasses.asdict(cfg.target), identity,
                                extra={"training": {"steps": trainer.steps, "loss": cfg.loss,
                                                    "data": dataclasses.asdict(cfg.data),
                                                    "eval": dataclasses.asdict(cfg.eval), "final": summary}},
                                state_dict=weights)
            log.info("saved drafter to %s", path)
        # Every rank leaves the process group together; evaluation is the main rank's alone, and however long it
        # takes no rank waits on it (nor on a rank that failed: then no rank gets here, and the launcher stops all).
        engine.close()
        if evaluate is None or not cfg.eval.enabled or not engine.is_main:
            if engine.is_main and not finished and (run_dir / "report.json").is_file():
                log.warning("%s measured this run's earlier drafter, not the one just saved; exports leave it out of "
                            "the model card. Evaluate again: python -m eval drafter_path=%s hydra.run.dir=%s",
                            run_dir / "report.json", run_dir / "drafter", run_dir)
            return None
        if sharded:
            log.warning("target.shard=%s: the target is split over the ranks, so evaluation is left to "
                        "`python -m eval drafter_path=%s` on a machine it fits", cfg.target.shard, run_dir / "drafter")
            return None
        report = evaluate(cfg, teacher, run_dir / "drafter", run_dir)
        logger.log_report(report, run_dir)
        return report
    finally:
        logger.close()


def _selection(cfg: Config, teacher, drafter, run_dir: Path, identity: dict) -> Selection | None:
    """The held-out evaluation and best-weights keeper (``train.selection``); None with ``trainer.eval_every=0``."""
    t = cfg.trainer
    if not t.eval_every:
        return None
    rows = heldout_rows(teacher.tokenizer, t.eval_rows, cfg.data.max_length)
    depth = cfg.eval.num_draft if drafter.drafts_autoregressively else None
    evaluate = HeldoutTau(teacher, rows, t.micro_batch_size, depth)  # the live target, even over a teacher cache
    return Selection(evaluate, t.select, run_dir, {"drafter_cfg": cfg.drafter, "target_cfg": dataclasses.asdict(cfg.target),
                                                   "target_identity": identity})


@contextlib.contextmanager
def _one_writer(engine, run_dir: Path):
    """The run dir's writer lock (``distill.lock``), held by the main rank for the whole run; every rank refuses
    when another job holds it (a requeued job while the old one still runs, the same command started twice)."""
    with contextlib.ExitStack() as stack:
        problem = None
        if engine.is_main:
            try:
                stack.enter_context(writer_lock(run_dir, "hydra.run.dir"))
            except WriterLockedError as e:
                problem = str(e)
        problem = engine.broadcast_object(problem)
        if problem:
            raise WriterLockedError(problem)
        yield


def _shared_run_dir(engine, run_dir: Path) -> Path:
    """Rank 0's run dir on every rank. Hydra's default dir is a timestamp, which ranks started a second apart
    would each compute differently; scripts/train.sh passes one explicitly, and plain ``torchrun`` is fixed here."""
    shared = Path(engine.broadcast_object(str(run_dir)))
    if shared != run_dir:
        log.warning("rank %d: Hydra chose run dir %s; using rank 0's %s (pass hydra.run.dir, or launch with "
                    "scripts/train.sh, to name it)", engine.rank, run_dir, shared)
    return shared
