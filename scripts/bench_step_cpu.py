"""CPU seconds per training step, two or more checkouts side by side: the fairest speed comparison a shared 2-core
machine allows.

    python scripts/bench_step_cpu.py --base ../base --kinds eagle1 --seq 1024 --steps 9 --rounds 2

Each round starts one ``python -m train`` per checkout (``--base`` checkouts, then this one) at the same time, each
at 1 thread on the random-weight Llama-3-vocabulary target of ``scripts/bench_memory.py``, so every run sees the same
load for its whole length. A launcher around ``python -m train`` records ``time.process_time()`` after each
optimizer step (``SingleEngine.step``); a step's CPU seconds are the differences, step 1 onwards (step 0 pays for
start-up). Per run the median step is kept; per round, each checkout's median over this checkout's. CPU time, not
wall: at 1 thread it barely moves with the other runs' load, while wall time moves 2-3x. Results go to
``scripts/results/bench_step_cpu.json`` (merged by kind and length) with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_memory import CORPUS_BYTES, KINDS, ROOT, build_target  # noqa: E402
from train.checkpoint import fresh_scratch_run  # noqa: E402

# Runs ``python -m train`` with sys.argv as given and, at exit, writes the CPU seconds of each step as JSON to
# $BENCH_STEP_OUT: the same measurement for any checkout.
STEP_LAUNCHER = """
import atexit, json, os, runpy, sys, time
import train.engine as engine
marks = []
step = engine.SingleEngine.step
def timed(self, *args, **kwargs):
    out = step(self, *args, **kwargs)
    marks.append(time.process_time())
    return out
engine.SingleEngine.step = timed
def report():
    with open(os.environ["BENCH_STEP_OUT"], "w") as f:
        json.dump([b - a for a, b in zip(marks, marks[1:])], f)
atexit.register(report)
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def start(code: Path, target: Path, kind: str, seq: int, steps: int, work: Path, extra: list[str]):
    name = f"{code.name}-{kind}-{seq}"
    run_dir, out = work / name, work / f"{name}.steps.json"
    fresh_scratch_run(run_dir)  # a run cut short is not in results; trainer.resume=never needs it empty
    out.unlink(missing_ok=True)
    overrides = ["target=tiny", "target.source=hf", f"target.name={target}", *KINDS[kind], f"data.max_length={seq}",
                 f"data.corpus_max_bytes={CORPUS_BYTES}", "trainer.micro_batch_size=1", "trainer.grad_accum=1",
                 f"trainer.steps={steps}", "trainer.warmup_steps=1", "trainer.log_every=1",
                 "trainer.ckpt_every=1000000", "trainer.resume=never", "trainer.device=cpu", "trainer.num_threads=1",
                 "eval.enabled=false", f"hydra.run.dir={run_dir}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code), "BENCH_STEP_OUT": str(out)}
    log = (work / f"{name}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", STEP_LAUNCHER, *overrides], cwd=code, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", type=Path, nargs="+", required=True, help="checkouts to compare with this one")
    parser.add_argument("--kinds", nargs="+", default=["eagle1"], choices=list(KINDS))
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp") / "bench_step_cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "scripts" / "results" / "bench_step_cpu.json")
    parser.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))
    target = build_target(cache)
    codes = [b.resolve() for b in args.base] + [ROOT]
    if len({c.name for c in codes}) != len(codes):
        parser.error(f"checkouts need distinct directory names (run dirs are named after them): {codes}")
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    data["machine"] = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "threads_per_run": 1}
    for kind in args.kinds:
        rounds = []
        for _ in range(args.rounds):
            runs = [start(code, target, kind, args.seq, args.steps, args.work, args.extra) for code in codes]
            medians = {}
            for code, (proc, out) in zip(codes, runs):
                if proc.wait() != 0 or not out.is_file():
                    raise SystemExit(f"{code}: python -m train failed (exit {proc.returncode}); see {args.work}")
                steps = json.loads(out.read_text())
                medians[str(code)] = {"median_step_cpu_s": statistics.median(steps), "steps_cpu_s": steps}
            mine = medians[str(ROOT)]["median_step_cpu_s"]
            for code in codes[:-1]:
                medians[str(code)]["this_over_it_tokens_per_cpu_s"] = medians[str(code)]["median_step_cpu_s"] / mine
            rounds.append(medians)
            print(kind, args.seq, {Path(c).name: (round(m["median_step_cpu_s"], 3), round(m.get(
                "this_over_it_tokens_per_cpu_s", 1.0), 3)) for c, m in medians.items()}, flush=True)
        data.setdefault(kind, {})[str(args.seq)] = {"steps": args.steps, "checkouts": [str(c) for c in codes],
                                                    "rounds": rounds}
        args.out.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
