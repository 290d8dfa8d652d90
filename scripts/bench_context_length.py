"""τ by context length: drafters trained on short windows, decoded at longer contexts, full attention against a sliding
window (``drafter.sliding_window``), for EAGLE-3 and DFlash.

    python scripts/bench_context_length.py                                # every row; bench_context_length_toy_cpu.json
    python scripts/bench_context_length.py --rows dflash dflash_window32
    python scripts/bench_context_length.py --table                        # print the table of --out
    python scripts/bench_context_length.py --preset tiny --out /tmp/c.json   # seconds: checks the script end to end

Every row is ``python -m train`` on ``data.max_length=64`` (64-token training windows of the stdlib data) in a
subprocess at ``OMP_NUM_THREADS=1``, one after another; rows differ only in their overrides. Then this process reloads
the saved drafters and measures them side by side with ``eval.context_lengths`` (``eval.context_lengths``: each
bucket decodes the same 10 held-out passages cut to length - 32 new tokens - γ, up to the bucket's length; greedy,
γ = 4, proposals in float32), plain decoding timed on the same prompts. The toy preset's target is the toy
pretrained 300 steps in float32 (``target.toy.steps=300 target.toy.autocast_bf16=false``), which builds in minutes
on a CPU. Trained rows are kept in ``--out`` and not trained again; the measurement runs over every trained row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recipe import train_row  # noqa: E402  (sibling scripts)
from gen_benchmarks import render_context_length  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

WINDOW = 32  # the sliding window: half the 64-token training window, so training sees it full
E3 = ["drafter=eagle3", "drafter.ttt_steps=3", "drafter.draft_vocab_size=1024"]
# DFlash as experiment=dflash_toy builds it (its data aside): 1 draft layer on layers 1-3, blocks of 8
DF = ["drafter=dflash", "drafter.block_size=8", "drafter.num_layers=1", "drafter.layers=[1,2,3]",
      "drafter.num_anchors=32", "drafter.draft_vocab_size=1024"]
# name -> (overrides, steps)
ROWS = {
    "dflash": (DF, 300),
    f"dflash_window{WINDOW}": ([*DF, f"drafter.sliding_window={WINDOW}"], 300),
    "eagle3": (E3, 400),
    f"eagle3_window{WINDOW}": ([*E3, f"drafter.sliding_window={WINDOW}"], 400),
}
TOY_TARGET = ["target.toy.steps=300", "target.toy.autocast_bf16=false"]
PRESETS = {
    "toy": {"common": TOY_TARGET, "steps_scale": 1.0, "lengths": [64, 128, 256], "num_prompts": 10},
    # the tiny target's 2 layers and 512 ids: each drafter's default layers, the whole vocabulary
    "tiny": {"common": ["target=tiny", "drafter.layers=null", "drafter.draft_vocab_size=null"], "steps_scale": 0.02,
             "lengths": [48, 96, 128], "num_prompts": 2},
}
WINDOWS = "data.max_length=64"  # the training windows (and a data length the tiny target's 128 positions accept)
# float32: bf16 autocast is emulated, and slow, on a CPU without native bf16
TRAIN = [WINDOWS, "trainer.bf16=false", "eval.enabled=false", "trainer.resume=never", "trainer.ckpt_every=100000"]
MAX_NEW_TOKENS = 32


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="toy")
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    parser.add_argument("--work", default="runs/bench_context_length", help="run dirs and training logs")
    parser.add_argument("--out", default=None, help="JSON path (default scripts/results/"
                        "bench_context_length_<preset>_cpu.json)")
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    parser.add_argument("--train-only", action="store_true", help="train the --rows not yet trained, measure nothing "
                        "(several such processes may share one --out)")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    out = Path(args.out or ROOT / "scripts" / "results" / f"bench_context_length_{args.preset}_cpu.json")
    results = json.loads(out.read_text()) if out.exists() else {}
    if args.table:
        print(render_context_length(results))
        return
    from distill.atomic import write_text_atomically
    from train.checkpoint import fresh_scratch_run

    work = (ROOT / args.work / args.preset).resolve()
    work.mkdir(parents=True, exist_ok=True)
    results.setdefault("rows", {})
    for name in args.rows:
        if name in results["rows"]:
            print(f"{name}: trained already (in {out})", flush=True)
            continue
        overrides, steps = ROWS[name]
        steps = max(2, round(steps * preset["steps_scale"]))
        run_dir = work / name
        fresh_scratch_run(run_dir)  # a row cut short is not in results; trainer.resume=never needs it empty
        cost = train_row([*overrides, *preset["common"], *TRAIN, f"trainer.steps={steps}"], run_dir,
                         work / f"{name}.log")
        saved = json.loads((run_dir / "drafter" / "config.json").read_text())
        # read again before writing: rows may train in parallel (one --train-only process per row, one --out)
        results = json.loads(out.read_text()) if out.exists() else {"rows": {}}
        results["rows"][name] = {"overrides": overrides, "steps": steps, **cost,
                                 "sliding_window": saved["drafter"].get("sliding_window"),
                                 "final": saved.get("training", {}).get("final", {})}
        write_text_atomically(out, json.dumps(results, indent=2))
        print(f"{name}: {steps} steps, {cost['cpu_s']:.0f} CPU s ({cost['wall_s']:.0f} s wall)", flush=True)
    if not args.train_only:
        measure(results, preset, work)
        write_text_atomically(out, json.dumps(results, indent=2))
        print(render_context_length(results))
    print(f"wrote {out}")


def measure(results: dict, preset: dict, work: Path) -> None:
    """Every trained row's drafter, side by side with plain decoding, at each context length."""
    import torch
    from hydra import compose, initialize_config_dir

    from distill.teacher import load_teacher
    from eval.context_lengths import context_length_sweep
    from eval.report import machine_info
    from eval.run import build_decoder
    from heads.saved import load_drafter
    from train.config import load_config, register_configs

    torch.set_num_threads(1)
    register_configs()
    settings = [*preset["common"], WINDOWS, f"eval.context_lengths={preset['lengths']}".replace(" ", ""),
                f"eval.max_new_tokens={MAX_NEW_TOKENS}", f"eval.num_prompts={preset['num_prompts']}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=settings))
    teacher = load_teacher(cfg.target, device="cpu")
    drafters = {name: load_drafter(work / name / "drafter", teacher).float() for name in results["rows"]}
    depth = {name: cfg.eval.num_draft for name in drafters}
    print(f"measuring {', '.join(drafters)} at context lengths {preset['lengths']}", flush=True)
    results["sweep"] = context_length_sweep(build_decoder(teacher, cfg.decoder), drafters, depth, teacher.tokenizer,
                                            cfg.eval, cfg.decoder.seed)
    results.update(machine=machine_info(), settings={"common": preset["common"], "train": TRAIN, "eval": settings,
                                                     "num_draft": cfg.eval.num_draft, "proposal_dtype": "float32",
                                                     "decoder": "greedy"})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
