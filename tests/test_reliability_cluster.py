"""Safe on a shared cluster: signals, two jobs meeting in one output, flags that delete, keys, environment errors.

Each test is one case a job on a shared cluster meets (docs/reliability.md lists them): a SIGTERM / Ctrl-C / SIGHUP
mid-run, a second job writing the same run dir, regeneration file or teacher cache, ``overwrite=true`` aimed at
something an export did not write, ``python -m eval`` aimed at another run, an extended run exporting its old report,
a weak signing key, ``+key=value`` outside the schema, a full disk, a path that is a file, a damaged or unreachable
target. Smoke-sized runs (the tiny toy target, a few steps) in-process; the 2-rank launcher case is marked slow. Run
dirs and files on a shared filesystem (locks as Hydra resolves them, read-only dirs, disks the libraries fill,
refused commands) are in ``test_reliability_storage.py``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from tests.test_reliability_run import CONF, compose_cfg, run_eval_cli, eval_overrides, snapshot, steps_logged
from train import checkpoint
from train.config import load_config
from train.run import run_training

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tiny_toy_target):
    return Path(os.environ["SPECDRAFT_CACHE"])  # where the session built the tiny target


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("finished")
    run_training(compose_cfg(cache), run_dir)
    return run_dir


@pytest.fixture
def run_dir(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "drafter" / "model.safetensors"))


# --- signals ------------------------------------------------------------------------------------------------------


SIGNAL_RUN = ("trainer.steps=6", "trainer.ckpt_every=4")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    """The signal test's reference: the same run never signalled, trained once for every signal (read only)."""
    run_dir = tmp_path_factory.mktemp("whole")
    run_training(compose_cfg(cache, *SIGNAL_RUN), run_dir)
    return run_dir


@pytest.fixture
def survivable(request):
    """Outside the training steps a signal keeps the process's own handler: a no-op one for the test's duration, so
    a signal the run failed to catch fails the test instead of ending the test session (SIGHUP's default kills)."""
    sig = request.param
    previous = signal.signal(sig, lambda *_: None)
    yield sig
    signal.signal(sig, previous)


# SIGINT and SIGUSR1 go through the same handler and loop as SIGTERM: slow, as they only repeat it.
@pytest.mark.parametrize("survivable", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                        pytest.param(signal.SIGUSR1, marks=pytest.mark.slow), signal.SIGHUP],
                         indirect=True, ids=lambda s: s.name)
def test_a_signal_checkpoints_the_finished_step_and_the_rerun_resumes_exactly(cache, uninterrupted, tmp_path,
                                                                             monkeypatch, caplog, survivable):
    import train.loop

    sig = survivable
    overrides = SIGNAL_RUN
    lr_at = train.loop.lr_at

    def signalled(step, trainer_cfg):  # the signal lands during step 2, as a pre-emption would
        if step == 2:
            os.kill(os.getpid(), sig)
        return lr_at(step, trainer_cfg)

    monkeypatch.setattr(train.loop, "lr_at", signalled)
    handler = signal.getsignal(sig)
    with pytest.raises(SystemExit) as stopped:  # train.preemption.Preempted
        run_training(compose_cfg(cache, *overrides), tmp_path / "cut")
    assert stopped.value.code == 128 + sig  # the shell's convention: 143 for SIGTERM, 130 for SIGINT
    assert signal.getsignal(sig) == handler  # the process's own handlers are back
    cut = tmp_path / "cut"
    assert (cut / "checkpoints" / "latest").read_text() == "step_0000003"  # step 2 finished, nothing lost
    assert steps_logged(cut) == [0, 1, 2] and not (cut / "drafter").exists()
    lines = [r.getMessage() for r in caplog.records if "stopped after step" in r.getMessage()]
    assert len(lines) == 1 and signal.Signals(sig).name in lines[0] and "step_0000003" in lines[0]
    monkeypatch.setattr(train.loop, "lr_at", lr_at)
    run_training(compose_cfg(cache, *overrides), cut)  # the same command again
    assert curve(cut) == curve(uninterrupted)  # bit for bit: loss and gradient norm of every step
    for name, value in weights(uninterrupted).items():
        assert torch.equal(weights(cut)[name], value), name
    drafter_file = Path("drafter") / "model.safetensors"
    assert (cut / drafter_file).read_bytes() == (uninterrupted / drafter_file).read_bytes()


def _launch_two_ranks(run_dir: Path, steps: int, stop_at: int | None = None,
                      sig: signal.Signals = signal.SIGTERM) -> tuple[int, str]:
    cmd = [str(ROOT / "scripts" / "train.sh"), "experiment=smoke", "trainer.device=cpu", f"trainer.steps={steps}",
           "trainer.log_every=1", "trainer.ckpt_every=1000", "trainer.num_threads=1", "eval.enabled=false",
           "data.corpus_max_bytes=60000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NPROC": "2", "SPECDRAFT_RUN_DIR": str(run_dir),
           "PYTHON": sys.executable}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if stop_at is not None:
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None and (not metrics.is_file() or len(metrics.read_text().splitlines()) < stop_at):
            time.sleep(0.02)
        proc.send_signal(sig)  # to the launcher, as Slurm, `kill` or a closed ssh session would
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_two_ranks_sigtermed_through_the_launcher_resume_to_the_uninterrupted_curve(tmp_path, tiny_toy_target, sig):
    steps = 120
    rc, out = _launch_two_ranks(tmp_path / "whole", steps)
    assert rc == 0, out[-3000:]
    rc, out = _launch_two_ranks(tmp_path / "cut", steps, stop_at=5, sig=sig)
    assert rc == 128 + sig, out[-3000:]
    assert out.count(f"received {sig.name}: stopped after step") == 1  # rank 0 says it, once
    stopped = checkpoint.step_of(checkpoint.latest_checkpoint(tmp_path / "cut"))
    assert 5 <= stopped < steps and not (tmp_path / "cut" / "drafter").exists()
    rc, out = _launch_two_ranks(tmp_path / "cut", steps)
    assert rc == 0, out[-3000:]
    assert curve(tmp_path / "cut") == curve(tmp_path / "whole")
    for name, value in weights(tmp_path / "whole").items():
        assert torch.equal(weights(tmp_path / "cut")[name], value), name


# --- one writer per output ----------------------------------------------------------------------------------------


@pytest.fixture
def holder():
    """Another process holding the writer lock of a path, as a second job would; killed (-9) by the test."""
    procs = []

    def hold(path: Path) -> subprocess.Popen:
        code = ("import sys, time\nfrom distill.lock import writer_lock\n"
                "with writer_lock(sys.argv[1], 'x'):\n    print('held', flush=True)\n    time.sleep(120)\n")
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_job_in_a_running_run_dir_is_refused_naming_the_holder(run_dir, cache, holder):
    before = snapshot(run_dir)
    job = holder(run_dir)
    with pytest.raises(RuntimeError, match=rf"another process \(host .*, pid {job.pid}, started "):
        run_training(compose_cfg(cache, "seed=1", "trainer.steps=6"), run_dir)
    from distill.environment import check_run_dir_override

    with pytest.raises(SystemExit, match=rf"hydra.run.dir={run_dir} is being written .*pid {job.pid}"):
        check_run_dir_override(["seed=1", f"hydra.run.dir={run_dir}"])  # the CLI: before Hydra writes .hydra/
    assert snapshot(run_dir) == before
    job.kill()  # killed, as a pre-empted job is: its lock goes with it, no stale lock to clean up
    job.wait()
    run_training(compose_cfg(cache, "trainer.steps=6"), run_dir)
    assert steps_logged(run_dir) == [0, 1, 2, 3, 4, 5]


def test_a_second_regeneration_or_cache_writer_is_refused(tmp_path, holder, tiny_teacher):
    from distill.cache import write_cache
    from distill.data import DataConfig
    from distill.regenerate import write_regenerated
    from train.config import RegenerateConfig

    out = tmp_path / "regen.jsonl"
    job = holder(out)
    with pytest.raises(RuntimeError, match=rf"regenerate.out=.*pid {job.pid}"):
        write_regenerated(out, tiny_teacher, [], DataConfig(), asdict(RegenerateConfig(out=str(out))))
    assert not out.exists()
    job = holder(tmp_path / "cache")
    with pytest.raises(RuntimeError, match=rf"cache.dir=.*pid {job.pid}"):
        write_cache(tmp_path / "cache", tiny_teacher, [], DataConfig(), [1], topk=4)


def test_a_regeneration_file_written_twice_over_is_refused_when_training_reads_it(tmp_path):
    from distill.data import DataConfig
    from distill.regenerate import load_regenerated

    rows = [{"id": i, "prompt_ids": [1, 2], "prompt_loss_mask": [False, False], "completion_ids": [3, 4],
             "finish": "length"} for i in (0, 1)]
    path = tmp_path / "regen.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + rows))  # two writers each wrote every row
    with pytest.raises(ValueError, match="line 3 has id 0, expected 2.*two jobs at once"):
        load_regenerated(path, SimpleNamespace(eos_token_id=5, pad_token_id=0), DataConfig(max_length=8))


# --- flags that delete --------------------------------------------------------------------------------------------


def test_export_overwrite_replaces_only_an_earlier_export(run_dir, tmp_path):
    from serve.export import export_drafter

    other_run = tmp_path / "other"
    shutil.copytree(run_dir, other_run)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for target in (other_run, mine):
        before = snapshot(target)
        with pytest.raises(FileExistsError, match="not an earlier export"):
            export_drafter(run_dir / "drafter", "vllm", target, overwrite=True)
        assert snapshot(target) == before
    out = export_drafter(run_dir / "drafter", "vllm", tmp_path / "export")
    first = snapshot(out)
    export_drafter(run_dir / "drafter", "vllm", out, overwrite=True)  # an earlier export: replaced
    assert snapshot(out).keys() == first.keys()


def test_export_overwrite_refuses_an_earlier_export_holding_files_it_did_not_write(run_dir, tmp_path):
    from serve.export import export_drafter

    out = export_drafter(run_dir / "drafter", "vllm", tmp_path / "export")
    manifest = json.loads((out / "specdraft_export.json").read_text())["files"]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == manifest
    (out / "notes.txt").write_text("mine")  # a user's file, added beside the export
    before = snapshot(out)
    with pytest.raises(FileExistsError, match=r"files it did not write \(notes.txt\); .*move those files out"):
        export_drafter(run_dir / "drafter", "vllm", out, overwrite=True)
    assert snapshot(out) == before
    (out / "notes.txt").unlink()
    export_drafter(run_dir / "drafter", "vllm", out, overwrite=True)  # the export's own files only: replaced


def test_export_overwrite_through_a_symlink_replaces_the_export_it_names(run_dir, tmp_path):
    from serve.export import export_drafter

    exports = tmp_path / "exports"
    real = export_drafter(run_dir / "drafter", "vllm", exports / "v1")
    link = exports / "latest"
    link.symlink_to(real)
    first = snapshot(real)
    assert export_drafter(run_dir / "drafter", "vllm", link, overwrite=True) == link  # reported as done
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert snapshot(real).keys() == first.keys()
    assert sorted(p.name for p in exports.iterdir()) == ["latest", "v1"]  # no swapped-out copy left behind


def test_eval_never_writes_over_another_runs_report(run_dir, tmp_path):
    lookup = ["drafter=lookup", "experiment=smoke", "eval.num_prompts=1", "eval.hf_baselines=false",
              "eval.plots=false", "eval.warmup_prompts=0", "eval.baselines=[]", "trainer.device=cpu"]
    before = snapshot(run_dir)
    with pytest.raises(FileExistsError, match="another run's outputs"):
        run_eval_cli(lookup, run_dir)
    assert snapshot(run_dir) == before
    report = run_eval_cli(eval_overrides(run_dir / "drafter"), run_dir)  # the run's own drafter: its report
    assert report["results"][0]["weights_digest"] and (run_dir / "report.json").is_file()
    with pytest.raises(FileExistsError, match="another run's outputs"):  # still not a lookup report over it
        run_eval_cli(lookup, run_dir)
    run_eval_cli(lookup, tmp_path / "fresh")
    with pytest.raises(FileExistsError, match="report.json"):  # an eval dir holding another drafter's report
        run_eval_cli(eval_overrides(run_dir / "drafter"), tmp_path / "fresh")


def test_an_extended_run_never_exports_its_old_report(run_dir, cache, tmp_path):
    from serve.export import export_drafter

    def card(out: Path) -> str:  # as scripts/export.py does: the run dir's report.json goes to the model card
        report = json.loads((run_dir / "report.json").read_text())
        return (export_drafter(run_dir / "drafter", "vllm", out, report=report) / "README.md").read_text()

    run_eval_cli(eval_overrides(run_dir / "drafter"), run_dir)
    tau = json.loads((run_dir / "report.json").read_text())["results"][0]["tau"]
    assert f"| {tau:.2f} |" in card(tmp_path / "a")
    run_training(compose_cfg(cache, "trainer.steps=6"), run_dir)  # eval.enabled=false: the old report stays
    card = card(tmp_path / "b")
    assert "Not measured with this checkpoint" in card and "| τ |" not in card


def test_fresh_scratch_run_deletes_only_a_benchmarks_own_run(run_dir, tmp_path):
    before = snapshot(run_dir)
    with pytest.raises(FileExistsError, match="not a benchmark's scratch run"):
        checkpoint.fresh_scratch_run(run_dir)
    assert snapshot(run_dir) == before
    scratch = checkpoint.fresh_scratch_run(tmp_path / "scratch")
    (scratch / "metrics.jsonl").write_text("{}\n")
    assert list(checkpoint.fresh_scratch_run(scratch).iterdir()) == [scratch / checkpoint.SCRATCH_MARK]


# --- keys, config, environment ------------------------------------------------------------------------------------


def test_signing_key_is_random_private_and_checked_on_every_use(tmp_path, monkeypatch):
    """The key signs what DeepSpeed unpickles: an empty or short one, or one others can read, is never used."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    key_file = tmp_path / "checkpoint-signing.key"
    key = checkpoint._signing_key()
    assert len(key) == 32 and key_file.stat().st_mode & 0o777 == 0o600 and checkpoint._signing_key() == key
    key_file.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        checkpoint.sign_shards(tmp_path)
    key_file.chmod(0o600)
    for weak in (b"", b"short"):
        key_file.write_bytes(weak)
        with pytest.raises(ValueError, match="fewer than 32"):
            checkpoint.sign_shards(tmp_path)
        assert "fewer than 32" in checkpoint.shard_problem(tmp_path, {"shards": {"files": {}, "hmac": ""}})
    # A DeepSpeed run with the empty key: refused before anything trains or is written.
    proc = subprocess.run([sys.executable, "-m", "train", "experiment=smoke", "trainer=zero2", "trainer.device=cpu",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECDRAFT_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and "fewer than 32" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("override", ["+trainer.lrr=1", "+lr=1", "+target.toy.lrr=1"])
def test_plus_overrides_outside_the_schema_are_refused(override):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=smoke", override])
    with pytest.raises(ValueError, match=rf"unknown key {override[1:].split('=')[0]}"):
        load_config(cfg)


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_no_partial(cache, tmp_path, monkeypatch):
    from distill.environment import one_line_errors

    save = torch.save

    def full(obj, path, *args, **kwargs):
        if "step_0000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(SystemExit) as err:
        one_line_errors(run_training)(compose_cfg(cache), tmp_path)
    message = str(err.value.code)
    assert "\n" not in message and "no space left writing" in message and "step_0000004" in message
    assert not list((tmp_path / "checkpoints").glob(".*partial"))
    (tmp_path / "checkpoints" / ".step_0000004.partial").mkdir()  # as a kill mid-save leaves it
    monkeypatch.setattr(checkpoint.torch, "save", save)  # space is back
    run_training(compose_cfg(cache), tmp_path)  # resumes from step 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_0000002", "step_0000004"]


def test_environment_mistakes_are_one_line_naming_the_path_and_the_fix(tmp_path, tiny_toy_target, tiny_teacher):
    from distill.environment import check_run_dir_override
    from distill.teacher import TargetConfig, load_teacher
    from distill.toy.build import load_or_build_toy_target, toy_cache_path
    from distill.toy.config import toy_config

    from distill.environment import one_line_errors

    def interrupted():
        raise KeyboardInterrupt  # Ctrl-C while the target loads, or during evaluation

    with pytest.raises(SystemExit) as err:
        one_line_errors(interrupted)()
    assert err.value.code == 130
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for value in (a_file, a_file / "run"):
        with pytest.raises(SystemExit, match=f"hydra.run.dir={value}: {a_file} is a file"):
            check_run_dir_override(["experiment=smoke", f"hydra.run.dir={value}"])
    from distill.regenerate import write_regenerated
    from train.config import RegenerateConfig
    from distill.data import DataConfig

    with pytest.raises(IsADirectoryError, match="regenerate.out=.* is a directory; .*regenerated.jsonl"):
        write_regenerated(tmp_path, tiny_teacher, [], DataConfig(), asdict(RegenerateConfig(out=str(tmp_path))))
    with pytest.raises(FileNotFoundError, match="target.name=nobody/no-such-model .*local directory"):
        load_teacher(TargetConfig(source="hf", name="nobody/no-such-model"))
    from omegaconf import OmegaConf

    toy = toy_config(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "target" / "tiny.yaml"))["toy"])
    built = toy_cache_path(toy)  # the session's entry, under the setting it was built with (distill.precision)
    damaged = tmp_path / "toy" / built.name
    shutil.copytree(built, damaged)
    (damaged / "model.safetensors").write_bytes((damaged / "model.safetensors").read_bytes()[:100])
    with pytest.raises(OSError, match="is damaged .*delete that directory and rerun"):
        load_or_build_toy_target(toy, cache_dir=tmp_path / "toy")


def test_sbatch_passes_the_time_limit_signal_on_and_requeues_itself(tmp_path):
    """``scripts/slurm/train.sbatch`` with stand-ins for ``srun`` (a job step that checkpoints and exits 138 on
    SIGUSR1, as the ranks do) and ``scontrol`` (which records its arguments): Slurm's SIGUSR1 ahead of the time limit
    reaches the step, and the job requeues itself once the step has exited."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\ntrap 'echo checkpointed > \"$MARK\"; exit 138' USR1\n"
                                  "echo started > \"$MARK\"\nfor _ in $(seq 600); do sleep 0.05; done\n")  # <= 30 s
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\n[ \"$1\" = show ] && echo node0 && exit 0\n"
                                      "echo \"$@\" >> \"$CALLS\"\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    mark, calls = tmp_path / "step", tmp_path / "scontrol.calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node0", "MARK": str(mark), "CALLS": str(calls)}
    job = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), "experiment=smoke"], cwd=tmp_path,
                           env=env, stderr=subprocess.PIPE, text=True)
    while not mark.is_file():
        assert job.poll() is None, job.stderr.read()
        time.sleep(0.02)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends the batch script
    _, err = job.communicate(timeout=30)
    assert mark.read_text().strip() == "checkpointed"
    assert job.returncode == 138, err
    assert calls.read_text().split() == ["requeue", "4242"]


def test_every_test_the_reliability_table_names_exists():
    """docs/reliability.md names a test per row; a renamed or deleted test must not leave the table pointing at
    nothing."""
    import re

    table = [line for line in (ROOT / "docs" / "reliability.md").read_text().splitlines() if line.startswith("| ")]
    named = 0
    for row in table[2:]:
        test_file = None
        for file, name in re.findall(r"`(test_\w+\.py)?::(test_\w+)`", row.rsplit("|", 2)[-2]):
            test_file = file or test_file
            source = (ROOT / "tests" / test_file).read_text()
            assert re.search(rf"^def {name}\(", source, re.M), f"{test_file}::{name} (row: {row[:60]})"
            named += 1
        assert test_file, f"a row without its test: {row[:80]}"
    assert named >= len(table) - 2
