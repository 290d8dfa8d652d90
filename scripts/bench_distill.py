"""Distillation benchmark: τ of drafters trained with equal budgets under different losses, data modes and kinds.

    python scripts/bench_distill.py                                   # the toy table: every run below, 800 steps each
    python scripts/bench_distill.py --runs fkl rkl --steps 200        # a subset, shorter
    python scripts/bench_distill.py --preset tiny                     # seconds: checks the script end to end

Every run is ``python -m train`` (same steps, batch, data and eval prompts; only the named overrides differ), then
``python -m eval`` of the saved drafter at each extra temperature, in subprocesses one after another (one run at a
time, so timings are comparable). A run needing regenerated data first runs ``python -m distill.regenerate`` once
(its time is reported separately; the jsonl is reused). Results are written after every run, and a rerun skips the
runs already in ``--out``, so an interrupted benchmark resumes.

Output JSON: machine, settings, and per run: overrides, training seconds, final training metrics, and per
temperature τ, α, α per position, speedup, identical_to_greedy (greedy only), plus Medusa-2's held-out losses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from eval.report import machine_info
from train.checkpoint import fresh_scratch_run

ROOT = Path(__file__).resolve().parents[1]

DRAFT = ["drafter=draft_model"]
RUNS = {  # name -> overrides; {regenerated} is filled with the regenerated jsonl
    "fkl": [*DRAFT, "loss=fkl"],
    "rkl": [*DRAFT, "loss=rkl"],
    "jsd": [*DRAFT, "loss=jsd"],
    "tvd": [*DRAFT, "loss=tvd"],
    "regenerated": [*DRAFT, "loss=fkl", "data.mode=regenerated", "data.regenerated={regenerated}"],
    "on_policy": [*DRAFT, "loss=fkl", "data.mode=on_policy"],
    "mixed": [*DRAFT, "loss=fkl", "data.mode=mixed", "data.on_policy_fraction=0.5"],
    "medusa": ["drafter=medusa", "decoder.tree=chain"],
    "medusa2": ["drafter=medusa2", "decoder.tree=chain"],
    "medusa2_lora_lr1": ["drafter=medusa2", "decoder.tree=chain", "drafter.lora_lr_scale=1.0"],
}
PRESETS = {
    "toy": {"common": ["eval.num_prompts=20", "eval.max_new_tokens=96"], "steps": 800, "regen_prompts": 2048},
    "tiny": {"common": ["experiment=smoke", "eval.num_prompts=2"], "steps": 8, "regen_prompts": 16},
}
EVAL = ["eval.hf_baselines=false", "eval.plots=false", "eval.baselines=[]", "eval.num_draft=4"]


def run(cmd: list[str], log_path: Path) -> float:
    """Run ``cmd`` with its output in ``log_path``; its wall seconds. A failure shows the log's tail."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); log {log_path}:\n" + "\n".join(tail))
    return time.perf_counter() - start


def result_of(report_path: Path, name: str) -> dict:
    report = json.loads(report_path.read_text())
    row = next(r for r in report["results"] if r["drafter"] not in ("lookup",))
    keep = ("tau", "alpha", "alpha_per_position", "speedup", "identical_to_greedy", "tokens_per_s", "sim_tau",
            "target", "heldout")
    return {k: row[k] for k in keep if k in row} | {"plain_tokens_per_s": report["greedy"]["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="toy")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (equal for all)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--work", default="runs/bench_distill", help="run dirs, logs and the regenerated jsonl")
    parser.add_argument("--out", default=None, help="JSON path (default scripts/results/bench_distill_<preset>_cpu.json)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. trainer.micro_batch_size=4")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    steps = args.steps or preset["steps"]
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or ROOT / "scripts" / "results" / f"bench_distill_{args.preset}_cpu.json")
    common = [*preset["common"], f"trainer.steps={steps}", *args.overrides]
    results = json.loads(out.read_text()) if out.exists() else {}
    if results.get("settings", {}).get("common") not in (None, common):
        raise SystemExit(f"{out} was written with other settings ({results['settings']['common']}); pass --out")
    results.update(machine=machine_info(), settings={"common": common, "eval": EVAL, "steps": steps,
                                                     "temperatures": args.temperatures})
    results.setdefault("runs", {})
    py = [sys.executable]

    regenerated = work / "regenerated.jsonl"
    if any("{regenerated}" in " ".join(RUNS[name]) for name in args.runs) and "regenerate" not in results:
        seconds = run([*py, "-m", "distill.regenerate", f"regenerate.out={regenerated}", "regenerate.temperature=1.0",
                       f"regenerate.num_prompts={preset['regen_prompts']}", *preset["common"], *args.overrides,
                       f"hydra.run.dir={work / 'regenerate'}"], work / "regenerate.log")
        results["regenerate"] = {"seconds": seconds, "prompts": preset["regen_prompts"], "temperature": 1.0}
        out.write_text(json.dumps(results, indent=2))

    for name in args.runs:
        if name in results["runs"]:
            print(f"{name}: done already (in {out})")
            continue
        overrides = [o.format(regenerated=regenerated) for o in RUNS[name]]
        run_dir = work / name
        fresh_scratch_run(run_dir)  # a run cut short is not in results; trainer.resume=never needs it empty
        train_s = run([*py, "-m", "train", *overrides, *common, *EVAL, f"hydra.run.dir={run_dir}",
                       "trainer.resume=never"], work / f"{name}.log")
        saved = json.loads((run_dir / "drafter" / "config.json").read_text())
        entry = {"overrides": overrides, "wall_seconds": train_s,
                 "final": saved.get("training", {}).get("final", {}), "by_temperature": {}}
        for temp in args.temperatures:
            if temp == 0.0:
                report = run_dir / "report.json"
            else:
                eval_dir = run_dir / f"eval_T{temp:g}"
                run([*py, "-m", "eval", f"drafter_path={run_dir / 'drafter'}", f"decoder.temperature={temp}",
                     *common, *EVAL, f"hydra.run.dir={eval_dir}"], work / f"{name}_T{temp:g}.log")
                report = eval_dir / "report.json"
            entry["by_temperature"][f"{temp:g}"] = result_of(report, name)
        results["runs"][name] = entry
        out.write_text(json.dumps(results, indent=2))
        taus = ", ".join(f"T={t}: tau {r['tau']:.2f}" for t, r in entry["by_temperature"].items())
        print(f"{name}: trained in {entry['final'].get('train/elapsed_s', 0):.0f} s; {taus}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
