"""Decoding benchmark: every drafter kind against plain decoding, HF generate() and HF assisted generation, one run.

    python scripts/bench_decode.py                      # CPU: the toy target (cached), writes bench_decode.json
    python scripts/bench_decode.py --preset gpu         # GPU: builds a ~85M-param stdlib target first (minutes)
    python scripts/bench_decode.py --preset tiny        # seconds: checks the script end to end (numbers meaningless)

What it does, all in one process so every ratio is measured side by side:
1. builds (or loads from cache) the target and a small draft LM pretrained on this interpreter's stdlib source,
2. trains Medusa heads briefly on the frozen target (``--medusa-steps``),
3. evaluates, on held-out stdlib prompts, Medusa as a top-1 chain and with a static tree, the draft model (chain),
   and prompt lookup, next to plain decoding, HF ``generate()`` and HF assisted generation with the same draft
   model and γ; then the draft model again with ``decoder.auto_tune`` (predicted vs measured speedup),
4. optionally repeats at temperature 1 (``--sample``),
5. writes JSON: machine, dtype, and per method τ, α, tokens/s, speedup, predicted speedup, overhead ratio; plus the
   full evaluation reports.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from heads.draft_model import toy_draft_node
from train.config import load_config, register_configs, to_container

ROOT = Path(__file__).resolve().parents[1]

log = logging.getLogger("bench_decode")

# Target / draft sizes per preset. Vocabulary, context and corpus settings are shared by target and draft so their
# BPE tokenizers are identical (DraftModel.bind_target checks it).
PRESETS = {
    "tiny": {
        "target": "tiny",
        "draft_toy": {"hidden_size": 32, "intermediate_size": 88, "num_layers": 1, "num_heads": 2, "steps": 60,
                      "warmup_steps": 10},
        "overrides": ["eval.num_prompts=4", "eval.prompt_tokens=48", "eval.max_new_tokens=32", "data.max_length=128",
                      "data.corpus_max_bytes=400000", "trainer.micro_batch_size=4"],
        "medusa_steps": 20,
    },
    "toy": {
        "target": "toy",
        "draft_toy": {},  # conf/drafter/draft_model.yaml as is
        "overrides": ["eval.num_prompts=20"],
        "medusa_steps": 600,
    },
    "gpu": {
        "target": "toy",
        "target_toy": {"hidden_size": 768, "intermediate_size": 2048, "num_layers": 12, "num_heads": 12,
                       "steps": 3000, "batch_size": 32, "lr": 1.5e-3, "warmup_steps": 200},
        "draft_toy": {"hidden_size": 256, "intermediate_size": 704, "num_layers": 2, "num_heads": 4,
                      "steps": 3000, "batch_size": 32},
        "overrides": ["eval.num_prompts=40", "target.dtype=bfloat16", "trainer.micro_batch_size=32"],
        "medusa_steps": 1500,
    },
}


def load_cfg(preset: dict, extra: list[str], medusa_steps: int):
    register_configs()
    overrides = [f"target={preset['target']}", "drafter=medusa", f"trainer.steps={medusa_steps}",
                 "trainer.ckpt_every=100000", "eval.enabled=false", *preset["overrides"], *extra]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
        draft = compose(config_name="config", overrides=["drafter=draft_model"]).drafter
    for key, value in preset.get("target_toy", {}).items():
        cfg.target.toy[key] = value
    draft = toy_draft_node(to_container(draft), cfg.target.toy, **preset["draft_toy"])
    return load_config(cfg), draft


def train_medusa(cfg, run_dir: Path, teacher):
    """Train into ``run_dir`` (or reuse the drafter a previous run left there: same target, same config)."""
    from heads.base import load_drafter
    from train.run import run_training

    t0 = time.perf_counter()
    if (run_dir / "drafter" / "config.json").is_file():
        log.info("medusa: reusing %s", run_dir / "drafter")
        return load_drafter(run_dir / "drafter", teacher), 0.0
    run_training(cfg, run_dir)
    log.info("medusa: %d steps in %.0fs", cfg.trainer.steps, time.perf_counter() - t0)
    return load_drafter(run_dir / "drafter", teacher), time.perf_counter() - t0


def summarize(report: dict) -> dict:
    rows = {}
    for r in report["results"]:
        cost = r.get("cost") or {}
        rows[r["label"]] = {
            "tau": r["tau"], "alpha": r["alpha"], "alpha_per_position": r["alpha_per_position"],
            "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"], "tree_size": r["tree_size"],
            "num_draft": r["num_draft"], "predicted_speedup": cost.get("predicted_speedup"),
            "overhead_ratio": cost.get("overhead_ratio"), "identical_to_greedy": r["identical_to_greedy"],
        }
    for name, b in report.get("baselines", {}).items():
        rows[name] = {k: b.get(k) for k in ("tokens_per_s", "speedup", "ours_over_hf", "identical_to_greedy")}
    rows["plain"] = {"tokens_per_s": report["greedy"]["tokens_per_s"]}
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="toy")
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--medusa-steps", type=int, default=None)
    ap.add_argument("--tree", default="default", help="Medusa tree preset or paths (inference.tree)")
    ap.add_argument("--sample", action="store_true", help="also evaluate at temperature 1")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--medusa-dir", default=None, help="train Medusa into this run dir, or reuse the drafter there")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. eval.num_prompts=10")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    cfg, draft_cfg = load_cfg(preset, args.overrides, args.medusa_steps or preset["medusa_steps"])

    from distill.teacher import load_teacher
    from eval.run import eval_prompts, evaluate
    from heads.base import build_drafter
    from train.engine import resolve_device

    device = resolve_device(cfg.trainer.device)
    t0 = time.perf_counter()
    teacher = load_teacher(cfg.target, device=device)
    target_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    draft = build_drafter(draft_cfg, teacher)
    draft.bind_target(teacher, initialize=False)
    draft = draft.to(device)
    draft_s = time.perf_counter() - t0
    if args.medusa_dir:
        medusa, medusa_s = train_medusa(cfg, Path(args.medusa_dir), teacher)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            medusa, medusa_s = train_medusa(cfg, Path(tmp) / "medusa", teacher)
    medusa.set_tree("chain")
    medusa_tree = copy.deepcopy(medusa)
    medusa_tree.set_tree(args.tree)
    lookup = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)

    prompts, categories = eval_prompts(cfg.eval, teacher.tokenizer)
    drafters = {"medusa-chain": medusa, f"medusa-tree[{args.tree}]": medusa_tree, "draft_model": draft, "lookup": lookup}
    dcfg = cfg.decoder
    out = {
        "preset": args.preset,
        "target": teacher.identity(),
        "target_params": sum(p.numel() for p in teacher.model.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "dtype": cfg.target.dtype,
        "setup_seconds": {"target": target_s, "draft_model": draft_s, "medusa_training": medusa_s},
        "runs": {},
    }
    report = evaluate(teacher, drafters, prompts, cfg.eval, dcfg, categories)
    out["runs"]["greedy"] = {"summary": summarize(report), "report": report}
    tuned = evaluate(teacher, {"draft_model[auto_tune]": draft, f"medusa-tree[{args.tree}][auto_tune]": copy.deepcopy(medusa_tree)},
                     prompts, dataclasses.replace(cfg.eval, hf_baselines=False), dcfg.__class__(**{**vars(dcfg), "auto_tune": True}))
    out["runs"]["greedy_auto_tune"] = {"summary": summarize(tuned), "report": tuned}
    if args.sample:
        sampled = evaluate(teacher, drafters, prompts, cfg.eval, dcfg.__class__(**{**vars(dcfg), "temperature": 1.0}), categories)
        out["runs"]["temperature_1"] = {"summary": summarize(sampled), "report": sampled}
    out["transfers_per_step"] = transfers_per_step(teacher, drafters, prompts[0], cfg.eval, dcfg)
    out["machine"] = report["machine"]
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2, default=str))
    os.replace(tmp, path)
    for run, body in out["runs"].items():
        print(f"== {run}")
        for name, row in body["summary"].items():
            print(f"  {name:<36}" + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in row.items() if k != "alpha_per_position"))
    print(f"wrote {path}")


def transfers_per_step(teacher, drafters: dict, prompt, eval_cfg, dcfg) -> dict:
    """Host<->device transfers and syncs per verification forward (``inference.transfers``), prefill included, on
    one prompt: the budget the decode loop keeps (issue 18: <= 4), which on a GPU is the pipeline stalls per step."""
    from eval.run import build_decoder
    from inference.transfers import TransferCounter

    decoder = build_decoder(teacher, dcfg)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    out = {}
    for name, drafter in drafters.items():
        with TransferCounter() as counter:
            gen = decoder.speculative(drafter, ids, eval_cfg.max_new_tokens, eval_cfg.num_draft)
        out[name] = counter.total / max(1, sum(gen.nodes_per_forward.values()))
    return out


if __name__ == "__main__":
    main()
