"""Writers that meet each other: a DeepSpeed start behind the build lock a killed start left, and two regenerations
of the same data at once. One test per case of docs/reliability.md."""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from distill.ranks import Ranks
from tests.test_regenerate import _words, compose, count_decodes, make_teacher, make_tokenizer, text_data
from tests.test_reliability_cluster import ROOT, holder  # noqa: F401 (fixture)

# --- torch's extension build lock ---------------------------------------------------------------------------------


def _plant_lock(extensions: Path, age_s: float) -> Path:
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_deepspeed_start_behind_a_killed_builds_lock_is_one_line_naming_it(tmp_path):
    """A lock a killed build left (an hour old, nothing building): the DeepSpeed engine refuses at once, naming
    the file, where DeepSpeed would poll it forever."""
    lock = _plant_lock(tmp_path / "ext", age_s=3600)
    code = ("from distill.environment import one_line_errors\n"  # as the entry points wrap their work
            "from train.engine import TrainerConfig, build_engine\n"
            "one_line_errors(build_engine)(TrainerConfig(engine='deepspeed', device='cpu'))\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the DeepSpeed start waited on {lock} for 120 s")
    error = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and len(error) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"torch's build lock {lock} is 36" in error[0] and "s old and no build is running" in error[0]
    assert f"remove it (rm {lock})" in error[0] and lock.exists()  # named, never removed behind a user's back


def test_a_build_lock_with_a_build_behind_it_is_waited_for(tmp_path, monkeypatch):
    from train.extensions import check_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = _plant_lock(tmp_path / "ext", age_s=3600)
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.parent)
    slept = []

    def sleep(seconds):  # the build finishes after a few polls: it removes its lock
        slept.append(seconds)
        if len(slept) == 3:
            lock.unlink()
        time.sleep(0.05)

    try:
        check_build_locks(["deepspeed_shm_comm"], sleep=sleep)  # an old lock, but a build works behind it
    finally:
        builder.kill()
        builder.wait()
    assert len(slept) == 3
    young = _plant_lock(tmp_path / "young", age_s=0)  # just taken, its compiler not started yet: waited, bounded
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "young"))
    with pytest.raises(ValueError, match=rf"torch's build lock {young} is \d+ s old and no build is running"):
        check_build_locks(["deepspeed_shm_comm"], stale_after=0.3, poll=0.05)


# --- two regenerations of the same data ---------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(_words(random.Random(0), 300))
    return path


def test_a_second_training_regenerating_the_same_data_waits_and_reuses_the_answers(tmp_path, corpus, monkeypatch,
                                                                                   holder):
    """Two trainings with ``data.mode=regenerate`` on the same data share one answers file (its name is the content's
    key): the second waits for the first to finish writing it and trains on its answers; it is never told to change
    ``regenerate.out``, a key neither job set."""
    from train import run

    teacher = make_teacher(make_tokenizer())
    cfg = compose([*text_data(corpus), "data.mode=regenerate", f"target.cache_dir={tmp_path / 'c'}"], None)
    answers = run.regenerate_first(cfg, teacher)  # what the other job writes
    written = answers.read_bytes()
    job = holder(answers)  # ... while it still holds the file
    decodes = count_decodes(monkeypatch)
    threading.Timer(1.0, job.kill).start()  # the other job finishes
    assert run.regenerate_first(cfg, teacher) == answers
    assert decodes == [] and answers.read_bytes() == written  # waited for, then reused: nothing decoded again
    job = holder(answers)  # a writer that outlasts the wait: one line, and still no key to change
    monkeypatch.setattr(run, "REGENERATE_WAIT_S", 0.5)
    with pytest.raises(RuntimeError, match=rf"data.mode=regenerate: its answers file {answers} is being written by "
                                           rf"another process \(.*pid {job.pid}.*\); another job is regenerating the "
                                           rf"same answers, and this one waited 0 s for it; rerun the same command "
                                           rf"once it is done") as refused:
        run.regenerate_first(cfg, teacher)
    assert "regenerate.out" not in str(refused.value)


def _on_ranks(world: int, work) -> list:
    """``work(ranks)`` on ``world`` threads standing in for the ranks of one job (a barrier and rank 0's broadcast
    between them); what each returned or raised."""
    barrier, box, results = threading.Barrier(world, timeout=30), [None], [None] * world

    def broadcast(rank, value):
        if rank == 0:
            box[0] = value
        barrier.wait()
        value = box[0]
        barrier.wait()
        return value

    def rank_of(rank):
        ranks = Ranks(rank=rank, world=world, barrier=barrier.wait, broadcast=functools.partial(broadcast, rank))
        try:
            results[rank] = work(ranks)
        except Exception as e:  # noqa: BLE001 (each rank's outcome is what the test reads)
            results[rank] = e

    threads = [threading.Thread(target=rank_of, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def test_a_two_rank_regeneration_beside_another_writer_decodes_nothing_and_leaves_no_shards(tmp_path, corpus,
                                                                                            monkeypatch, holder):
    from distill.data import DataConfig
    from distill.lock import WriterLockedError
    from distill.regenerate import prompts_from_data, write_regenerated
    from distill.regenerate.ranks import shard_dir
    from train.config import RegenerateConfig

    teacher = make_teacher(make_tokenizer())
    data_cfg = DataConfig(source="file", path=str(corpus), max_length=24)
    prompts = prompts_from_data(data_cfg, teacher.tokenizer, 8, 7)
    out = tmp_path / "regen.jsonl"
    settings = asdict(RegenerateConfig(out=str(out), batch_size=3))
    job = holder(out)  # a single-process regeneration writing the same file
    decodes = count_decodes(monkeypatch)
    refused = _on_ranks(2, lambda ranks: write_regenerated(out, teacher, prompts, data_cfg, settings, ranks))
    for error in refused:  # both ranks, before a prompt is decoded: no shards to leave behind
        assert isinstance(error, WriterLockedError) and f"pid {job.pid}" in str(error), error
        assert "delete" not in str(error)
    assert decodes == [] and not shard_dir(out).exists() and not out.exists()
    threading.Timer(1.0, job.kill).start()  # a training's 2-rank regeneration waits for it instead, then writes
    done = _on_ranks(2, lambda ranks: write_regenerated(out, teacher, prompts, data_cfg, settings, ranks,
                                                        {"what": "data.regenerated", "wait": 60.0}))
    assert done == [out, out] and not shard_dir(out).exists()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == list(range(7))
