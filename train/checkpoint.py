"""Training checkpoints: the drafter only (never the frozen target), optimizer, scheduler position, step, data
position and every rank's RNG state.

Layout: ``<run dir>/checkpoints/step_0000200/{drafter/, trainer_state.pt, optimizer.pt | deepspeed/}`` plus
``checkpoints/latest`` naming the newest complete one. A checkpoint is filled in a hidden ``.step_N.partial``
directory (every rank writes its own shard there where the engine partitions state, e.g. DeepSpeed ZeRO), renamed
into place by the main rank once complete, and only then does ``latest`` move: a run killed at any moment resumes
from a whole checkpoint. Saving and loading are collective: every rank calls them.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from heads.base import WEIGHTS, read_drafter_config, save_drafter

log = logging.getLogger(__name__)

STATE, OPTIMIZER = "trainer_state.pt", "optimizer.pt"


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir, step: int, engine, optimizer, drafter_cfg: Mapping, target_cfg: Mapping,
                    target_identity: Mapping, layout: Mapping, keep_last: int) -> Path:
    root = checkpoint_root(run_dir)
    name = f"step_{step:07d}"
    final, tmp = root / name, root / f".{name}.partial"
    weights = engine.model_state_dict()  # collective under sharding engines; full on the main rank
    optim = engine.optimizer_state_dict(optimizer)
    rng = engine.gather_object(_rng_state())
    if engine.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a run killed while saving
        tmp.mkdir(parents=True)
    engine.barrier()
    engine.save_shards(tmp)
    engine.barrier()
    if engine.is_main:
        save_drafter(engine.module, tmp / "drafter", drafter_cfg, target_cfg, target_identity, extra={"step": step},
                     state_dict=weights)
        state = {
            "step": step,
            "engine": engine.name,
            "world_size": engine.world_size,
            "data": dict(layout),  # with ``step`` this is the data position: BatchOrder is a function of both
            "next_micro_batch": step * layout["global_batch"] // layout["micro_batch_size"],
            "scheduler": {"name": "warmup_cosine", "step": step},  # lr_at(step) is a pure function of the step
            "target_weights_digest": target_identity.get("weights_digest"),
            "rng": rng,
            **engine.extra_state(),
        }
        torch.save(state, tmp / STATE)
        if optim is not None:
            torch.save(optim, tmp / OPTIMIZER)
        if final.exists():  # a rerun reaching the same step
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / "latest")
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old)
    engine.barrier()
    return final


def latest_checkpoint(run_dir) -> Path | None:
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.is_file():
        return None
    path = checkpoint_root(run_dir) / pointer.read_text().strip()
    if not (path / STATE).is_file():
        raise FileNotFoundError(
            f"{pointer} names {path}, which is incomplete or missing; delete {pointer} to restart from the newest "
            f"complete checkpoint, or set trainer.resume=never to start over"
        )
    return path


def load_checkpoint(path: Path, engine, optimizer, drafter_cfg: Mapping, target_identity: Mapping,
                    layout: Mapping) -> int:
    """Restore drafter weights, optimizer, loss scaler and RNG in place; return the step to continue from. Anything
    that would make the continuation differ from an uninterrupted run is an error, never a silent fresh start."""
    config = read_drafter_config(path / "drafter")
    for what, saved, now in (("drafter", config["drafter"], engine.module.saved_config(drafter_cfg)),
                             ("target", _dims(config["target"]), _dims(target_identity))):
        if saved != now:
            raise ValueError(
                f"checkpoint {path} was made for another {what} ({saved}) than this run's ({now}); "
                f"use a fresh hydra.run.dir or set trainer.resume=never"
            )
    try:
        state: dict[str, Any] = torch.load(path / STATE, weights_only=True)
        weights = load_file(str(path / "drafter" / WEIGHTS))
        optim = torch.load(path / OPTIMIZER, weights_only=True) if (path / OPTIMIZER).is_file() else None
    except Exception as e:  # a truncated or corrupt file: say which, never silently restart from scratch
        raise RuntimeError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); delete it or set trainer.resume=never") from e
    _check_compatible(path, state, engine, target_identity, layout)
    if optim is None and engine.name != "deepspeed":  # DeepSpeed keeps its optimizer in deepspeed/
        raise RuntimeError(f"checkpoint {path} has no {OPTIMIZER}; it is incomplete: delete it or set trainer.resume=never")
    try:
        engine.load_state(optimizer, weights, optim, path)
    except (RuntimeError, KeyError, ValueError) as e:
        raise RuntimeError(f"checkpoint {path} cannot be restored into this {engine.name} run ({e}); resume it with "
                           f"the trainer that wrote it (trainer.engine={state['engine']}) or set trainer.resume=never") from e
    engine.load_extra_state(state)
    rng = state["rng"][engine.rank % len(state["rng"])]
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def _check_compatible(path: Path, state: Mapping, engine, target_identity: Mapping, layout: Mapping) -> None:
    digest = target_identity.get("weights_digest")
    if state.get("target_weights_digest") and digest and state["target_weights_digest"] != digest:
        raise ValueError(f"checkpoint {path} was trained against a target with other weights (digest "
                         f"{state['target_weights_digest']}, this target's is {digest}) under the same name; use a "
                         f"fresh hydra.run.dir or set trainer.resume=never")
    saved = dict(state.get("data", {}))
    for key, value in layout.items():
        if saved.get(key) != value:
            fix = ("set trainer.global_batch_size so micro_batch_size x grad_accum x world size matches"
                   if key == "global_batch" else f"restore the run's {key}")
            raise ValueError(f"checkpoint {path} was written with data {key}={saved.get(key)}, this run has {value}: "
                             f"the data order would not continue where it stopped; {fix}, or set trainer.resume=never")
    partitioned = state["engine"] == "deepspeed" or engine.name == "deepspeed"
    if partitioned and (state["engine"] != engine.name or state["world_size"] != engine.world_size):
        raise ValueError(f"checkpoint {path} was written by trainer engine {state['engine']} on {state['world_size']} "
                         f"ranks; DeepSpeed's partitioned state resumes only on the same engine and world size "
                         f"(this run: {engine.name} on {engine.world_size})")


def _rng_state() -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _dims(identity: Mapping) -> dict:
    return {k: identity.get(k) for k in ("name", "vocab_size", "hidden_size", "num_layers")}
