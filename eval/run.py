"""Evaluate drafters against plain greedy decoding of the same target: α, τ, speedup, identity, report.json.

Timings are taken side by side: for each prompt, plain greedy and every drafter run back to back, so a machine
that gets busier mid-run slows all of them alike and the speedup ratio stays honest.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from typing import Mapping, Sequence

import torch

from eval.metrics import AcceptStats
from inference.decoder import Decoder

log = logging.getLogger(__name__)


def eval_prompts(eval_cfg: Mapping, tokenizer) -> list[list[int]]:
    from distill.prompts import heldout_prompts, prompts_from_file

    if eval_cfg.get("prompts"):
        return prompts_from_file(eval_cfg["prompts"], tokenizer, eval_cfg["num_prompts"], "auto")
    return heldout_prompts(tokenizer, eval_cfg["num_prompts"], eval_cfg["prompt_tokens"])


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def proposal_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype drafters run in while proposing. Verification stays in the target's dtype, so the decoded output
    does not depend on this; only speed and acceptance do. bf16 halves the memory a draft step reads, which is
    what bounds it at batch 1 — but only where the hardware computes bf16 natively."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if torch.backends.mkldnn.is_available() and _cpu_has_bf16() else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"eval.drafter_dtype={name!r}; valid: auto, float32, bfloat16")
    return getattr(torch, name)


def _cpu_has_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # private op: absent from some builds
        return False


def evaluate(teacher, drafters: Mapping[str, object], prompts: Sequence[Sequence[int]], eval_cfg: Mapping) -> dict:
    """Decode every prompt greedily and with each drafter; return the report (a JSON-able dict)."""
    if not prompts:
        raise ValueError("no evaluation prompts; check eval.prompts / eval.num_prompts")
    decoder = Decoder(teacher, eos_token_id=teacher.tokenizer.eos_token_id)
    max_new, k = eval_cfg["max_new_tokens"], eval_cfg["num_draft"]
    dtype = proposal_dtype(eval_cfg.get("drafter_dtype", "auto"), teacher.device)
    drafters = {name: d.to(dtype) for name, d in drafters.items()}
    as_tensor = [torch.tensor([list(p)], dtype=torch.long) for p in prompts]
    for p in as_tensor[: eval_cfg.get("warmup_prompts", 1)]:  # first calls pay one-off allocation costs
        decoder.greedy(p, max_new)
        for drafter in drafters.values():
            decoder.speculative(drafter, p, max_new, k)

    greedy_s, greedy_tokens = 0.0, 0
    per = {name: {"seconds": 0.0, "tokens": 0, "stats": AcceptStats(), "identical": 0, "draft_s": 0.0,
                  "verify_s": 0.0, "first_mismatch": None} for name in drafters}
    for idx, p in enumerate(as_tensor):
        ref = decoder.greedy(p, max_new)
        greedy_s += ref.seconds
        greedy_tokens += len(ref.new_tokens)
        for name, drafter in drafters.items():
            gen = decoder.speculative(drafter, p, max_new, k)
            acc = per[name]
            acc["seconds"] += gen.seconds
            acc["tokens"] += len(gen.new_tokens)
            acc["stats"].merge(gen.stats)
            acc["draft_s"] += gen.draft_seconds
            acc["verify_s"] += gen.verify_seconds
            if gen.new_tokens == ref.new_tokens:
                acc["identical"] += 1
            elif acc["first_mismatch"] is None:
                acc["first_mismatch"] = idx
                log.warning("drafter %s: prompt %d differs from plain greedy decoding", name, idx)

    greedy_tps = greedy_tokens / greedy_s
    extra = {"num_prompts": len(prompts), "num_draft": k, "drafter_dtype": str(dtype).removeprefix("torch.")}
    results = [_result(name, acc, greedy_tps, extra) for name, acc in per.items()]
    return {
        "target": teacher.identity(),
        "num_prompts": len(prompts),
        "max_new_tokens": max_new,
        "greedy": {"new_tokens": greedy_tokens, "seconds": greedy_s, "tokens_per_s": greedy_tps},
        "results": results,
        "machine": machine_info(),
        "definitions": {
            "tau": "tokens committed per target verification forward, bonus token included (prefill excluded)",
            "alpha": "accepted draft tokens / judged draft tokens (a token is judged when all earlier ones were accepted)",
            "speedup": "speculative tokens/s over plain greedy tokens/s through the same KV-cache path, same prompts",
        },
    }


def _result(name: str, acc: Mapping, greedy_tps: float, extra: Mapping) -> dict:
    tps = acc["tokens"] / acc["seconds"]
    return {
        "drafter": name,
        "new_tokens": acc["tokens"],
        **extra,
        **acc["stats"].to_dict(),
        "tokens_per_s": tps,
        "greedy_tokens_per_s": greedy_tps,
        "speedup": tps / greedy_tps,
        "draft_seconds": acc["draft_s"],
        "verify_seconds": acc["verify_s"],
        "identical_to_greedy": acc["identical"] == extra["num_prompts"],
        "identical_prompts": acc["identical"],
        "first_mismatch_prompt": acc["first_mismatch"],
    }


def summary_table(report: Mapping) -> str:
    lines = [
        f"target {report['target']['name']}: {report['num_prompts']} prompts, up to {report['max_new_tokens']} new tokens; "
        f"plain greedy {report['greedy']['tokens_per_s']:.1f} tok/s",
        f"{'drafter':<14}{'tau':>7}{'alpha':>8}  {'alpha per position':<30}{'tok/s':>8}{'speedup':>9}  identical",
    ]
    for r in report["results"]:
        per_pos = " ".join("  - " if a is None else f"{a:.2f}" for a in r["alpha_per_position"])
        lines.append(
            f"{r['drafter']:<14}{r['tau']:>7.2f}{r['alpha']:>8.2f}  {per_pos:<30}{r['tokens_per_s']:>8.1f}"
            f"{r['speedup']:>8.2f}x  {r['identical_to_greedy']}"
        )
    return "\n".join(lines)


def write_report(report: Mapping, run_dir: str | os.PathLike) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "report.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, path)
    (run_dir / "summary.txt").write_text(summary_table(report) + "\n")
    return path


# Drafters every report shows beside the one under test (eval.baselines); untrained, built from their defaults.
BASELINES = {"lookup": {"_target_": "heads.lookup.PromptLookup"}}


def _with_baselines(drafters: dict, teacher, eval_cfg: Mapping) -> dict:
    from heads.base import build_drafter

    for name in eval_cfg["baselines"]:
        if name not in BASELINES:
            raise ValueError(f"eval.baselines has unknown {name!r}; valid: {sorted(BASELINES)}")
        if name not in drafters:
            drafters[name] = build_drafter(BASELINES[name], teacher)
    return drafters


def _report(cfg, teacher, drafters: dict, run_dir) -> dict:
    prompts = eval_prompts(cfg.eval, teacher.tokenizer)
    report = evaluate(teacher, _with_baselines(drafters, teacher, cfg.eval), prompts, cfg.eval)
    path = write_report(report, run_dir)
    print(summary_table(report), flush=True)
    log.info("wrote %s", path)
    return report


def evaluate_saved(cfg, teacher, drafter_path, run_dir) -> dict:
    """Evaluate the drafter saved at ``drafter_path`` (reloaded from disk, as a user would) against ``teacher``."""
    from heads.base import load_drafter

    drafter = load_drafter(drafter_path, teacher)
    return _report(cfg, teacher, {drafter.name: drafter}, run_dir)


def run_eval(cfg, run_dir, use_saved_target: bool = True) -> dict:
    """``python -m eval``: a saved drafter (``drafter_path=``) or an untrained one (``drafter=lookup``)."""
    from distill.teacher import load_teacher
    from heads.base import build_drafter, read_drafter_config
    from train.config import validate
    from train.engine import resolve_device

    validate(cfg)
    device = resolve_device(cfg.trainer.device)
    if cfg.drafter_path:
        saved = read_drafter_config(cfg.drafter_path)
        # The drafter knows the target it was trained for; use it unless target=... was given explicitly.
        teacher = load_teacher(saved["target_config"] if use_saved_target else cfg.target, device=device)
        return evaluate_saved(cfg, teacher, cfg.drafter_path, run_dir)
    teacher = load_teacher(cfg.target, device=device)
    drafter = build_drafter(cfg.drafter, teacher)
    if any(True for _ in drafter.parameters()):
        raise ValueError(
            f"drafter={drafter.name} has weights to train; evaluate a trained one with drafter_path=<run dir>/drafter "
            f"(written by `python -m train`), or use drafter=lookup"
        )
    return _report(cfg, teacher, {drafter.name: drafter.to(device)}, run_dir)
