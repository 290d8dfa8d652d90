"""DSpark's confidence cut, timed side by side: one trained drafter decoded at the fixed block and at each confidence
threshold, round after round, with the verification positions each pays per committed token.

    python scripts/bench_dspark_cut.py --drafter RUN/drafter                  # thresholds 0.05 0.1 0.2 0.3 0.5
    python scripts/bench_dspark_cut.py --drafter RUN/drafter --also RUN2/drafter --out /tmp/cut.json

``--drafter``: a DSpark drafter saved by ``python -m train`` (``experiment=dspark_toy``); ``--also``: more drafters
measured the same way (DSpark without its Markov head: the confidence head's effect alone). Every round decodes each
held-out prompt (``eval.num_prompts``, ``eval.max_new_tokens``; greedy) plainly and then with every view of every
drafter, back to back (the threshold changes nothing but the cut: ``DSparkDrafter.with_threshold``), so a noisy
machine slows all of them alike; each view's tokens/s is taken per round and the median over rounds is reported,
with the median of its per-round ratio to the same drafter's fixed block. Every output is checked token-identical to
plain decoding. ``verified_per_token``: positions the verification forwards fed (the pending token and the chain
bucket, padding included) per committed token; ``offered_per_token``: the drafts put up for verification.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[1]


def views_of(name: str, drafter, thresholds: list[float]) -> dict:
    out = {name: drafter.with_threshold(None)}
    for t in thresholds:
        out[f"{name}[conf={t:g}]"] = drafter.with_threshold(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", required=True, help="a saved DSpark drafter directory")
    ap.add_argument("--also", nargs="*", default=[], help="more saved DSpark drafters, measured the same way")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="scripts/results/bench_dspark_cut_toy_cpu.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. eval.num_prompts=10")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from hydra import compose, initialize_config_dir

    from distill.atomic import write_text_atomically
    from distill.teacher import load_teacher
    from eval.report import machine_info
    from eval.run import build_decoder, eval_prompts
    from heads.saved import load_drafter
    from train.config import load_config, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=args.overrides))
    ev = cfg.eval
    teacher = load_teacher(cfg.target, device="cpu")
    decoder = build_decoder(teacher, cfg.decoder)
    prompts = [torch.tensor([list(p)], dtype=torch.long) for p in eval_prompts(ev, teacher.tokenizer)[0]]
    views, depth = {}, {}
    for path in [args.drafter, *args.also]:
        drafter = load_drafter(path, teacher).float()
        if not hasattr(drafter, "with_threshold"):
            raise SystemExit(f"--drafter {path}: a {type(drafter).__name__}, not a DSpark drafter")
        name = "dspark" if drafter.markov_head is not None else "dspark_nomarkov"
        for view, d in views_of(name, drafter, args.thresholds).items():
            views[view] = d
            depth[view] = d.depth or d.block_size - 1
    refs = [decoder.plain(p, ev.max_new_tokens).new_tokens for p in prompts]  # also warms the steps up
    for view, d in views.items():
        decoder.speculative(d, prompts[0], ev.max_new_tokens, depth[view])
    rates = {v: [] for v in ["plain", *views]}
    totals = {v: {"new": 0, "forwards": 0, "verified": 0, "offered": 0, "identical": 0} for v in views}
    for _ in range(args.rounds):
        seconds = {v: 0.0 for v in rates}
        tokens = {v: 0 for v in rates}
        for p, ref in zip(prompts, refs):
            gen = decoder.plain(p, ev.max_new_tokens)
            seconds["plain"] += gen.seconds
            tokens["plain"] += len(gen.new_tokens)
            for view, d in views.items():
                gen = decoder.speculative(d, p, ev.max_new_tokens, depth[view])
                seconds[view] += gen.seconds
                tokens[view] += len(gen.new_tokens)
                t = totals[view]
                t["new"] += len(gen.new_tokens)
                t["forwards"] += gen.stats.forwards
                t["verified"] += gen.verified_positions
                t["offered"] += sum(size * n for size, n in gen.nodes_per_forward.items())
                t["identical"] += gen.new_tokens == ref
        for v in rates:
            rates[v].append(tokens[v] / seconds[v])
    rows = {"plain": {"tokens_per_s": median(rates["plain"])}}
    for view in views:
        base = view.split("[")[0]
        t = totals[view]
        rows[view] = {
            "threshold": views[view].confidence_threshold,
            "tau": t["new"] / t["forwards"],
            "tokens_per_s": median(rates[view]),
            "speedup": median(a / b for a, b in zip(rates[view], rates["plain"])),
            "over_fixed_block": median(a / b for a, b in zip(rates[view], rates[base])),
            "verified_per_token": t["verified"] / t["new"],
            "offered_per_token": t["offered"] / t["new"],
            "identical_prompts": f"{t['identical']}/{len(prompts) * args.rounds}",
        }
        print(f"{view:<28} τ {rows[view]['tau']:.3f}  {rows[view]['tokens_per_s']:.1f} tok/s  "
              f"÷fixed {rows[view]['over_fixed_block']:.3f}  verified/token {rows[view]['verified_per_token']:.3f}  "
              f"{rows[view]['identical_prompts']}")
    out = {"machine": machine_info(), "rounds": args.rounds, "threads": args.threads,
           "settings": {"num_prompts": len(prompts), "prompt_tokens": ev.prompt_tokens,
                        "max_new_tokens": ev.max_new_tokens, "thresholds": args.thresholds,
                        "drafters": [Path(p).parent.name for p in [args.drafter, *args.also]]},
           "per_round_tokens_per_s": rates, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(Path(args.out), json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
