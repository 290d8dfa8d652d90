"""Training checkpoints: the drafter only (never the frozen target), optimizer, step and RNG state.

Layout: ``<run dir>/checkpoints/step_0000200/{drafter/, trainer_state.pt}`` plus ``checkpoints/latest`` naming the
newest complete one. Every directory is written to a temporary sibling and renamed into place, and ``latest`` is
replaced only after its checkpoint is complete, so a run killed at any moment resumes from a whole checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from heads.base import WEIGHTS, read_drafter_config, save_drafter, write_dir_atomically

log = logging.getLogger(__name__)

STATE = "trainer_state.pt"


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir, step: int, drafter, optimizer, drafter_cfg: Mapping, target_cfg: Mapping,
                    target_identity: Mapping, keep_last: int) -> Path:
    root = checkpoint_root(run_dir)
    name = f"step_{step:07d}"
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }

    def write(tmp: Path) -> None:
        save_drafter(drafter, tmp / "drafter", drafter_cfg, target_cfg, target_identity, extra={"step": step})
        torch.save(state, tmp / STATE)

    path = write_dir_atomically(root / name, write)
    pointer = root / "latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)
    return path


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


def load_checkpoint(path: Path, drafter, optimizer, drafter_cfg: Mapping, target_identity: Mapping) -> int:
    """Restore drafter weights, optimizer and RNG in place; return the step to continue from."""
    config = read_drafter_config(path / "drafter")
    for what, saved, now in (("drafter", config["drafter"], drafter.saved_config(drafter_cfg)),
                             ("target", _dims(config["target"]), _dims(target_identity))):
        if saved != now:
            raise ValueError(
                f"checkpoint {path} was made for another {what} ({saved}) than this run's ({now}); "
                f"use a fresh hydra.run.dir or set trainer.resume=never"
            )
    try:
        state: dict[str, Any] = torch.load(path / STATE, weights_only=True)
        weights = load_file(str(path / "drafter" / WEIGHTS))
    except Exception as e:  # a truncated or corrupt file: say which, never silently restart from scratch
        raise RuntimeError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); delete it or set trainer.resume=never") from e
    drafter.load_state_dict(weights, strict=True)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def _dims(identity: Mapping) -> dict:
    return {k: identity.get(k) for k in ("name", "vocab_size", "hidden_size", "num_layers")}
