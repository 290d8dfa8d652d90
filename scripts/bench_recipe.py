"""Recipe benchmark: τ of drafters trained with one recipe change each, at equal steps or equal CPU time (EAGLE, and
DFlash against EAGLE-1).

    python scripts/bench_recipe.py                                   # every row below, seeds 0 and 1
    python scripts/bench_recipe.py --rows eagle1 eagle1_ttt2 --seeds 0
    python scripts/bench_recipe.py --table                           # print the recipe table from the JSON
    python scripts/bench_recipe.py --preset tiny --out /tmp/r.json   # seconds: checks the script end to end
    python scripts/bench_recipe.py --group losses --seeds 0 1 --out scripts/results/bench_recipe_losses_toy_cpu.json
    python scripts/bench_recipe.py --group dflash2 --seeds 0 1 --out scripts/results/bench_recipe_dflash2_toy_cpu.json
    python scripts/bench_recipe.py --rows eagle1 dflash_eqcpu --seeds 0 --out scripts/results/bench_recipe_dflash_toy_cpu.json
    python scripts/bench_recipe.py --rows eagle3_ttt3_vocab1024 eagle3_ttt3_vocab1024_fc_norm \
        eagle3_ttt3_vocab1024_norm_output eagle3_ttt3_vocab1024_fc_norm_norm_output --seeds 0 \
        --out scripts/results/bench_recipe_eagle31_tiny_cpu.json target=tiny data.max_length=128 \
        eval.prompt_tokens=48 eval.max_new_tokens=64

Every row is ``python -m train`` (same windows: ``trainer.steps`` x 8 rows x 256 tokens from the stdlib data; only
the row's overrides and ``seed=`` differ) in a subprocess, one after another, with ``OMP_NUM_THREADS=1`` so the
CPU seconds it reports are one core's. Then this process reloads the saved drafter (``heads.saved.load_drafter``) and
decodes the same held-out prompts (``eval.eval_prompts``: 20 stdlib excerpts, 128 prompt tokens, 96 new tokens,
greedy) with the project's decoder under each tree budget (TREES), every output checked token-identical to plain
greedy decoding (a drafter without trees, DFlash, decodes its chain at the EAGLE chain's depth and at its whole
block: ``chain`` and ``block``). Proposals run in float32 (``eval.drafter_dtype=auto`` would pick the faster of fp32/bf16 per
run, which changes τ slightly between runs).

Budgets: ``cpu_s`` is the training subprocess's user+sys CPU time (startup, target load and data included: what a
user pays), ``loop_s`` the training loop's wall time (``train/elapsed_s``); wall figures depend on the machine's
load, so the load average before and after each run is kept beside them. Rows are written after each one; a rerun
skips rows already in ``--out`` (an interrupted benchmark resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

from train.checkpoint import fresh_scratch_run

ROOT = Path(__file__).resolve().parents[1]

E1, E3 = ["drafter=eagle1"], ["drafter=eagle3"]
E31 = [*E3, "drafter.ttt_steps=3", "drafter.draft_vocab_size=1024"]  # the base of the EAGLE-3.1 rows
DFD = ["experiment=dflash_toy", "drafter.objective=distill"]  # DFlash toy, trained against the target's distribution
# DFlash as experiment=dflash_toy builds it (its data aside: each row says which): 1 draft layer on layers 1-3, blocks
# of 8, 32 anchors per row (~0.5 CPU s per step of 8 x 256 tokens on the toy, as EAGLE-1's)
DF = ["drafter=dflash", "drafter.block_size=8", "drafter.num_layers=1", "drafter.layers=[1,2,3]",
      "drafter.num_anchors=32", "drafter.draft_vocab_size=1024"]
# Regenerated data for the "_regen" rows: `python -m distill.regenerate regenerate.out=<this> regenerate.temperature=0
# regenerate.num_prompts=1400` (the toy target's greedy answers to the first 64 tokens of 1,400 training rows).
REGEN_T0 = os.environ.get("SPECDRAFT_REGEN_T0", "runs/regen_t0.jsonl")
# the winning recipe: regenerated data + top-1 cross-entropy (the teacher cut to its argmax) at kl_weight 1
R1 = ["data.mode=regenerated", f"data.regenerated={REGEN_T0}", "loss=topk_fkl", "loss.k=1", "drafter.kl_weight=1.0"]
# name -> (overrides, steps). Step counts of the equal-CPU rows come from the measured CPU per step (startup
# excluded, load ~3): EAGLE-1 0.49 s, with TTT 2 0.66 s, TTT 3 0.88 s; EAGLE-3 TTT 2 0.78 s, TTT 4 1.29 s (TTT 7
# extrapolated: ~2.0 s). "_eqcpu" matches EAGLE-1's 350 steps (~184 CPU s); "_10cpumin" stays under 600 CPU s.
ROWS = {
    "eagle1": (E1, 350),
    "eagle1_ttt2": ([*E1, "drafter.ttt_steps=2"], 350),
    "eagle1_ttt3": ([*E1, "drafter.ttt_steps=3"], 350),
    "eagle1_ttt2_eqcpu": ([*E1, "drafter.ttt_steps=2"], 260),
    "eagle1_ttt3_eqcpu": ([*E1, "drafter.ttt_steps=3"], 195),
    "eagle1_ttt2_decay1": ([*E1, "drafter.ttt_steps=2", "drafter.loss_decay=1.0"], 350),
    "eagle1_noise0": ([*E1, "drafter.feature_noise=0.0"], 350),
    "eagle1_noise0.2": ([*E1, "drafter.feature_noise=0.2"], 350),
    "eagle1_kl1": ([*E1, "drafter.kl_weight=1.0"], 350),
    "eagle1_kl0": ([*E1, "drafter.kl_weight=0.0"], 350),
    "eagle1_lr5e-3": ([*E1, "trainer.lr=5e-3"], 350),
    "eagle1_lr1e-2": ([*E1, "trainer.lr=1e-2"], 350),
    "eagle1_kl1_feat0.1": ([*E1, "drafter.kl_weight=1.0", "drafter.feature_loss_weight=0.1"], 350),
    "eagle1_tvd_kl1": ([*E1, "loss=tvd", "drafter.kl_weight=1.0"], 350),
    "eagle1_topk_kl1": ([*E1, "loss=topk_fkl", "drafter.kl_weight=1.0"], 350),
    "eagle1_top1ce_kl1": ([*E1, "loss=topk_fkl", "loss.k=1", "drafter.kl_weight=1.0"], 350),  # CE on the target's argmax
    "eagle1_top1ce": ([*E1, "loss=topk_fkl", "loss.k=1"], 350),  # the same at the default kl_weight 0.1
    "eagle1_fkl_t0.5_kl1": ([*E1, "loss.temperature=0.5", "drafter.kl_weight=1.0"], 350),
    # The target's greedy answers (REGEN_T0, written by `python -m distill.regenerate`, cost reported apart).
    "eagle1_regen0": ([*E1, "data.mode=regenerated", f"data.regenerated={REGEN_T0}"], 350),
    "eagle1_regen0_kl1_feat0.1": ([*E1, "data.mode=regenerated", f"data.regenerated={REGEN_T0}", "drafter.kl_weight=1.0",
                                   "drafter.feature_loss_weight=0.1"], 350),
    "eagle1_regen0_top1ce_kl1": ([*E1, *R1], 350),
    "eagle1_regen0_top1ce": ([*E1, "data.mode=regenerated", f"data.regenerated={REGEN_T0}", "loss=topk_fkl", "loss.k=1"], 350),
    "eagle1_regen0_10cpumin": ([*E1, "data.mode=regenerated", f"data.regenerated={REGEN_T0}"], 1000),
    "eagle1_10cpumin": (E1, 1000),  # 0.57 CPU s/step measured at load ~5 (lr 1e-2 row): 1,200 would overrun
    "eagle3_10cpumin": (E3, 280),
    "eagle3_ttt4_10cpumin": ([*E3, "drafter.ttt_steps=4"], 500),  # measured 661 CPU s: over the budget
    "eagle3_ttt2_10cpumin": ([*E3, "drafter.ttt_steps=2"], 600),
    # the winning EAGLE-1 recipe (regenerated data + top-1 CE) at ~10 CPU-minutes, for both kinds
    "eagle3_ttt2_regen0_top1ce_kl1_10cpumin": ([*E3, "drafter.ttt_steps=2", *R1], 600),
    "eagle1_regen0_top1ce_kl1_10cpumin": ([*E1, *R1], 1000),
    # EAGLE-3 on the winning recipe, varied one knob at a time (step counts: ~10 CPU-minutes at the measured CPU
    # per step of each TTT length; the GPU study (--device cuda) runs them side by side for τ only)
    "eagle3_ttt1_regen0_top1ce_kl1_10cpumin": ([*E3, "drafter.ttt_steps=1", *R1], 950),
    "eagle3_ttt1_regen0_top1ce_kl1_lr5e-3_10cpumin": ([*E3, "drafter.ttt_steps=1", *R1, "trainer.lr=5e-3"], 950),
    "eagle3_ttt3_regen0_top1ce_kl1_10cpumin": ([*E3, "drafter.ttt_steps=3", *R1], 450),
    # TTT 3 measured at 1.02 CPU s per step (+8 s start-up; 1 thread, load ~1.5): 540 steps ~560 CPU s
    "eagle3_ttt3_regen0_top1ce_kl1_540steps_10cpumin": ([*E3, "drafter.ttt_steps=3", *R1], 540),
    "eagle3_ttt3_regen0_top1ce_kl1_decay1_540steps_10cpumin": ([*E3, "drafter.ttt_steps=3", *R1,
                                                               "drafter.loss_decay=1.0"], 540),
    # TTT 4 at 1.29 CPU s per step (measured earlier at load ~3): 440 steps ~576 CPU s
    "eagle3_ttt4_regen0_top1ce_kl1_10cpumin": ([*E3, "drafter.ttt_steps=4", *R1], 440),
    "eagle3_ttt4_regen0_top1ce_kl1_decay1_10cpumin": ([*E3, "drafter.ttt_steps=4", *R1, "drafter.loss_decay=1.0"],
                                                      420),
    # after the explicit TTT attention (heads/eagle/model.py): EAGLE-1 given the whole 600 CPU s (0.51 CPU s per
    # step incl. start-up at 1,000 steps), and EAGLE-3 TTT 3 (loss decay 1) with a smaller draft vocabulary, whose
    # lm_head, logits and loss rows shrink with it (toy regenerated answers: 1,024 ids cover 99.9% of answer tokens,
    # 512 99.6%; measured ~0.81 and ~0.68 of the 3,072-id step)
    "eagle1_regen0_top1ce_kl1_1140steps_10cpumin": ([*E1, *R1], 1140),
    "eagle3_ttt3_regen0_top1ce_kl1_decay1_vocab1024_10cpumin": ([*E3, "drafter.ttt_steps=3", *R1, "drafter.loss_decay=1.0",
                                                                "drafter.draft_vocab_size=1024"], 660),
    "eagle3_ttt3_regen0_top1ce_kl1_decay1_vocab512_10cpumin": ([*E3, "drafter.ttt_steps=3", *R1, "drafter.loss_decay=1.0",
                                                               "drafter.draft_vocab_size=512"], 780),
    # the same with its first 300 steps at TTT 1 (drafter.ttt_warmup_steps; ~0.46 CPU s per step against TTT 3's
    # ~0.80 at vocabulary 1,024): 820 steps, of which 520 at TTT 3
    "eagle3_ttt3_regen0_top1ce_kl1_decay1_vocab1024_warmup300_10cpumin": (
        [*E3, "drafter.ttt_steps=3", *R1, "drafter.loss_decay=1.0", "drafter.draft_vocab_size=1024",
         "drafter.ttt_warmup_steps=300"], 820),
    # a longer warm-up (measured above: ~0.50 CPU s per TTT-1 step, ~0.80 per TTT-3 step): 860 steps, 460 at TTT 3
    "eagle3_ttt3_regen0_top1ce_kl1_decay1_vocab1024_warmup400_10cpumin": (
        [*E3, "drafter.ttt_steps=3", *R1, "drafter.loss_decay=1.0", "drafter.draft_vocab_size=1024",
         "drafter.ttt_warmup_steps=400"], 860),
    # warm-up 300 at a 512-id vocabulary (99.6% of the answer tokens; ~0.67 CPU s per TTT-3 step): 940 steps (seed 0:
    # 583 CPU s, 16-node 4.55, below the 1,024-id row)
    "eagle3_ttt3_regen0_top1ce_kl1_decay1_vocab512_warmup300_10cpumin": (
        [*E3, "drafter.ttt_steps=3", *R1, "drafter.loss_decay=1.0", "drafter.draft_vocab_size=512",
         "drafter.ttt_warmup_steps=300"], 940),
    "eagle3_ttt2_regen0_top1ce_kl1_vocabfull_10cpumin": ([*E3, "drafter.ttt_steps=2", *R1,
                                                          "drafter.draft_vocab_size=null"], 600),
    "eagle3_ttt2_regen0_top1ce_kl1_layers123_10cpumin": ([*E3, "drafter.ttt_steps=2", *R1, "drafter.layers=[1,2,3]"],
                                                         600),
    "eagle3_ttt2_regen0_top1ce_kl1_layers234_10cpumin": ([*E3, "drafter.ttt_steps=2", *R1, "drafter.layers=[2,3,4]"],
                                                         600),
    "eagle3_ttt2_regen0_top1ce_kl1_lr5e-3_10cpumin": ([*E3, "drafter.ttt_steps=2", *R1, "trainer.lr=5e-3"], 600),
    "eagle3_ttt2_vocab1024_10cpumin": ([*E3, "drafter.ttt_steps=2", "drafter.draft_vocab_size=1024"], 600),
    "eagle3_ttt2_vocabfull_10cpumin": ([*E3, "drafter.ttt_steps=2", "drafter.draft_vocab_size=null"], 600),
    # DFlash at EAGLE-1's CPU budget: against "eagle1" (same fixed data) and "eagle1_regen0_top1ce_kl1" (the same
    # regenerated answers; DFlash's own loss is already cross-entropy on the target's tokens)
    "dflash_eqcpu": (DF, 350),
    "dflash_regen0_eqcpu": ([*DF, "data.mode=regenerated", f"data.regenerated={REGEN_T0}"], 350),
    # EAGLE-3.1's flags beside plain EAGLE-3 at equal steps (TTT 3, 1,024-id draft vocabulary: ~0.8 CPU s per step)
    "eagle3_ttt3_vocab1024": (E31, 200),
    "eagle3_ttt3_vocab1024_fc_norm": ([*E31, "drafter.fc_norm=true"], 200),
    "eagle3_ttt3_vocab1024_norm_output": ([*E31, "drafter.norm_output=true"], 200),
    "eagle3_ttt3_vocab1024_fc_norm_norm_output": ([*E31, "drafter.fc_norm=true", "drafter.norm_output=true"], 200),
    "eagle3_ttt3_vocab1024_norm_before_fc": ([*E31, "drafter.norm_before_fc=true"], 200),
    # The acceptance-aligned losses against forward KL (the default loss) on EAGLE-3 at equal steps: LK^alpha
    # (-log of the acceptance), LK^lambda (KL handing over to TV as the acceptance grows), forward KL weighted by
    # each position's acceptance (GROUPS["losses"] runs the four)
    "eagle3_fkl_600": (E3, 600),
    "eagle3_lk_alpha_600": ([*E3, "loss=lk"], 600),
    "eagle3_lk_lambda_600": ([*E3, "loss=lk", "loss.variant=lambda"], 600),
    "eagle3_acceptance_weighted_fkl_600": ([*E3, "loss=acceptance_weighted"], 600),
    # The same objectives on DFlash (experiment=dflash_toy's drafter, its slots trained against the target's
    # distribution: drafter.objective=distill) beside its default cross-entropy on the target's tokens, at EAGLE-3's
    # budget (GROUPS["losses_dflash"] runs the five)
    "dflash_ce_600": (["experiment=dflash_toy"], 600),
    "dflash_fkl_600": ([*DFD, "loss=fkl"], 600),
    "dflash_lk_alpha_600": ([*DFD, "loss=lk"], 600),
    "dflash_lk_lambda_600": ([*DFD, "loss=lk", "loss.variant=lambda"], 600),
    "dflash_acceptance_weighted_fkl_600": ([*DFD, "loss=acceptance_weighted"], 600),
    # The block-parallel drafters at experiment=dflash_toy's budget (2000 steps on the same regenerated answers):
    # DFlash, DSpark and DFlash2 as their toy experiments build them, and DFlash2 without each of its two modules
    # (GROUPS["dflash2"] runs the five)
    "dflash_toy": (["experiment=dflash_toy"], 2000),
    "dspark_toy": (["experiment=dspark_toy"], 2000),
    "dflash2_toy": (["experiment=dflash2_toy"], 2000),
    "dflash2_toy_no_selector": (["experiment=dflash2_toy", "drafter.selector=false"], 2000),
    "dflash2_toy_no_conv": (["experiment=dflash2_toy", "drafter.conv=false"], 2000),
}
# --group NAME: these rows side by side (the same as naming them in --rows)
GROUPS = {
    "losses": ["eagle3_fkl_600", "eagle3_lk_alpha_600", "eagle3_lk_lambda_600", "eagle3_acceptance_weighted_fkl_600"],
    "losses_dflash": ["dflash_ce_600", "dflash_fkl_600", "dflash_lk_alpha_600", "dflash_lk_lambda_600",
                      "dflash_acceptance_weighted_fkl_600"],
    "dflash2": ["dflash_toy", "dspark_toy", "dflash2_toy", "dflash2_toy_no_selector", "dflash2_toy_no_conv"],
}
# Tree budgets: (tree mode, top_k, total_tokens, depth). depth is also γ, the decoder's bound on proposal depth.
TREES = {
    "chain": ("chain", 1, 4, 4),
    "tree16": ("dynamic", 4, 16, 4),
    "tree59": ("dynamic", 10, 59, 6),
}
PRESETS = {
    "toy": {"common": [], "steps_scale": 1.0},
    "tiny": {"common": ["experiment=smoke", "eval.num_prompts=2"], "steps_scale": 0.02},
}
TRAIN = ["eval.enabled=false", "trainer.resume=never", "trainer.ckpt_every=100000"]


def train_row(overrides: list[str], run_dir: Path, log_path: Path, device: str = "cpu") -> dict:
    """Run ``python -m train`` in a subprocess; its wall and CPU seconds and the load average around it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "train", *overrides, f"trainer.device={device}",
                               f"hydra.run.dir={run_dir}"], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = log_path.read_text().splitlines()[-30:]
        raise SystemExit(f"training failed (exit {proc.returncode}); log {log_path}:\n" + "\n".join(tail))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def budgets(drafter) -> dict:
    """The tree budgets a drafter is decoded under: TREES for a drafter with EAGLE's dynamic tree, else its chain at
    the EAGLE chain's depth and at its whole block (DFlash)."""
    if hasattr(drafter, "top_k"):
        return TREES
    return {"chain": TREES["chain"], "block": ("chain", 1, drafter.block_size - 1, drafter.block_size - 1)}


def decode_trees(decoder, drafter, prompts, refs, max_new: int) -> dict:
    """τ, α per position, draft time and identity to greedy for each tree budget (``budgets``)."""
    from inference.stats import AcceptStats

    out = {}
    for name, (mode, top_k, total, depth) in budgets(drafter).items():
        drafter.set_tree(mode)
        if hasattr(drafter, "top_k"):
            drafter.top_k, drafter.total_tokens = top_k, total
        drafter.depth = depth
        stats, identical, seconds, draft_s, tokens = AcceptStats(), 0, 0.0, 0.0, 0
        for prompt, ref in zip(prompts, refs):
            gen = decoder.speculative(drafter, prompt, max_new, depth)
            stats.merge(gen.stats)
            identical += gen.new_tokens == ref
            seconds, draft_s, tokens = seconds + gen.seconds, draft_s + gen.draft_seconds, tokens + len(gen.new_tokens)
        out[name] = {"tau": stats.tau, "alpha": stats.alpha, "alpha_per_position": stats.alpha_per_position,
                     "target_forwards": stats.forwards, "identical_to_greedy": identical == len(prompts),
                     "identical_prompts": identical, "tokens_per_s": tokens / seconds, "draft_s": draft_s}
    return out


def table(results: dict) -> str:
    """Markdown: one line per row and seed, then the mean over seeds of each row."""
    rows, n = results["rows"], results["settings"]["eval"]["num_prompts"]
    head = ("| row | seed | steps | CPU s | wall s (load) | τ chain | τ 16-node | τ 59-node | τ block | train top-1, "
            "step 0 | identical |\n|---|---|---|---|---|---|---|---|---|---|---|")
    tau = lambda trees, name: f"{trees[name]['tau']:.2f}" if name in trees else "-"
    lines, by_row = [head], {}
    for key, r in rows.items():
        by_row.setdefault(r["row"], []).append(r)
        t = r["trees"]
        same = sum(x["identical_prompts"] for x in t.values())
        lines.append(f"| {r['row']} | {r['seed']} | {r['steps']} | {r['cpu_s']:.0f} | {r['wall_s']:.0f} "
                     f"({r['loadavg_before'][0]:.1f}) | {tau(t, 'chain')} | {tau(t, 'tree16')} | "
                     f"{tau(t, 'tree59')} | {tau(t, 'block')} | {r['final'].get('train/acc_head1', 0):.3f} | "
                     f"{same}/{n * len(t)} |")
    lines += ["", "| row (mean over seeds) | seeds | steps | CPU s | τ chain | τ 16-node | τ 59-node | τ block |",
              "|---|---|---|---|---|---|---|---|"]
    for name, rs in by_row.items():
        m = lambda tree: (f"{mean(r['trees'][tree]['tau'] for r in rs):.2f}" if all(tree in r["trees"] for r in rs)
                          else "-")
        lines.append(f"| {name} | {','.join(str(r['seed']) for r in rs)} | {rs[0]['steps']} | "
                     f"{mean(r['cpu_s'] for r in rs):.0f} | {m('chain')} | {m('tree16')} | {m('tree59')} | "
                     f"{m('block')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="toy")
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=None, help="default: every row")
    parser.add_argument("--group", choices=sorted(GROUPS), default=None, help="a named set of rows (GROUPS), "
                        "after any --rows")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=None, help="train every row this many steps (default: each "
                        "row's own, from the table above)")
    parser.add_argument("--work", default="runs/bench_recipe", help="run dirs and training logs")
    parser.add_argument("--out", default=None, help="JSON path (default scripts/results/bench_recipe_<preset>_cpu.json)")
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    parser.add_argument("--redecode", action="store_true", help="decode the --rows already in --out again from their "
                        "run dirs under --work (after a decoder fix), keeping their training figures")
    parser.add_argument("--device", default="cpu", help="train and decode here (cuda: τ only; its CPU s are not "
                        "the CPU budget, which comes from CPU runs of the same rows)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every row, e.g. trainer.lr=1e-3")
    args = parser.parse_args(argv)
    if args.rows is None:
        args.rows = [] if args.group else list(ROWS)
    args.rows += [r for r in GROUPS.get(args.group, []) if r not in args.rows]
    preset = PRESETS[args.preset]
    out = Path(args.out or ROOT / "scripts" / "results" / f"bench_recipe_{args.preset}_cpu.json")
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.table:
        print(table(results))
        return
    common = [*preset["common"], *args.overrides]
    if results.get("settings", {}).get("common") not in (None, common):
        raise SystemExit(f"{out} was written with other settings ({results['settings']['common']}); pass --out")
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)

    import torch
    from hydra import compose, initialize_config_dir

    from distill.atomic import write_text_atomically
    from distill.teacher import load_teacher
    from eval.report import machine_info
    from eval.run import build_decoder, eval_prompts
    from heads.saved import load_drafter
    from train.config import load_config, register_configs

    torch.set_num_threads(1)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=common))
    ev = cfg.eval
    results.update(machine=machine_info(), device=args.device, settings={"common": common, "trees": TREES, "eval": {
        "num_prompts": ev.num_prompts, "prompt_tokens": ev.prompt_tokens, "max_new_tokens": ev.max_new_tokens},
        "proposal_dtype": "float32",
        "decoder": "greedy"})
    results.setdefault("rows", {})
    teacher = load_teacher(cfg.target, device=args.device)
    decoder = build_decoder(teacher, cfg.decoder)
    prompts = [torch.tensor([p], dtype=torch.long) for p in eval_prompts(ev, teacher.tokenizer)[0]]
    refs = None  # plain greedy outputs, decoded once (greedy is deterministic)

    for name in args.rows:
        overrides, steps = ROWS[name]
        steps = args.steps or steps
        steps = max(2, round(steps * preset["steps_scale"]))
        for seed in args.seeds:
            key = f"{name}/s{seed}"
            run_dir = work / key.replace("/", "_")
            if key in results["rows"] and args.redecode:
                if refs is None:
                    refs = [decoder.plain(p, ev.max_new_tokens).new_tokens for p in prompts]
                drafter = load_drafter(run_dir / "drafter", teacher).float().to(teacher.device)
                results["rows"][key]["trees"] = decode_trees(decoder, drafter, prompts, refs, ev.max_new_tokens)
                write_text_atomically(out, json.dumps(results, indent=2))
                print(f"{key}: decoded again: " + ", ".join(f"{t} τ {r['tau']:.2f}" for t, r in
                                                              results["rows"][key]["trees"].items()), flush=True)
                continue
            if key in results["rows"]:
                print(f"{key}: done already (in {out})", flush=True)
                continue
            fresh_scratch_run(run_dir)  # a run cut short is not in results; trainer.resume=never needs it empty
            cmd = [*overrides, *common, *TRAIN, f"trainer.steps={steps}", f"seed={seed}"]
            cost = train_row(cmd, run_dir, work / f"{key.replace('/', '_')}.log", args.device)
            saved = json.loads((run_dir / "drafter" / "config.json").read_text())
            final = saved.get("training", {}).get("final", {})
            if refs is None:
                refs = [decoder.plain(p, ev.max_new_tokens).new_tokens for p in prompts]
            drafter = load_drafter(run_dir / "drafter", teacher).float().to(teacher.device)
            trees = decode_trees(decoder, drafter, prompts, refs, ev.max_new_tokens)
            results["rows"][key] = {"row": name, "seed": seed, "steps": steps, "overrides": overrides, **cost,
                                    "loop_s": final.get("train/elapsed_s"), "final": final, "trees": trees}
            write_text_atomically(out, json.dumps(results, indent=2))
            print(f"{key}: {steps} steps, {cost['cpu_s']:.0f} CPU s ({cost['wall_s']:.0f} s wall, load "
                  f"{cost['loadavg_before'][0]:.1f}); " + ", ".join(
                      f"{t} τ {r['tau']:.2f}{'' if r['identical_to_greedy'] else ' NOT IDENTICAL'}"
                      for t, r in trees.items()), flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
