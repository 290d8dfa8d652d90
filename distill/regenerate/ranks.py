"""Regeneration across ranks (``torchrun --nproc-per-node N -m distill.regenerate ...``, or Slurm's ``srun`` with
torchrun's environment): each rank decodes its share of the batches into its own shard file, and the main rank
merges the shards into ``regenerate.out``, byte for byte the file one process writes.

Shares: batch k (the single-process batch of prompts ``[k * B, (k + 1) * B)``, decoded with the seed
``regenerate.seed + k``) goes to rank ``k mod N``, so every batch keeps its prompts and its seed on any number of
ranks. Rank r appends its batches, one fsynced batch at a time, to ``<out>.shards/rank-0000r-of-0000N.jsonl`` (with
its own sidecar and one-writer lock); a rerun after a kill (of any rank, at any moment) keeps each shard's whole
batches and decodes the rest. Once every rank is done, the main rank checks every shard, interleaves their batches
in batch order into ``<out>`` (its sidecar first, then the jsonl renamed into place: ``<out>`` exists only complete)
and removes ``<out>.shards/``. Same bytes as one process as long as each batch decodes to the same tokens: the same
engine, dtype and kernels (on a CPU, the same thread count).

A target too large for one device (``regenerate.shard=tensor``) is split over all the ranks instead: they form one
generation group that takes every batch, and the main rank writes ``<out>`` directly (``write_one_group``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from distill.atomic import write_file_atomically
from distill.data import DataConfig
from distill.lock import WriterLockedError, writer_lock
from distill.ranks import Ranks
from distill.regenerate import (Prompt, _check_sidecar, _lines_to_keep, _prepare_out, _write_meta, batch_plan,
                                build_meta, check_settings, decode_batches)

log = logging.getLogger(__name__)


def shard_dir(out: Path) -> Path:
    return Path(f"{out}.shards")


def shard_path(out: Path, rank: int, world: int) -> Path:
    return shard_dir(out) / f"rank-{rank:05d}-of-{world:05d}.jsonl"


def _complete(out: Path, meta: Mapping, plan: Sequence[range]) -> bool:
    """Whether ``out`` (checked against the sidecar) holds every batch of ``plan``; refused when it is partial: a
    merged file is only ever renamed into place whole, so a partial one was started by a single process."""
    if not out.exists():
        return False
    _check_sidecar(out, meta)
    batches, size = _lines_to_keep(out, plan)
    if batches < len(plan) or size < out.stat().st_size:
        raise ValueError(f"regenerate.out={out} is a partial file written by a single process; finish it with the "
                         f"same single-process command, or delete it (and {out.name}.meta.json) to regenerate it "
                         f"across ranks")
    return True


def write_sharded(out: Path, teacher, prompts: Sequence[Prompt], data_cfg: DataConfig, settings: Mapping,
                  ranks: Ranks, writer: Mapping | None = None) -> Path:
    """Every rank its share into its shard, then the main rank's merge. The main rank holds ``out``'s lock from the
    start (``writer``: as ``write_regenerated``'s): another job writing ``out`` is met before a prompt is decoded,
    not at the merge, with every shard decoded and ``<out>.shards/`` left behind."""
    check_settings(settings)
    meta = build_meta(teacher, data_cfg, settings, prompts)
    total, batch_size = len(prompts), int(settings["batch_size"])
    full_plan = batch_plan(total, batch_size)
    with contextlib.ExitStack() as stack:
        _hold_on_main(stack, out, ranks, {"what": "regenerate.out", **(writer or {})})
        if _complete(out, meta, full_plan):
            log.info("regenerate: %s already holds all %d prompts", out, total)
            if ranks.is_main and shard_dir(out).is_dir():  # a merge killed after its rename
                shutil.rmtree(shard_dir(out))
            return out
        shard = shard_path(out, ranks.rank, ranks.world)
        plan = batch_plan(total, batch_size, ranks.rank, ranks.world)
        with writer_lock(shard, "regenerate.out"):  # one writer per shard
            done = _prepare_out(shard, meta, plan, "regenerate.out shard")
            decode_batches(shard, teacher, prompts, data_cfg, settings, plan, done)
        ranks.barrier()
        if ranks.is_main:
            merge_shards(out, meta, total, batch_size, ranks.world)
        ranks.barrier()
    return out


def _hold_on_main(stack: contextlib.ExitStack, out: Path, ranks: Ranks, writer: Mapping) -> None:
    """``out``'s writer lock, taken by the main rank into ``stack``; every rank raises when it could not be taken
    (a rank left alone would wait for the others forever)."""
    problem = None
    if ranks.is_main:
        try:
            stack.enter_context(writer_lock(out, **writer))
        except (OSError, RuntimeError) as e:  # another job's lock (WriterLockedError), a path in the way
            problem = e
    if ranks.broadcast is None:  # no way to tell the others: the main rank's error ends the job
        if problem is not None:
            raise problem
        return
    failed = ranks.broadcast(None if problem is None else str(problem))
    if problem is not None:
        raise problem
    if failed:
        raise WriterLockedError(failed)


def write_one_group(out: Path, teacher, prompts: Sequence[Prompt], data_cfg: DataConfig, settings: Mapping,
                    ranks: Ranks, writer: Mapping | None = None) -> Path:
    """``regenerate.shard=tensor``: the target is split over every rank, so the ranks form one generation group
    that decodes every batch together (each forward is collective), and only the main rank writes ``out``, resuming
    it as one process does. The other ranks learn from it how many batches are already there."""
    meta = build_meta(teacher, data_cfg, settings, prompts)  # every rank: the weights digest gathers the split embeddings
    plan = batch_plan(len(prompts), int(settings["batch_size"]))
    with contextlib.ExitStack() as stack:
        done, problem = 0, None
        if ranks.is_main:
            try:
                stack.enter_context(writer_lock(out, **{"what": "regenerate.out", **(writer or {})}))
                done = _prepare_out(out, meta, plan)
            except (OSError, ValueError, RuntimeError) as e:  # a held lock, a file of another config
                problem = e
        # Every rank learns whether the writer could start: a lone rank would wait in the first forward forever.
        done, failed = ranks.broadcast((done, None if problem is None else f"{type(problem).__name__}: {problem}"))
        if problem is not None:
            raise problem
        if failed:
            raise RuntimeError(f"regenerate: the main rank could not start {out}: {failed}")
        decode_batches(out, teacher, prompts, data_cfg, settings, plan, done, write=ranks.is_main)
    ranks.barrier()
    return out


def merge_shards(out: Path, meta: Mapping, total: int, batch_size: int, world: int) -> Path:
    """Interleave the ``world`` complete shards of ``out`` in batch order into ``out``; then remove them."""
    per_rank = []
    for rank in range(world):
        shard, plan = shard_path(out, rank, world), batch_plan(total, batch_size, rank, world)
        if not shard.is_file():
            raise FileNotFoundError(f"regenerate: shard {shard} is missing; rerun the same command on {world} ranks")
        _check_sidecar(shard, meta)
        batches, size = _lines_to_keep(shard, plan, "regenerate.out shard")
        if batches < len(plan):
            raise ValueError(f"regenerate: shard {shard} holds {batches} of its {len(plan)} batches; rerun the same "
                             f"command on {world} ranks to finish it")
        lines, first, batches_of_rank = shard.read_bytes()[:size].splitlines(keepends=True), 0, []
        for batch in plan:
            batches_of_rank.append(b"".join(lines[first: first + len(batch)]))
            first += len(batch)
        per_rank.append(batches_of_rank)

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            for k in range(len(batch_plan(total, batch_size))):
                f.write(per_rank[k % world][k // world])
            f.flush()
            os.fsync(f.fileno())

    _write_meta(out, meta)
    write_file_atomically(out, write)
    shutil.rmtree(shard_dir(out))
    log.info("regenerate: merged %d shards into %s (%d prompts)", world, out, total)
    return out
