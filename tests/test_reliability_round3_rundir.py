"""A run dir another command touches: Hydra's flags never skip its early lock, and an evaluation into a trained run's
dir keeps the run's own config record."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_reliability_cluster import ROOT, cache, finished, holder, run_dir  # noqa: F401 (fixtures)
from tests.test_reliability_run import snapshot


@pytest.mark.parametrize("flags", [["-cn", "config"], ["--config-name", "config"], ["--config-name=config"],
                                   ["-cp", "../conf", "-cn", "config"], ["--config-dir", "{tmp}"], ["--run"]],
                         ids=lambda f: " ".join(f))
def test_hydra_flags_never_skip_the_run_dir_lock(tmp_path, holder, flags):
    from distill.environment import check_run_dir_override

    busy = tmp_path / "busy"
    held = holder(busy)
    argv = [f.format(tmp=tmp_path) for f in flags]
    with pytest.raises(SystemExit, match=rf"^error: hydra.run.dir={busy} is being written .*pid {held.pid}[^\n]*$"):
        check_run_dir_override([*argv, "seed=1", f"hydra.run.dir={busy}"])
    assert not busy.exists()


def test_flags_that_run_no_job_take_no_lock(tmp_path):
    from distill.environment import resolved_run_dir

    for flags in (["--cfg", "job"], ["--help"], ["--multirun"], ["--no-such-flag"]):
        assert resolved_run_dir([*flags, f"hydra.run.dir={tmp_path / 'run'}"]) is None, flags
    assert resolved_run_dir(["-cn", "config", f"hydra.run.dir={tmp_path / 'run'}"]) == tmp_path / "run"


def test_an_evaluation_records_its_config_beside_the_runs_own(tmp_path, monkeypatch):
    """In-process: the evaluation entry point asks Hydra to record its config in ``.hydra/eval/``; a refused one
    removes that record again and leaves the run's ``.hydra/`` as it was."""
    import distill.environment as environment
    from eval.__main__ import EVAL_CONFIG_RECORD

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("# the run's own training config\n")
    before = snapshot(run)
    monkeypatch.setattr(environment, "_startup", {})
    monkeypatch.setattr(sys, "argv", ["eval", "drafter=lookup", f"hydra.run.dir={run}"])
    environment.check_run_dir_override(output_subdir=EVAL_CONFIG_RECORD)
    assert f"hydra.output_subdir={EVAL_CONFIG_RECORD}" in sys.argv
    (run / EVAL_CONFIG_RECORD).mkdir()  # what Hydra then writes
    (run / EVAL_CONFIG_RECORD / "config.yaml").write_text("drafter: lookup\n")

    def refused():
        raise ValueError("python -m eval would write over another run's outputs")

    with pytest.raises(SystemExit):
        environment.one_line_errors(refused)()
    assert snapshot(run) == before and not (run / EVAL_CONFIG_RECORD).exists()


def test_python_m_eval_into_a_trained_run_keeps_its_training_config_record(run_dir, cache):
    """The command training prints, run for real: the run's ``.hydra/`` keeps its bytes; the evaluation's config is
    in ``.hydra/eval/``."""
    hydra = run_dir / ".hydra"
    hydra.mkdir()
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (hydra / name).write_text(f"# the run's own {name}\n")
    record = {name: (hydra / name).read_bytes() for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
    args = [f"drafter_path={run_dir / 'drafter'}", f"hydra.run.dir={run_dir}", f"target.cache_dir={cache}",
            "eval.num_prompts=1", "eval.max_new_tokens=8", "eval.baselines=[]", "eval.hf_baselines=false",
            "eval.plots=false", "trainer.device=cpu"]
    proc = subprocess.run([sys.executable, "-m", "eval", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {name: (hydra / name).read_bytes() for name in record} == record
    assert str(run_dir / "drafter") in (hydra / "eval" / "config.yaml").read_text()
