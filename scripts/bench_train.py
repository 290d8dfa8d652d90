"""Training throughput: data-parallel scaling (1 vs N processes) and the cost of online distillation over the target
forward alone.

    python scripts/bench_train.py                      # toy target, CPU: 1 vs 2 processes, 1 thread each
    python scripts/bench_train.py --device cuda        # one GPU: online distillation vs target forward only
    python scripts/bench_train.py --preset tiny        # seconds: checks the script end to end

Runs, one at a time in subprocesses (so each owns the machine):
- ``single``: ``python -m train trainer=single`` on one process.
- ``ddp``: ``torchrun --nproc_per_node N -m train trainer=ddp``, the same micro-batch per rank (weak scaling: N
  times the rows per step). Scaling = its tokens/s / single's (goal >= 1.8 for 2 processes on a quiet machine).
- ``target_only``: the same rows through the frozen target alone (``Teacher.signals`` with the drafter's layers,
  no drafter), one process. Online-distillation ratio = single's tokens/s / this (goal >= 0.7).
tokens/s is the median of the training loop's ``perf/tokens_per_s`` windows after the first (start-up), i.e. real
tokens of all ranks per wall second. The machine's load average before and after each run is recorded beside it.

Output JSON (``--out``): machine, settings, per run tokens/s windows and median, loads, and the two ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eval.report import machine_info
from train.checkpoint import fresh_scratch_run

ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "toy": {"common": [], "steps": 120, "log_every": 20},
    "tiny": {"common": ["experiment=smoke"], "steps": 12, "log_every": 4},
}


def train_cmd(nproc: int, overrides: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "train", "trainer=single", *overrides]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m", "train",
            "trainer=ddp", *overrides]


def run(cmd: list[str], log_path: Path, env: dict) -> dict:
    """Run ``cmd``; its wall seconds and the 1-minute load average just before and after."""
    before = os.getloadavg()[0]
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); log {log_path}:\n" + "\n".join(tail))
    return {"wall_s": time.perf_counter() - start, "load_before": before, "load_after": os.getloadavg()[0]}


def windows(metrics: Path) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [r["perf/tokens_per_s"] for r in rows[1:]]  # the first window holds start-up
    return {"tokens_per_s_windows": rates, "tokens_per_s": statistics.median(rates),
            "teacher_s": statistics.median(r["perf/teacher_s"] for r in rows[1:]),
            "drafter_s": statistics.median(r["perf/drafter_s"] for r in rows[1:]),
            "peak_mem_gb": max(r["perf/peak_mem_gb"] for r in rows)}


def target_only(overrides: list[str], steps: int, log_every: int, out: Path) -> None:
    """Worker: the training rows of ``overrides`` through the frozen target alone, timed like the loop's windows."""
    import torch
    from hydra import compose, initialize_config_dir

    from distill.data import collate
    from distill.teacher import load_teacher
    from heads.base import build_drafter
    from train.config import load_config, register_configs
    from train.engine import resolve_device
    from train.loop import BatchOrder
    from train.run import training_data

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    torch.set_num_threads(cfg.trainer.num_threads or torch.get_num_threads())
    device = resolve_device(cfg.trainer.device)
    teacher = load_teacher(cfg.target, device=device)
    drafter = build_drafter(cfg.drafter, teacher)
    drafter.bind_target(teacher, initialize=True)
    dataset, signals, _ = training_data(cfg, teacher, drafter)
    order = BatchOrder(len(dataset), cfg.trainer.micro_batch_size, cfg.seed)
    layers = tuple(drafter.teacher_layers)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.trainer.bf16 else torch.autocast(device.type, enabled=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates, tokens, start = [], 0, time.perf_counter()
    for step in range(steps):
        batch = {k: v.to(device) for k, v in collate([dataset[i] for i in order.indices(step)]).items()}
        with autocast:
            signals.signals(batch, layers)
        tokens += int(batch["attention_mask"].sum())
        if (step + 1) % log_every == 0:
            sync()
            rates.append(tokens / (time.perf_counter() - start))
            tokens, start = 0, time.perf_counter()
    out.write_text(json.dumps({"tokens_per_s_windows": rates[1:], "tokens_per_s": statistics.median(rates[1:])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="toy")
    parser.add_argument("--device", default="cpu", help="cpu (scaling + ratio) or cuda (one GPU: the ratio only)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per process (1: the cores are the ranks)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_train")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run, e.g. drafter=eagle3")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    out = args.out or ROOT / "scripts" / "results" / f"bench_train_{args.preset}_{args.device}.json"
    common = [*preset["common"], f"trainer.steps={preset['steps']}", f"trainer.log_every={preset['log_every']}",
              f"trainer.device={args.device}", f"trainer.num_threads={args.threads}", "trainer.resume=never",
              "trainer.ckpt_every=1000000", "eval.enabled=false", *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine_info(), "settings": {"preset": args.preset, "common": common,
                                                             "nproc": args.nproc, "threads_per_process": args.threads}}
    plan = [("single", 1)] + ([("ddp", args.nproc)] if args.device == "cpu" and args.nproc > 1 else [])
    for name, nproc in plan:
        run_dir = args.work / name
        fresh_scratch_run(run_dir)  # a run cut short is not in results; trainer.resume=never needs it empty
        timing = run(train_cmd(nproc, [*common, f"hydra.run.dir={run_dir}"]), args.work / f"{name}.log", env)
        results[name] = {"processes": nproc, **timing, **windows(run_dir / "metrics.jsonl")}
        print(f"{name}: {results[name]['tokens_per_s']:.0f} tokens/s ({nproc} process(es); load "
              f"{timing['load_before']:.2f} -> {timing['load_after']:.2f})", flush=True)
    only = args.work / "target_only.json"
    timing = run([sys.executable, __file__, "--target-only-worker", str(only), str(preset["steps"]),
                  str(preset["log_every"]), *common], args.work / "target_only.log", env)
    results["target_only"] = {**timing, **json.loads(only.read_text())}
    print(f"target forward only: {results['target_only']['tokens_per_s']:.0f} tokens/s", flush=True)
    single = results["single"]["tokens_per_s"]
    results["online_vs_target_only"] = single / results["target_only"]["tokens_per_s"]
    if "ddp" in results:
        results["scaling"] = results["ddp"]["tokens_per_s"] / single
        print(f"scaling {args.nproc} vs 1 process: {results['scaling']:.2f}x (goal >= {0.9 * args.nproc:.1f})")
    print(f"online distillation / target forward only: {results['online_vs_target_only']:.2f} (goal >= 0.7)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--target-only-worker":
        target_only(sys.argv[5:], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[2]))
    else:
        main()
