"""The offline teacher cache's compressed form: bytes per token and τ of the same drafter trained offline from a
bfloat16 cache and from an fp8 one (e4m3 with a float32 scale per token).

    python scripts/bench_cache_dtype.py                   # the tiny toy target, EAGLE-3 (a few minutes on 2 cores)
    python scripts/bench_cache_dtype.py --preset toy      # the 4M toy target (built first if missing: ~1 hour)

Per ``cache.dtype``: ``python -m distill.cache`` writes the configured drafter's layers, then ``python -m train
data.teacher_cache=<it>`` trains the drafter from it once per ``--seeds`` seed (the same seeds, data order and
steps for both caches) and evaluates it (greedy, held-out prompts: ``report.json``). Within a seed only the stored
hidden states differ; across seeds, the spread of τ shows the noise a dtype's difference must beat.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.report import machine_info  # noqa: E402

DTYPES = ("bfloat16", "fp8")
PRESETS = {
    "tiny": ["experiment=smoke", "trainer.steps=200", "eval.num_prompts=16", "eval.max_new_tokens=48"],
    "toy": ["trainer.steps=100", "trainer.micro_batch_size=4", "data.corpus_max_bytes=400000", "eval.num_prompts=16",
            "eval.max_new_tokens=64"],
}
DRAFTER = ["drafter=eagle3"]
EVAL = ["eval.hf_baselines=false", "eval.plots=false", "eval.baselines=[]", "trainer.select=last",
        "trainer.eval_every=0"]


def run(cmd: list[str], log_path: Path) -> float:
    """Run ``cmd`` with its output in ``log_path``; its wall seconds. A failure shows the log's tail."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); log {log_path}:\n" + "\n".join(tail))
    return time.perf_counter() - start


def build_cache(dtype: str, common: list[str], work: Path) -> Path:
    cache = work / f"cache-{dtype}"
    if cache.exists():
        raise SystemExit(f"{cache} exists from an earlier run; delete {work} or pass another --work")
    run([sys.executable, "-m", "distill.cache", *common, f"cache.dtype={dtype}", f"cache.dir={cache}",
         f"hydra.run.dir={work / f'hydra-cache-{dtype}'}"], work / f"cache-{dtype}.log")
    return cache


def train_from(cache: Path, seed: int, common: list[str], work: Path) -> dict:
    run_dir = work / f"run-{cache.name}-seed{seed}"
    train_s = run([sys.executable, "-m", "train", *common, *EVAL, f"seed={seed}", f"data.teacher_cache={cache}",
                   f"hydra.run.dir={run_dir}"], work / f"train-{cache.name}-seed{seed}.log")
    report = json.loads((run_dir / "report.json").read_text())
    row = next(r for r in report["results"] if r["drafter"] != "lookup")
    final = json.loads((run_dir / "drafter" / "config.json").read_text())["training"]["final"]
    return {"seed": seed, "tau": row["tau"], "alpha": row.get("alpha"), "train_loss": final.get("train/loss"),
            "train_wall_s": train_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--work", default="runs/bench_cache_dtype", help="caches, run dirs and logs")
    parser.add_argument("--out", default=None, help="JSON path (default scripts/results/bench_cache_dtype_<preset>_cpu.json)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="a training run per seed and cache")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every cache and run")
    args = parser.parse_args(argv)
    work = (ROOT / args.work / args.preset).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or ROOT / "scripts" / "results" / f"bench_cache_dtype_{args.preset}_cpu.json")
    common = [*PRESETS[args.preset], *DRAFTER, *args.overrides]
    results = {}
    for dtype in DTYPES:
        cache = build_cache(dtype, common, work)
        manifest = json.loads((cache / "manifest.json").read_text())
        runs = [train_from(cache, seed, common, work) for seed in args.seeds]
        results[dtype] = {"bytes_per_token": manifest["bytes_per_token"],
                          "cache_bytes": sum(p.stat().st_size for p in cache.glob("shard-*.safetensors")),
                          "mean_tau": sum(r["tau"] for r in runs) / len(runs), "runs": runs}
        taus = ", ".join(f"{r['tau']:.3f}" for r in runs)
        print(f"cache.dtype={dtype}: {manifest['bytes_per_token']} bytes/token, tau {taus}", flush=True)
    command = " ".join(["python scripts/bench_cache_dtype.py", *(["--preset", args.preset] if args.preset != "tiny"
                                                                  else []), *args.overrides])
    settings = {"preset": args.preset, "common": common, "eval": EVAL, "seeds": args.seeds}
    out.write_text(json.dumps({"machine": machine_info(), "command": command,
                               "settings": settings,
                               "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
