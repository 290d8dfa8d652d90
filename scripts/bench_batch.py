"""Batch-size benchmark: when does a drafter stop paying? Plain vs speculative vs the load-aware policy, per batch size.

    python scripts/bench_batch.py --preset toy          # CPU: the toy target (cached), batch sizes 1..32
    python scripts/bench_batch.py --preset tiny         # seconds: checks the script end to end (numbers meaningless)
    python scripts/bench_batch.py --preset toy decoder.batch_sizes=[1,4,16] eval.max_new_tokens=32

What it does, in one process so every ratio is measured side by side (``eval.batch_sweep``):
1. builds (or loads from cache) the target and a small draft LM pretrained on this interpreter's stdlib source,
2. calibrates the load-aware policy per drafter (``inference.policy.calibrate``: short decodes at every batch size
   and γ give t_verify(B, n), t_draft(B, γ) (one step's proposals for B rows: EAGLE and Medusa draft every row in one
   call) and τ(γ)),
3. for each batch size decodes the same held-out prompts in batches: plain, always-on (γ = eval.num_draft) and
   policy=auto, for the draft model (chain) and prompt lookup (``--drafter-path`` adds a trained drafter),
4. writes JSON: machine, settings, per batch size tokens/s, latency, τ, speedup, auto / best; the crossover batch
   size; the cost tables and the policy's γ per batch size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from heads.draft_model.config import toy_draft_node
from train.config import load_config, register_configs, to_container

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench_batch")

# Vocabulary, context and corpus settings are shared by target and draft so their tokenizers are identical.
PRESETS = {
    "tiny": {
        "target": "tiny",
        "draft_toy": {"hidden_size": 32, "intermediate_size": 88, "num_layers": 1, "num_heads": 2, "steps": 60,
                      "warmup_steps": 10},
        "overrides": ["data.max_length=128", "eval.num_prompts=4", "eval.prompt_tokens=32", "eval.max_new_tokens=12",
                      "eval.num_draft=3", "decoder.batch_sizes=[1,2,4]"],
        "repeats": 1,
    },
    "toy": {
        "target": "toy",
        "draft_toy": {},  # conf/drafter/draft_model.yaml as is
        "overrides": ["eval.num_prompts=32", "eval.prompt_tokens=64", "eval.max_new_tokens=48",
                      "decoder.batch_sizes=[1,2,4,8,16,32]"],
        "repeats": 2,
    },
}


def load_cfg(preset: dict, extra: list[str]):
    register_configs()
    overrides = [f"target={preset['target']}", "drafter=lookup", "decoder.policy=auto", *preset["overrides"], *extra]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
        draft = compose(config_name="config", overrides=["drafter=draft_model"]).drafter
    draft = toy_draft_node(to_container(draft), cfg.target.toy, **preset["draft_toy"])
    return load_config(cfg), draft


def build_drafters(teacher, draft_cfg: dict, drafter_path: str | None) -> dict:
    from heads.base import build_drafter
    from heads.saved import load_drafter

    draft = build_drafter(draft_cfg, teacher)
    draft.bind_target(teacher, initialize=False)
    lookup = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    drafters = {"draft_model": draft.to(teacher.device), "lookup": lookup}
    if drafter_path:
        trained = load_drafter(drafter_path, teacher)
        drafters[trained.name] = trained
    return drafters


def summarize(sweep: dict) -> list[str]:
    lines = []
    for name, entry in sweep["drafters"].items():
        worst = entry.get("policy_min_vs_best", float("nan"))
        lines.append(f"== {name}: {entry['crossover_note']}; auto >= {worst:.2f} of best")
        header = ("B", 3), ("plain", 8), ("spec", 8), ("speedup", 8), ("tau", 5), ("auto", 8), ("γ", 5), ("auto/best", 9)
        lines.append("  " + " ".join(f"{h:>{w}}" for h, w in header))
        for r in sweep["rows"]:
            on, auto = r["drafters"][name]["always"], r["drafters"][name].get("auto", {})
            lines.append(f"  {r['batch_size']:>3} {r['plain']['tokens_per_s']:>8.1f} {on['tokens_per_s']:>8.1f} "
                         f"{on['speedup']:>7.2f}x {on['tau']:>5.2f} {auto.get('tokens_per_s', 0):>8.1f} "
                         f"{auto.get('mean_gamma', 0):>5.2f} {auto.get('vs_best', 0):>9.2f}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="toy")
    ap.add_argument("--out", default="bench_batch.json")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="calibration rounds per batch size and γ")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts per batch size; each method "
                    "reports its median round (3: a load burst on a shared machine moves one round, not the row)")
    ap.add_argument("--min-batches", type=int, default=2, help="batches timed per round at every batch size (the "
                    "prompt pool is decoded again until it has as many): a longer window for the large batch sizes")
    ap.add_argument("--drafter-path", default=None, help="also sweep this trained drafter (<run dir>/drafter)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. decoder.batch_sizes=[1,4,16]")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    cfg, draft_cfg = load_cfg(preset, args.overrides)

    from distill.teacher import load_teacher
    from eval.batch_sweep import batch_sweep
    from eval.report import machine_info
    from eval.run import eval_prompts
    from train.engine import resolve_device

    device = resolve_device(cfg.trainer.device)
    t0 = time.perf_counter()
    teacher = load_teacher(cfg.target, device=device)
    drafters = build_drafters(teacher, draft_cfg, args.drafter_path)
    setup_s = time.perf_counter() - t0
    prompts, _ = eval_prompts(cfg.eval, teacher.tokenizer)
    t0 = time.perf_counter()
    repeats = args.repeats or preset["repeats"]
    sweep = batch_sweep(teacher, drafters, prompts, cfg.eval, cfg.decoder, repeats=repeats, rounds=args.rounds,
                        min_batches=args.min_batches)
    out = {
        "preset": args.preset,
        "target": teacher.identity(),
        "target_params": sum(p.numel() for p in teacher.model.parameters()),
        "draft_params": sum(p.numel() for p in drafters["draft_model"].parameters()),
        "dtype": cfg.target.dtype,
        "prompt_tokens": cfg.eval.prompt_tokens,
        "setup_seconds": setup_s,
        "sweep_seconds": time.perf_counter() - t0,
        "batch_sweep": sweep,
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str))
    os.replace(tmp, path)
    print("\n".join(summarize(sweep)))
    print(f"wrote {path} ({out['sweep_seconds']:.0f}s)")


if __name__ == "__main__":
    main()
