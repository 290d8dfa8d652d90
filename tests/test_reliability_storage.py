"""Run dirs and files on a shared filesystem: the run dir locked as Hydra resolves it, a run dir this user may not
write, a disk the libraries' own writes fill, and a refused command that must leave the run dir as it found it.

Each test is one case of docs/reliability.md. Smoke-sized runs (the tiny toy target, a few steps) in-process; cases
that start several ``python -m train`` processes are marked slow. Read-only directories and small disks are tmpfs
mounts where permissions do not bind (root), skipped where mounting is not allowed.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_reliability_cluster import ROOT, cache, finished, holder, run_dir  # noqa: F401 (fixtures)
from tests.test_reliability_run import compose_cfg, snapshot, steps_logged
from train.run import run_training

# --- the run dir's lock -------------------------------------------------------------------------------------------


TINY_RUN = ["experiment=smoke", "drafter=medusa", "drafter.num_heads=1", "trainer.device=cpu", "trainer.steps=2",
            "trainer.micro_batch_size=1", "trainer.ckpt_every=1000", "trainer.num_threads=1", "data.max_length=32",
            "data.corpus_max_bytes=20000", "eval.enabled=false"]


def _train_cli(run_dir: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "train", *TINY_RUN, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_four_jobs_of_one_array_train_in_the_run_dirs_hydra_resolves(tmp_path, tiny_toy_target, holder):
    """``hydra.run.dir=<dir>/task_${oc.env:TASK}``: four jobs started together (a job array) lock four dirs, not the
    one unresolved string, and all train; a job whose dir resolves to one another job holds is refused in one line,
    having written nothing there."""
    jobs = [_train_cli(f"{tmp_path}/task_${{oc.env:TASK}}", {"TASK": str(task)}) for task in range(4)]
    for task, job in enumerate(jobs):
        _, err = job.communicate(timeout=600)
        assert job.returncode == 0, err[-2000:]
        assert (tmp_path / f"task_{task}" / "drafter" / "model.safetensors").is_file()
    busy = tmp_path / "busy"
    held = holder(busy)
    job = _train_cli(f"'{tmp_path}/bu${{oc.env:PART}}'", {"PART": "sy"})  # quoted, as a shell passes it on
    _, err = job.communicate(timeout=600)
    assert job.returncode == 1 and err.count("\n") == 1, err[-2000:]
    assert f"hydra.run.dir={busy} is being written by another process" in err and f"pid {held.pid}" in err
    assert not busy.exists()


def test_the_run_dir_lock_is_taken_on_the_dir_hydra_resolves(tmp_path, monkeypatch, holder):
    from distill.environment import check_run_dir_override

    for task in range(4):  # a job array's tasks: one dir each, not one lock on the unresolved string
        monkeypatch.setenv("TASK", str(task))
        check_run_dir_override(["experiment=smoke", f"hydra.run.dir={tmp_path}/task_${{oc.env:TASK}}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".task_{task}.lock" for task in range(4)]
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    check_run_dir_override(["hydra.run.dir='~/runs/a'"])  # quotes stripped, ~ expanded: never a literal ./~
    assert (tmp_path / "home" / "runs" / ".a.lock").is_file() and not (ROOT / "~").exists()
    held = holder(tmp_path / "busy")
    monkeypatch.setenv("PART", "sy")
    with pytest.raises(SystemExit, match=rf"^error: hydra.run.dir={tmp_path / 'busy'} is being written .*pid "
                                         rf"{held.pid}[^\n]*$"):
        check_run_dir_override([f"hydra.run.dir='{tmp_path}/bu${{oc.env:PART}}'"])


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this user cannot write holding ``run``, one it can: by permissions, or for root (whom permissions
    do not stop) by a read-only tmpfs mount with a writable one inside; skipped where root may not mount."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        (ro / "run").mkdir()
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    mounted = []

    def mount(where: Path, options: str) -> None:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True).returncode:
            pytest.skip("needs a read-only directory: root ignores permissions, and mount is not allowed here")
        mounted.append(where)

    try:
        mount(ro, "size=1m")
        (ro / "run").mkdir()
        mount(ro, "remount,ro,size=1m")
        mount(ro / "run", "size=1m")
        yield ro
    finally:
        for where in sorted(set(mounted), key=lambda p: -len(p.parts)):
            subprocess.run(["umount", str(where)], check=True)


def test_an_unwritable_run_dir_is_one_line_before_hydra_starts(read_only_dir, monkeypatch):
    import fcntl

    from distill.environment import check_run_dir_override
    from distill.lock import lock_file_for

    for run_dir in (read_only_dir / "new", read_only_dir / "new" / "deeper"):
        with pytest.raises(SystemExit, match=rf"^error: hydra.run.dir={run_dir} cannot be created: {read_only_dir} "
                                             rf"is not writable .*choose a hydra.run.dir"):
            check_run_dir_override([f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit, match=rf"^error: hydra.run.dir={read_only_dir} is not writable"):
        check_run_dir_override([f"hydra.run.dir={read_only_dir}"])
    run_dir = read_only_dir / "run"  # writable, in a parent that is not: the lock goes to this user's lock dir
    check_run_dir_override([f"hydra.run.dir={run_dir}"])
    lock = lock_file_for(run_dir)
    assert list(run_dir.iterdir()) == [] and lock.parent == Path(os.environ["SPECDRAFT_CACHE"]) / "locks"
    fd = os.open(lock, os.O_RDWR)
    with pytest.raises(BlockingIOError):  # held
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


# --- refused commands ---------------------------------------------------------------------------------------------


def test_a_refusal_puts_back_what_hydra_wrote_at_start_up(tmp_path, monkeypatch):
    """In-process: the run dir as Hydra found it, then Hydra's start-up writes (``.hydra/`` rewritten, a log line
    appended, a file created), then a refusal: the run dir is as it was, times included."""
    import distill.environment as environment

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run / "__main__.log").write_text("[the run's own log]\n")
    before = snapshot(run)
    monkeypatch.setattr(environment, "_startup", {})
    monkeypatch.setattr(sys, "argv", ["train", f"hydra.run.dir={run}", "seed=1"])
    environment.check_run_dir_override()
    (run / ".hydra" / "config.yaml").write_text("seed: 1\n")  # what Hydra does before the task function runs
    (run / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    with (run / "__main__.log").open("a") as log:
        log.write("[loading the target]\n")

    def refused():
        raise ValueError("checkpoint ... was written with data seed=0, this run has 1")

    with pytest.raises(SystemExit, match="seed=0"):
        environment.one_line_errors(refused)()
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_refused_command_writes_nothing_into_the_run_dir_it_refuses(run_dir, cache):
    """What Hydra writes before any of our code runs (``.hydra/``, the job log) is put back when the command is then
    refused: another seed on resume, ``trainer.resume=never`` over an earlier run, an evaluation into another run."""
    hydra = run_dir / ".hydra"
    hydra.mkdir()
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (hydra / name).write_text(f"# the run's own {name}\n")
    (run_dir / "__main__.log").write_text("[the run's own log]\n")
    same = ["experiment=smoke", "drafter=medusa", "drafter.num_heads=2", f"target.cache_dir={cache}",
            "data.corpus_max_bytes=60000", "trainer.steps=4", "trainer.ckpt_every=2", "trainer.log_every=1",
            "trainer.micro_batch_size=2", "trainer.device=cpu", "eval.enabled=false", f"hydra.run.dir={run_dir}"]
    lookup = ["drafter=lookup", "experiment=smoke", "eval.num_prompts=1", "trainer.device=cpu",
              f"hydra.run.dir={run_dir}"]
    before = snapshot(run_dir)
    for module, args, refusal in (("train", [*same, "seed=1"], "seed"), ("train", [*same, "trainer.resume=never"],
                                  "fresh hydra.run.dir"), ("eval", lookup, "another run's outputs")):
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 1 and refusal in proc.stderr, proc.stderr[-2000:]
        assert snapshot(run_dir) == before, (module, args[-1])


# --- full disks ---------------------------------------------------------------------------------------------------


@pytest.fixture
def small_disk():
    """``mount(dir, bytes)``: a tmpfs of that size at ``dir``, for the libraries' own writes to fill (torch's zip
    writer, safetensors); it returns ``resize(bytes)``, which keeps the files. Skipped where this user may not
    mount."""
    mounted = []

    def mount(where: Path, size: int):
        where.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode:
            pytest.skip("needs a small filesystem to fill: mounting a tmpfs is not allowed here")
        mounted.append(where)
        return lambda bigger: subprocess.run(["mount", "-o", f"remount,size={bigger}", str(where)], check=True)

    yield mount
    for where in reversed(mounted):  # lazily: a failed torch.save may leave its file open until collected
        subprocess.run(["umount", "-l", str(where)], check=True)


def _bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("free_share, failing", [(4, "SafetensorError"), (2, "RuntimeError")],
                         ids=["safetensors", "torch.save"])
def test_a_disk_filled_by_torch_and_safetensors_writes_is_one_line_and_keeps_the_last_checkpoint(
        finished, cache, tmp_path, small_disk, free_share, failing):
    """The real libraries fail (torch.save raises RuntimeError, safetensors SafetensorError, neither an OSError): the
    run still stops in one line naming the file and the space it needs, removes the unfinished checkpoint, keeps the
    previous one whole, and resumes from it once there is space. A quarter of a checkpoint free: its drafter's
    safetensors file fills the disk; half: the optimizer state torch.save writes after it."""
    from distill.environment import one_line_errors

    one = _bytes_under(finished / "checkpoints" / "step_0000002")
    run = tmp_path / "run"
    resize = small_disk(run / "checkpoints", one + one // free_share)  # room for one checkpoint, not two
    overrides = ("trainer.eval_every=0", "trainer.select=last")  # no best_tau/ copy to fill the disk first
    with pytest.raises(SystemExit) as err:
        one_line_errors(run_training)(compose_cfg(cache, *overrides), run)
    assert type(err.value.__context__.__cause__).__name__ == failing  # the library's own error, translated
    message = str(err.value.code)
    assert "\n" not in message and "no space left writing" in message and "step_0000004" in message, message
    assert "the file needs about" in message and "MiB free there" in message
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000002"]  # no partial, the last one kept
    assert (root / "latest").read_text() == "step_0000002"
    assert snapshot(root / "step_0000002").keys() == snapshot(finished / "checkpoints" / "step_0000002").keys()
    resize(64 << 20)  # space is back
    run_training(compose_cfg(cache, *overrides), run)
    assert (root / "latest").read_text() == "step_0000004" and steps_logged(run) == [0, 1, 2, 3]


def test_a_full_disk_during_an_export_is_one_line_and_keeps_the_earlier_export(finished, tmp_path, small_disk):
    from distill.environment import explain
    from serve.export import export_drafter

    out = tmp_path / "disk" / "export"
    resize = small_disk(out.parent, 64 << 20)
    export_drafter(finished / "drafter", "vllm", out)
    resize(shutil.disk_usage(out.parent).used + _bytes_under(out) // 2)  # one export fits, not two
    before = snapshot(out.parent)
    with pytest.raises(OSError) as err:
        export_drafter(finished / "drafter", "vllm", out, overwrite=True)
    line = explain(err.value)
    assert err.value.errno == errno.ENOSPC and "\n" not in line and "model.safetensors" in line, line
    assert "the file needs about" in line
    assert snapshot(out.parent) == before  # the earlier export whole, nothing of the failed one left
