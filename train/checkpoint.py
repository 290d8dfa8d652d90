"""Training checkpoints: the drafter only (never the frozen target), optimizer, scheduler position, step, data
position and every rank's RNG state.

Layout: ``<run dir>/checkpoints/step_0000200/{drafter/, trainer_state.pt, optimizer.pt | deepspeed/}`` plus
``checkpoints/latest`` naming the newest complete one. A checkpoint is filled in a hidden ``.step_N.partial``
directory (every rank writes its own shard there where the engine partitions state, e.g. DeepSpeed ZeRO), renamed
into place by the main rank once complete, and only then does ``latest`` move: a run killed at any moment resumes
from a whole checkpoint. Saving and loading are collective: every rank calls them.

Nothing is lost (docs/reliability.md): ``resume_point`` refuses a fresh start over an earlier run's outputs and a
checkpoint past ``trainer.steps``; a missing ``latest`` resumes from the newest complete checkpoint; pruning
(``keep_last``) deletes only older checkpoints of the run. Nothing is silent: a resume must find the same drafter,
target (sizes and weight digest), data layout and rows (content hash), loss and optimisation settings
(``training_recipe``). DeepSpeed's partitions, which DeepSpeed unpickles, load only when signed with this user's
key (``sign_shards`` / ``shard_problem``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import load_file

from distill.atomic import save_torch, write_text_atomically
from distill.fingerprint import check_digest, tree_digests, write_digest
from distill.toy import default_cache_dir
from heads.saved import WEIGHTS, read_drafter_config, save_drafter
from train.engine import TrainerConfig

log = logging.getLogger(__name__)

STATE, OPTIMIZER = "trainer_state.pt", "optimizer.pt"
STEP_NAME = re.compile(r"step_(\d{7})")
FRESH_DIR = "train into a fresh hydra.run.dir"


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir, step: int, engine, optimizer, drafter_cfg: Mapping, target_cfg: Mapping,
                    target_identity: Mapping, layout: Mapping, keep_last: int, recipe: Mapping | None = None,
                    metrics: Mapping | None = None, selection=None) -> Path:
    """``recipe``: the optimisation settings a resume must find unchanged (``training_recipe``); ``metrics``: the last
    logged metrics, handed back on resume so a finished run's summary survives a rerun; ``selection``: the best
    held-out τ so far and its weights (``train.selection``), stored so a resume keeps them."""
    root = checkpoint_root(run_dir)
    name = f"step_{step:07d}"
    final, tmp = root / name, root / f".{name}.partial"
    weights = engine.model_state_dict()  # collective under sharding engines; full on the main rank
    optim = engine.optimizer_state_dict(optimizer)
    rng = engine.gather_object(_rng_state())
    if engine.is_main:
        clear_partials(root)  # debris of a save that was killed or ran out of space; this run holds the run dir's lock
        tmp.mkdir(parents=True)
    engine.barrier()
    engine.save_shards(tmp)
    engine.barrier()
    if engine.is_main:
        try:
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
                "recipe": dict(recipe or {}),
                "last_metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
                "selection": selection.state() if selection is not None else None,
                **engine.extra_state(),
            }
            if selection is not None:
                selection.copy_into(tmp)
            if (tmp / "deepspeed").is_dir():  # pickled by DeepSpeed: sign what we wrote (verify_shards)
                state["shards"] = sign_shards(tmp / "deepspeed")
            save_torch(state, tmp / STATE)  # a failed write (full disk) raises OSError naming the file
            write_digest(tmp / STATE)  # checked on resume (load_checkpoint)
            if optim is not None:
                save_torch(optim, tmp / OPTIMIZER)
                write_digest(tmp / OPTIMIZER)
            # Not distill.atomic.write_dir_atomically: every rank writes into ``tmp`` (save_shards), so it needs a name
            # all ranks know before the main rank renames it; a killed save leaves it hidden, the next save clears it.
            if final.exists():  # a rerun reaching the same step
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomically(root / "latest", name)
            _prune(root, step, keep_last)
        except OSError:  # e.g. a full disk: leave no half checkpoint behind (the next save retries the cleanup)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    engine.barrier()
    return final


def clear_partials(root: Path) -> None:
    """Remove the hidden ``.step_N.partial`` directories of unfinished saves (only this name pattern: never a
    complete checkpoint, never anything else in the directory)."""
    for partial in root.glob(".step_*.partial"):
        if partial.is_dir() and STEP_NAME.fullmatch(partial.name[1 : -len(".partial")]):
            log.info("removing %s, left by an unfinished checkpoint save", partial)
            shutil.rmtree(partial, ignore_errors=True)


SCRATCH_MARK = ".specdraft-scratch-run"


def fresh_scratch_run(run_dir: str | os.PathLike) -> Path:
    """An empty run dir for a benchmark's throwaway run, marked as such. An earlier one is deleted only when it carries
    the mark (a benchmark made it); anything else at that path (a real run, a user's directory) is refused, so a
    ``--work`` pointed at a runs folder never deletes a run."""
    run_dir = Path(run_dir)
    if run_dir.exists():
        if not (run_dir / SCRATCH_MARK).is_file():
            raise FileExistsError(f"{run_dir} exists and is not a benchmark's scratch run (no {SCRATCH_MARK}); it is "
                                  f"left alone: pass another --work, or move it aside")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / SCRATCH_MARK).write_text("a benchmark's scratch run: deleted and rewritten by its next run\n")
    return run_dir


def step_of(path: Path) -> int:
    return int(STEP_NAME.fullmatch(path.name).group(1))


def complete_checkpoints(run_dir) -> list[Path]:
    """``step_*`` directories holding a trainer state, oldest first (hidden ``.partial`` ones never count)."""
    root = checkpoint_root(run_dir)
    found = [p for p in root.glob("step_*") if STEP_NAME.fullmatch(p.name) and (p / STATE).is_file()]
    return sorted(found, key=step_of)


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Keep the ``keep_last`` newest complete checkpoints up to ``step`` (the one just written among them). Only
    older ones are ever deleted: never the checkpoint ``latest`` names, never one from a later step."""
    older = [p for p in complete_checkpoints(root.parent) if step_of(p) < step]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old)


def latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint a resume continues from: the one ``checkpoints/latest`` names, or, when that pointer is missing
    (deleted, or lost with a copy), the newest complete ``step_*`` — never a silent restart over existing ones."""
    root = checkpoint_root(run_dir)
    pointer = root / "latest"
    complete = complete_checkpoints(run_dir)
    if not pointer.is_file():
        if complete:
            log.warning("%s is missing; resuming from the newest complete checkpoint, %s", pointer, complete[-1].name)
            return complete[-1]
        return None
    name = pointer.read_bytes()[:100].decode("utf-8", "replace").strip()
    fix = (f"delete {pointer} to resume from the newest complete checkpoint, {complete[-1].name}" if complete else
           f"no complete checkpoint is left in {root}: move the run dir aside and {FRESH_DIR}")
    if not STEP_NAME.fullmatch(name):
        raise ValueError(f"{pointer} holds {name[:40]!r}, not a checkpoint name like step_0000200; {fix}")
    path = root / name
    if not (path / STATE).is_file():
        raise FileNotFoundError(f"{pointer} names {path}, which is incomplete or missing; {fix}")
    return path


def resume_point(run_dir, resume: str, steps: int) -> Path | None:
    """The checkpoint this run continues from (None: a fresh start), after refusing anything that would lose data:
    a fresh start over an earlier run's outputs, or a checkpoint past ``trainer.steps``."""
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir) if resume == "auto" else None
    if ckpt is None:
        found = _earlier_outputs(run_dir, resume)
        if found:
            why = "trainer.resume=never" if resume == "never" else "there is no checkpoint to resume from, and"
            raise FileExistsError(f"hydra.run.dir={run_dir} already holds an earlier run ({', '.join(found)}); {why} "
                                  f"starting over would overwrite it: {FRESH_DIR} (or move those aside yourself)")
        return None
    if step_of(ckpt) > steps:
        raise ValueError(f"{ckpt} is at step {step_of(ckpt)}, past trainer.steps={steps}: this run dir trained longer "
                         f"than asked; set trainer.steps>={step_of(ckpt)} (a finished run reruns to done without "
                         f"training), or {FRESH_DIR}")
    return ckpt


def _earlier_outputs(run_dir: Path, resume: str) -> list[str]:
    """What a fresh start in ``run_dir`` would overwrite. Under resume=auto a metrics.jsonl without any checkpoint is
    not counted: it holds steps of a run killed before its first checkpoint, which the fresh start replays exactly."""
    found = [name for name in ("drafter", "report.json") if (run_dir / name).exists()]
    if resume == "never":
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size:
            found.append("metrics.jsonl")
        if any(checkpoint_root(run_dir).glob("step_*")):
            found.append("checkpoints/")
    return found


def saved_metrics(path: Path) -> dict:
    """The last logged metrics stored with a checkpoint (empty for checkpoints written before they were)."""
    return dict(torch.load(path / STATE, weights_only=True).get("last_metrics") or {})


def saved_selection(path: Path) -> dict | None:
    """The checkpoint's best held-out τ so far (``train.selection``); None for checkpoints written before it was."""
    return torch.load(path / STATE, weights_only=True).get("selection")


def load_checkpoint(path: Path, engine, optimizer, drafter_cfg: Mapping, target_identity: Mapping,
                    layout: Mapping, recipe: Mapping | None = None) -> int:
    """Restore drafter weights, optimizer, loss scaler and RNG in place; return the step to continue from. Anything
    that would make the continuation differ from an uninterrupted run is an error, never a silent fresh start."""
    config = read_drafter_config(path / "drafter")
    for what, saved, now in (("drafter", _node(config["drafter"]), _node(engine.module.saved_config(drafter_cfg))),
                             ("target", _dims(config["target"]), _dims(target_identity))):
        if saved != now:
            raise ValueError(
                f"checkpoint {path} was made for another {what} ({saved}) than this run's ({now}); "
                f"resume it with the drafter it was started with, or {FRESH_DIR}"
            )
    try:
        state: dict[str, Any] = torch.load(path / STATE, weights_only=True)
        weights = load_file(str(path / "drafter" / WEIGHTS))
        optim = torch.load(path / OPTIMIZER, weights_only=True) if (path / OPTIMIZER).is_file() else None
    except Exception as e:  # a truncated or corrupt file: say which, never silently restart from scratch
        raise RuntimeError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e}); delete that step_* directory "
                           f"(and checkpoints/latest) to resume from an older one, or {FRESH_DIR}") from e
    for written in (path / STATE, path / "drafter" / WEIGHTS, path / OPTIMIZER):
        if written.is_file():
            check_digest(written)
    _check_compatible(path, state, engine, target_identity, layout, recipe or {})
    if optim is None and engine.name != "deepspeed":  # DeepSpeed keeps its optimizer in deepspeed/
        raise RuntimeError(f"checkpoint {path} has no {OPTIMIZER}; it is incomplete: delete that step_* directory "
                           f"(and checkpoints/latest) to resume from an older one, or {FRESH_DIR}")
    if engine.name == "deepspeed":  # the main rank checks the signature (only it needs the key), all ranks refuse
        problem = engine.broadcast_object(shard_problem(path, state) if engine.is_main else None)
        if problem:
            raise ValueError(problem)
    try:
        engine.load_state(optimizer, weights, optim, path)
    except (RuntimeError, KeyError, ValueError) as e:
        raise RuntimeError(f"checkpoint {path} cannot be restored into this {engine.name} run ({e}); resume it with "
                           f"the trainer that wrote it (trainer.engine={state['engine']}), or {FRESH_DIR}") from e
    engine.load_extra_state(state)
    rng = state["rng"][engine.rank % len(state["rng"])]
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


def training_recipe(loss: Mapping, trainer: TrainerConfig) -> dict:
    """What must stay the same for a resume to continue the run it resumes: the loss, the optimisation settings and
    the held-out rows the best step is selected on (``eval_rows``: other rows give other figures, so another step
    could be selected). ``trainer.steps`` is left out: raising it extends a run (its cosine schedule then stretches)."""
    return {"loss": dict(loss), **{f"trainer.{k}": getattr(trainer, k) for k in
                                   ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "grad_clip", "eval_rows")}}


def _check_recipe(path: Path, saved: Mapping, now: Mapping) -> None:
    for key, value in now.items():
        if key in saved and saved[key] != value:
            raise ValueError(f"checkpoint {path} was trained with {key}={saved[key]}, this run asks for {value}: the "
                             f"resumed run would silently be another run; restore {key}={saved[key]}, or {FRESH_DIR}")


def _check_compatible(path: Path, state: Mapping, engine, target_identity: Mapping, layout: Mapping,
                      recipe: Mapping) -> None:
    digest = target_identity.get("weights_digest")
    if state.get("target_weights_digest") and digest and state["target_weights_digest"] != digest:
        raise ValueError(f"checkpoint {path} was trained against a target with other weights (digest "
                         f"{state['target_weights_digest']}, this target's is {digest}) under the same name; resume "
                         f"it against the target it was started with, or {FRESH_DIR}")
    saved = dict(state.get("data", {}))
    for key, value in layout.items():
        if key in saved and saved[key] != value:  # keys a checkpoint predates are not checked
            fix = ("set trainer.global_batch_size so micro_batch_size x grad_accum x world size matches"
                   if key == "global_batch" else
                   "the training rows differ by content (an edited data file, another file or cache with as many "
                   "rows); restore the data the run started with" if key == "rows_digest" else f"restore the run's {key}")
            raise ValueError(f"checkpoint {path} was written with data {key}={saved[key]}, this run has {value}: "
                             f"the data would not continue where it stopped; {fix}, or {FRESH_DIR}")
    _check_recipe(path, state.get("recipe") or {}, recipe)
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


def _node(drafter_cfg: Mapping) -> dict:
    """A drafter node as compared on resume: ``trust_remote_code`` is never read back from a file
    (``heads.saved.read_drafter_config``), so it is not part of what must match."""
    return {k: v for k, v in drafter_cfg.items() if k != "trust_remote_code"}


# --- DeepSpeed shards: DeepSpeed reads them with torch.load(weights_only=False), i.e. unpickles them -------------


KEY_NAME, KEY_BYTES = "checkpoint-signing.key", 32


def _signing_key() -> bytes:
    """This user's key for signing DeepSpeed checkpoints: 32 random bytes, created on first use readable by the user
    only (created 0600 and linked into place, so two processes starting at once end up with the same key), and
    checked on every use: a key that is short (an empty file signs with an empty HMAC key, which anyone can
    reproduce) or that another user can read (who could then forge signatures) is refused, never used."""
    path = default_cache_dir().expanduser() / KEY_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{KEY_NAME}.tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
            os.close(fd)
            os.link(tmp, path)  # never replaces a key another process created meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    mode = path.stat().st_mode
    if mode & 0o077:
        raise PermissionError(f"the checkpoint signing key {path} can be read or written by other users (mode "
                              f"{oct(mode & 0o777)}); anyone who reads it can forge the signature that guards DeepSpeed's "
                              f"unpickling. Run `chmod 600 {path}`, or delete it to get a new key (DeepSpeed "
                              f"checkpoints signed with the old one then no longer resume)")
    key = path.read_bytes()
    if len(key) < KEY_BYTES:
        raise ValueError(f"the checkpoint signing key {path} holds {len(key)} bytes, fewer than {KEY_BYTES}; a short or "
                         f"empty key lets anyone forge the signature that guards DeepSpeed's unpickling. Delete it; "
                         f"the next DeepSpeed checkpoint creates a new random one (checkpoints signed with the old one "
                         f"then no longer resume)")
    return key


def signing_key_problem(engine) -> str | None:
    """Why this user's signing key cannot sign or check DeepSpeed state (None: it can), the same on every rank: the
    main rank reads the key, so a run checks it once before training rather than failing on one rank mid-save."""
    problem = None
    if engine.is_main:
        try:
            _signing_key()
        except (PermissionError, ValueError) as e:
            problem = str(e)
    return engine.broadcast_object(problem)


def sign_shards(root: Path) -> dict:
    """The sha256 of every file DeepSpeed wrote under ``root``, and an HMAC of that list with this user's key."""
    files = tree_digests(root)
    mac = hmac.new(_signing_key(), repr(sorted(files.items())).encode(), hashlib.sha256).hexdigest()
    return {"files": files, "hmac": mac}


def shard_problem(path: Path, state: Mapping) -> str | None:
    """Why the DeepSpeed state of checkpoint ``path`` must not be loaded, or None. DeepSpeed unpickles it, and a pickle
    runs code: only state this user wrote here passes. The file digests live in the trainer state (read with
    weights_only=True), signed with this user's key."""
    shards, root = state.get("shards"), path / "deepspeed"
    fix = (f"resume only run dirs written by specdraft under this user's key ($SPECDRAFT_CACHE or "
           f"~/.cache/specdraft/checkpoint-signing.key), or {FRESH_DIR}")
    if not shards:
        return (f"checkpoint {path} holds DeepSpeed state with no signature; DeepSpeed would unpickle it "
                f"(torch.load(weights_only=False)), which can run code; {fix}")
    try:
        key = _signing_key()
    except (PermissionError, ValueError) as e:
        return str(e)
    expected = hmac.new(key, repr(sorted(shards["files"].items())).encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, str(shards.get("hmac"))):
        return f"checkpoint {path}: the DeepSpeed state was not signed with this user's key; refusing to unpickle it; {fix}"
    actual = tree_digests(root) if root.is_dir() else {}
    if actual != shards["files"]:
        changed = sorted(set(actual) ^ set(shards["files"]) | {k for k in actual if actual[k] != shards["files"].get(k)})
        return (f"checkpoint {path}: DeepSpeed files changed since they were written ({', '.join(changed[:4])}); "
                f"refusing to unpickle them; delete that step_* directory (and checkpoints/latest) to resume from an "
                f"older one, or {FRESH_DIR}")
    return None
