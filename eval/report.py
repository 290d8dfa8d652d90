"""Writing an evaluation report: ``report.json`` (atomically), ``summary.txt``, ``summary.md`` and the PNG plots."""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Mapping
from pathlib import Path

import torch

from distill.atomic import write_text_atomically
from eval.batch_sweep import sweep_lines
from eval.markdown import MISSING, check_rows, steps_text, summary_markdown
from eval.plots import write_plots
from heads.saved import weights_digest

log = logging.getLogger(__name__)

DEFINITIONS = {
    "tau": "tokens committed per target verification forward, bonus token included (prefill excluded)",
    "alpha": "accepted draft tokens / judged draft tokens (a token is judged when all earlier ones were accepted); "
             "for trees, per depth along the accepted path",
    "speedup": "speculative tokens/s over plain decoding tokens/s through the same KV-cache path, same prompts, "
               "timed back to back",
    "lossless": "exact acceptance (greedy match or rejection sampling) keeps the target's output distribution; "
                "typical acceptance does not",
    "predicted_speedup": "tau * t_plain / (t_draft + t_verify) with each time measured in isolation (inference.cost)",
    "sim_tau": "training-time estimate, 1 + sum_k prod_{j<=k} acc_j over the last logged top-1 accuracies of draft "
               "steps 1..gamma (Medusa head k, EAGLE TTT step k) on training data; a chain estimate, shown beside the "
               "measured tau",
    "training_perf": "the training run's mean model TFLOP/s over all ranks (attention counted where the mask lets a "
                     "query see a key), MFU = that / (ranks x the device's dense bf16 peak), and the frozen target's "
                     "share of the FLOPs (docs/benchmarks.md, FLOPs and MFU)",
    "overhead_ratio": "wall time / (prefill + sum over steps of isolated t_verify(tree size) + t_draft); 1.0 = no "
                      "loop overhead",
    "mismatches": "greedy runs whose output differs from plain greedy decoding (first 5 prompts): the first "
                  "differing position and the target's logit gap there, logit[plain's token] - logit[committed "
                  "token], from one uncached forward; a near-tie (relative gap near the dtype's rounding, e.g. bf16 "
                  "kernels of different shapes) is numerical noise, a gap of whole logits is a decoder bug",
    "context_lengths": "per context length L (eval.context_lengths): the same held-out passages cut to prompts of L - "
                       "max_new_tokens - lookahead tokens (lookahead: the deepest draft of the run), so decoding runs "
                       "up to position L; tau and speedup over plain decoding of the same prompts, side by side",
    "compiled_vs_eager": "with compiled decode steps, greedy: each method's output on the first 5 prompts against "
                         "plain decoding through eager steps (no compile, no CUDA graphs); where they part, the first "
                         "differing position and the target's logit gap there, as for mismatches (eager's token minus "
                         "the compiled one's, and the target's top-1 minus top-2)",
    "crossover_batch_size": "batch sweep: the first measured batch size at which speculative decoding (fixed gamma) "
                            "is no faster than plain batched decoding",
}


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(report: Mapping) -> str:
    lines = [
        f"target {report['target']['name']}: {report['num_prompts']} prompts, up to {report['max_new_tokens']} new tokens, "
        f"{report.get('sampling', {}).get('mode', 'greedy')}; plain decoding {report['greedy']['tokens_per_s']:.1f} tok/s",
        f"{'drafter':<24}{'tau':>6}{'alpha':>7}  {'alpha per position':<26}{'tok/s':>8}{'speedup':>9}{'pred.':>7}"
        f"{'overh.':>7}  identical",
    ]
    for r in report["results"]:
        per_pos = " ".join("  - " if a is None else f"{a:.2f}" for a in r["alpha_per_position"][:6])
        cost = r.get("cost") or {}
        lines.append(
            f"{r.get('label', r['drafter']):<24}{r['tau']:>6.2f}{r['alpha']:>7.2f}  {per_pos:<26}{r['tokens_per_s']:>8.1f}"
            f"{r['speedup']:>8.2f}x{_fmt(cost.get('predicted_speedup'), '>6.2f')}x{_fmt(cost.get('overhead_ratio'), '>7.2f')}"
            f"  {r['identical_to_greedy']}"
        )
    lines += [_sim_tau_line(r) for r in report["results"] if r.get("sim_tau") is not None]
    lines += [_context_line(r) for r in report["results"] if r.get("context_lengths")]
    for name, b in (report.get("baselines") or {}).items():
        lines.append(f"baseline {name:<15} {b['tokens_per_s']:>8.1f} tok/s  speedup {_fmt(b.get('speedup'), '.2f')}x"
                     + (f"  ({b['note']})" if b.get("note") else ""))
    if report.get("batch_sweep"):
        lines += sweep_lines(report["batch_sweep"])
    if report.get("decoder_steps"):
        lines.append(steps_text(report["decoder_steps"]))
    for name, same, where, gap, top2 in check_rows(report.get("compiled_vs_eager") or {}):
        lines.append(f"compiled {name} vs eager plain: {same} identical" + (
            f"; largest logit gap {gap} at {where} (top-1 - top-2 {top2})" if where != MISSING else ""))
    return "\n".join(lines)


def _sim_tau_line(r: Mapping) -> str:
    """The training-time estimate beside the measured τ. From one trained draft step it is only that step's top-1
    accuracy plus one, no estimate of a γ-token draft, so it is labelled as such rather than set against τ."""
    if r["sim_tau_steps"] < 2:
        return (f"{r['drafter']}: training-time top-1 accuracy of draft step 1: {r['sim_tau'] - 1:.2f} (trained on "
                f"one draft step, so no training-time tau estimate; measured tau {r['tau']:.2f})")
    return (f"{r['drafter']}: training-time sim tau {r['sim_tau']:.2f} (chain estimate over {r['sim_tau_steps']} "
            f"steps) vs measured tau {r['tau']:.2f}")


def _context_line(r: Mapping) -> str:
    """τ and speedup per context length (``eval.context_lengths``) of one drafter, on one line."""
    cells = ", ".join(f"{n}: {c['tau']:.2f} ({c['speedup']:.2f}x)" for n, c in r["context_lengths"].items())
    return f"{r['drafter']}: tau (speedup) by context length: {cells}"


RUN_OUTPUTS = ("drafter", "checkpoints", "metrics.jsonl")  # what python -m train leaves in its run dir


def check_report_dir(run_dir: str | os.PathLike, digests: set[str | None]) -> None:
    """Refuse a run dir whose report.json, summaries and plots belong to something other than the drafter about to be
    measured (``digests``: the weights digests of the drafters under test, None for one without weights): a training
    run's dir takes only a report of that run's own drafter, and an earlier report is replaced only by a measurement
    of a drafter it measured. A fresh (or empty) directory always passes."""
    run_dir = Path(run_dir)
    if (run_dir / "drafter").is_dir() and weights_digest(run_dir / "drafter") in digests - {None}:
        return  # the run's own drafter: its report belongs here
    found = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    report = run_dir / "report.json"
    if not found and report.is_file():
        try:
            measured = {row.get("weights_digest") for row in json.loads(report.read_text()).get("results", [])}
        except (ValueError, AttributeError):
            measured = set()
        if measured & (digests - {None}):
            return  # the same drafter measured again
        found.append("report.json")
    if found:
        raise FileExistsError(f"hydra.run.dir={run_dir} already holds another run's outputs ({', '.join(found)}); "
                              f"evaluating here would replace its report.json, summaries and plots with a measurement "
                              f"of another drafter. Leave hydra.run.dir unset (a fresh dir), or name a new one")


def write_report(report: dict, run_dir: str | os.PathLike, plots: bool = True) -> Path:
    """report.json (atomically: a reader never sees half a file), summary.txt, summary.md and, optionally, plots."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if plots:
        report["plots"] = [p.name for p in write_plots(report, run_dir)]
    path = run_dir / "report.json"
    write_text_atomically(path, json.dumps(report, indent=2))
    (run_dir / "summary.txt").write_text(summary_table(report) + "\n")
    (run_dir / "summary.md").write_text(summary_markdown(report))
    return path
