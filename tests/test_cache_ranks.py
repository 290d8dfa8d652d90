"""Feature capture across ranks (``torchrun -m distill.cache``): 2 ranks on gloo write the files 1 process writes, a
rank killed with SIGKILL mid-run is resumed by a rerun to the same files, and a disk too small is refused up front."""

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from distill.cache import MANIFEST, write_cache
from tests import torchrun
from tests.test_cache import DATA_CFG, make_rows


def command(cache_dir: Path, ranks: int, rows_bytes: int = 30000) -> list[str]:
    return torchrun.command("distill.cache", [
        "target=tiny", "data.max_length=64", f"data.corpus_max_bytes={rows_bytes}", "cache.shard_rows=4",
        "cache.topk=8", "cache.batch_size=2", "trainer.device=cpu", f"cache.dir={cache_dir}",
        f"hydra.run.dir={cache_dir.parent / 'hydra'}"], ranks)


def files(cache_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache_dir.iterdir()) if not p.name.startswith(".")}


# Slow: the ranks' shard, kill and resume machinery is the regeneration's too, checked fast by
# test_regenerate_ranks.py::test_a_rank_killed_mid_run_resumes_to_the_same_bytes.
@pytest.mark.slow
def test_two_ranks_write_the_files_one_process_writes_and_survive_a_kill(tmp_path, tiny_toy_target):
    one, two = tmp_path / "one" / "cache", tmp_path / "two" / "cache"
    assert "bytes/token" in torchrun.run(command(one, 1)).stdout
    reference = files(one)
    assert len([n for n in reference if n.startswith("shard-")]) >= 4
    torchrun.run(command(two, 2))
    assert files(two) == reference

    # Killed part way: rank 1 gets SIGKILL once a shard is on disk; a rerun finishes to the same files.
    shutil.rmtree(two)
    launcher = torchrun.start(command(two, 2))
    deadline, killed = time.monotonic() + 240, False
    while time.monotonic() < deadline and launcher.poll() is None and not killed:
        if two.is_dir() and any(two.glob("shard-*.safetensors")):
            pid = torchrun.rank_pid(launcher.pid, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
        time.sleep(0.02)
    launcher.communicate(timeout=300)
    assert killed and launcher.returncode != 0 and not (two / MANIFEST).exists()
    torchrun.run(command(two, 2))
    assert files(two) == reference


def test_a_disk_too_small_is_refused_naming_the_estimate_and_the_free_space(tiny_teacher, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(OSError, match=r"need about [0-9.]+ MiB, but only 0.00 MiB is free there"):
        write_cache(tmp_path / "cache", tiny_teacher, make_rows(), DATA_CFG, (-1,))
    assert not any((tmp_path / "cache").glob("shard-*"))
