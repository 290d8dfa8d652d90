"""Regeneration throughput: tokens/s of each ``regenerate.engine`` (``auto``, the default, against HF ``generate()``
and our batched decoder) on the same prompts at the same batch size, greedy.

    python scripts/bench_regenerate.py                                   # the tiny toy target on the CPU
    python scripts/bench_regenerate.py --target toy --batch-sizes 8 32   # the 4M toy target (built once, ~11 min)
    python scripts/bench_regenerate.py --device cuda --target toy --batch-sizes 32 64 128

Per batch size: one untimed warm-up batch per engine, then ``--batches`` batches of prompts cut from the training
rows as ``python -m distill.regenerate`` cuts them, each answered by every engine in turn (the order rotating per
batch, so drift on a shared machine falls on all of them), with up to ``--max-new-tokens`` tokens (the answers stop
at EOS, so every engine is timed on the tokens it actually produces). ``auto`` is the engine it resolves to on the
device, timed once under that engine's name (timing one engine twice would only measure the machine's noise). Reports
new tokens/s, each engine over HF ``generate()``, the engine ``auto`` resolved to, and how many answers are
token-identical to HF's (greedy: they differ only where near-tied logits round apart).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distill.regenerate import prompts_from_data  # noqa: E402
from distill.regenerate.engines import build_engine, loaded_by_name, resolve_engine  # noqa: E402
from distill.teacher import load_teacher  # noqa: E402
from eval.report import machine_info  # noqa: E402
from inference.sampling import SamplingConfig  # noqa: E402
from train.config import load_config, register_configs  # noqa: E402

ENGINES = ("auto", "hf", "batched", "vllm")  # vllm: where it is installed (make vllm-check's .venv-vllm)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="tiny", help="a conf/target preset (default: tiny)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    p.add_argument("--batches", type=int, default=2, help="timed batches per engine and batch size")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--engines", nargs="+", default=None, choices=ENGINES,
                   help="hf is always among them; default: all, vllm where it is installed")
    p.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_regenerate_toy_cpu.json"))
    args = p.parse_args(argv)
    if args.engines is None:
        args.engines = [e for e in ENGINES if e != "vllm" or importlib.util.find_spec("vllm") is not None]
    return args


def time_engines(engines: dict, prompts, batch_size: int, batches: int, max_new: int, device: str) -> dict:
    """{engine: (new tokens/s over the timed batches, their answers)}; the first batch is a warm-up, then each timed
    batch is answered by every engine in turn, starting one later each batch."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for engine in engines.values():
        engine.generate([p.ids for p in prompts[:batch_size]], max_new, 0)
    answers = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    names = list(engines)
    for k in range(1, batches + 1):
        batch = [p.ids for p in prompts[k * batch_size: (k + 1) * batch_size]]
        for name in names[k % len(names):] + names[: k % len(names)]:
            sync()
            start = time.perf_counter()
            answers[name] += engines[name].generate(batch, max_new, k)
            sync()
            seconds[name] += time.perf_counter() - start
    return {name: (sum(len(a) for a in answers[name]) / seconds[name], answers[name]) for name in engines}


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
    auto = resolve_engine("auto", teacher.device, named=loaded_by_name(teacher))
    # Each engine that runs is timed once: auto is the engine it resolves to, whose figures it reports.
    names = list(dict.fromkeys(["hf", *(auto if n == "auto" else n for n in args.engines)]))
    results = []
    for batch_size in args.batch_sizes:
        engines = {name: build_engine(name, teacher, eos, SamplingConfig()) for name in names}
        timed = time_engines(engines, prompts, batch_size, args.batches, args.max_new_tokens, args.device)
        for engine in engines.values():  # a vLLM engine holds its cache until closed
            getattr(engine, "close", lambda: None)()
        hf_tps, hf_answers = timed["hf"]
        row = {"batch_size": batch_size, "answers": len(hf_answers)}
        for name, (tps, answers) in timed.items():
            row[f"{name}_tokens_per_s"] = tps
            if name != "hf":
                row[f"{name}_over_hf"] = tps / hf_tps
                row[f"{name}_identical_answers"] = sum(a == b for a, b in zip(answers, hf_answers))
        if "auto" in args.engines:
            row["auto_tokens_per_s"] = row[f"{auto}_tokens_per_s"]
            row["auto_over_hf"] = row["auto_tokens_per_s"] / hf_tps
            row["auto_identical_answers"] = row.get(f"{auto}_identical_answers", len(hf_answers))
        print(json.dumps(row), flush=True)
        results.append(row)
    report = {"machine": machine_info(), "device": args.device, "threads": args.threads,
              "target": cfg.target.name, "auto_engine": auto, "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "command": "python scripts/bench_regenerate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
