"""Regeneration throughput: tokens/s of each ``regenerate.engine`` (our batched decoder, HF ``generate()``) on the
same prompts at the same batch size, greedy.

    python scripts/bench_regenerate.py                                   # the tiny toy target on the CPU
    python scripts/bench_regenerate.py --target toy --batch-sizes 8 32   # the 4M toy target (built once, ~11 min)
    python scripts/bench_regenerate.py --device cuda --target toy --batch-sizes 32 64 128

Per batch size and engine: one untimed warm-up batch, then ``--batches`` batches of prompts cut from the training
rows as ``python -m distill.regenerate`` cuts them, each answered with up to ``--max-new-tokens`` tokens (the answers
stop at EOS, so both engines are timed on the tokens they actually produce). Reports new tokens/s and how many
answers are token-identical between the engines (greedy: they differ only where near-tied logits round apart).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.regenerate import prompts_from_data  # noqa: E402
from distill.regenerate.engines import build_engine  # noqa: E402
from distill.teacher import load_teacher  # noqa: E402
from eval.report import machine_info  # noqa: E402
from inference.sampling import SamplingConfig  # noqa: E402
from train.config import load_config, register_configs  # noqa: E402

ENGINES = ("batched", "hf")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="tiny", help="a conf/target preset (default: tiny)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--batches", type=int, default=2, help="timed batches per engine and batch size")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_regenerate_toy_cpu.json"))
    return p.parse_args(argv)


def time_engine(engine, prompts, batch_size: int, batches: int, max_new: int, device: str) -> tuple[float, list]:
    """(new tokens/s over the timed batches, their answers); the first batch is a warm-up."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    engine.generate([p.ids for p in prompts[:batch_size]], max_new, 0)
    answers, seconds = [], 0.0
    for k in range(1, batches + 1):
        batch = [p.ids for p in prompts[k * batch_size: (k + 1) * batch_size]]
        sync()
        start = time.perf_counter()
        answers += engine.generate(batch, max_new, k)
        sync()
        seconds += time.perf_counter() - start
    return sum(len(a) for a in answers) / seconds, answers


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    register_configs()
    overrides = [f"target={args.target}", f"trainer.device={args.device}", "data.max_length=128",
                 "data.corpus_max_bytes=200000"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = load_config(compose(config_name="config", overrides=overrides))
    teacher = load_teacher(cfg.target, device=args.device)
    need = (args.batches + 1) * max(args.batch_sizes)
    prompts = prompts_from_data(cfg.data, teacher.tokenizer, args.prompt_tokens, need)
    eos = teacher.tokenizer.eos_token_id
    results = []
    for batch_size in args.batch_sizes:
        row, answers = {"batch_size": batch_size}, {}
        for name in ENGINES:
            engine = build_engine(name, teacher, eos, SamplingConfig())
            row[f"{name}_tokens_per_s"], answers[name] = time_engine(engine, prompts, batch_size, args.batches,
                                                                   args.max_new_tokens, args.device)
        row["identical_answers"] = sum(a == b for a, b in zip(answers["batched"], answers["hf"]))
        row["answers"] = len(answers["batched"])
        row["batched_over_hf"] = row["batched_tokens_per_s"] / row["hf_tokens_per_s"]
        print(json.dumps(row), flush=True)
        results.append(row)
    report = {"machine": machine_info(), "device": args.device, "threads": args.threads,
              "target": cfg.target.name, "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "command": "python scripts/bench_regenerate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
