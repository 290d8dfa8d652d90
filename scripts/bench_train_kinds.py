"""Training speed per drafter kind at a real shape: tokens/s, TFLOP/s, MFU, peak memory, the teacher's share of the
step and the data wait, eager vs compiled (``trainer.compile``), through the real training loop (``train.loop``).

    python scripts/bench_train_kinds.py --preset 8b --kinds eagle3,dflash --modes eager,compiled   # one GPU
    python scripts/bench_train_kinds.py --preset toy --threads 1                                   # CPU table
    python scripts/bench_train_kinds.py --preset tiny                                               # seconds

The target is built from a config with random weights (no download): ``8b`` is Llama-3.1-8B's shape (vocabulary
128,256) in bf16 at sequence 2048; ``toy`` the embedded toy target's shape at 256; ``tiny`` a 2-layer model at 128.
Rows are random token ids, packed (every position real and trained): throughput does not depend on what the
tokens say. Each (kind, mode) trains ``--steps`` steps with the largest micro-batch of ``--micro-batches`` that fits
(an out-of-memory error retries the next smaller one); the figures are medians of the loop's logged windows after
the first (which holds compilation), i.e. what ``perf/*`` reports to a user. The JSON is rewritten after every run,
so a run cut at a deadline keeps what it finished.

Output (``--out``): machine, settings and, per kind and mode, micro_batch, tokens_per_s, tflops, mfu, peak_mem_gb,
teacher_share (teacher seconds / step seconds in the logged steps), data_wait_s, compile figures, first-step
seconds; per kind ``compiled_vs_eager`` (tokens/s ratio).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
# --code DIR: import the project from another checkout (the side-by-side runs of an older commit)
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv else ROOT
sys.path.insert(0, str(CODE))

from distill.data import TokenBlockDataset, collate  # noqa: E402
from distill.losses import forward_kl  # noqa: E402
from distill.teacher import TargetConfig, Teacher  # noqa: E402
from eval.report import machine_info  # noqa: E402
from heads.base import build_drafter  # noqa: E402
from train.config import Config  # noqa: E402
from train.engine import TrainerConfig, build_engine, world_from_env  # noqa: E402
from train.logger import LoggerConfig, MetricsLogger  # noqa: E402
from train.loop import train  # noqa: E402

LLAMA_31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                   tie_word_embeddings=False)
PRESETS = {
    # Llama-3.1-8B's shape; EAGLE-3 as SpecForge trains it for 8B targets (TTT 7, a 32k draft vocabulary)
    "8b": {"target": LLAMA_31_8B, "seq": 2048, "dtype": "bfloat16", "bf16": True, "steps": 12, "log_every": 4,
           "micro_batches": [8, 4, 2, 1], "draft_vocab": 32000},
    "toy": {"target": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256),
            "seq": 256, "dtype": "float32", "bf16": False, "steps": 30, "log_every": 5, "micro_batches": [8],
            "draft_vocab": 3072},
    "tiny": {"target": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=128),
             "seq": 128, "dtype": "float32", "bf16": False, "steps": 8, "log_every": 2, "micro_batches": [4],
             "draft_vocab": 256},
}
KINDS = ("eagle3", "eagle1", "dflash", "peagle", "medusa", "draft_model")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_target(spec: dict, dtype: torch.dtype, device: torch.device) -> Teacher:
    """A Llama with ``spec``'s shape and random weights, made on the device directly (an 8B model's init on a CPU
    would take minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**spec)
    torch.manual_seed(0)  # the same target in every process (single vs FSDP runs compare losses)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        # buffers are left uninitialised by to_empty: the rotary tables are computed at init, so each rotary module is
        # made again (on the CPU: cheap) and its buffers copied over
        for module in model.modules():
            if hasattr(module, "inv_freq"):
                fresh = type(module)(config)
                for name, buf in fresh.named_buffers():
                    module.get_buffer(name).copy_(buf)
        bad = [n for n, b in model.named_buffers() if b.is_floating_point() and not torch.isfinite(b).all()]
        if bad:
            raise RuntimeError(f"buffers left uninitialised after building the target on {device}: {bad}")
    model.eval().requires_grad_(False)
    return Teacher(model, tokenizer=None, name=f"random-llama-{spec['hidden_size']}")


def drafter_node(kind: str, preset: dict) -> dict:
    """``conf/drafter/<kind>.yaml`` as training composes it, with the preset's draft vocabulary."""
    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "drafter" / f"{kind}.yaml"))
    if "draft_vocab_size" in node and node["draft_vocab_size"] is not None:
        node["draft_vocab_size"] = preset["draft_vocab"]
    if kind == "dflash":  # anchors per row: at most the row's positions that can start a block
        node["num_anchors"] = min(node["num_anchors"], preset["seq"] // 4)
    return node


def rows(num: int, seq: int, vocab: int) -> TokenBlockDataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (num, seq), generator=g)
    ones = torch.ones(num, seq, dtype=torch.long)
    return TokenBlockDataset(ids, ones, ones.bool())


def run_one(teacher: Teacher, kind: str, mode: str, micro_batch: int, args, preset: dict, work: Path) -> dict:
    node = drafter_node(kind, preset)
    steps, log_every = args.steps or preset["steps"], preset["log_every"]
    known = {f.name for f in fields(TrainerConfig)}  # an older checkout (--code) may lack the newer settings
    extra = {k: v for k, v in (("peak_tflops", args.peak_tflops), ("compile", "on" if mode == "compiled" else "off"),
                                ("compile_backend", args.compile_backend)) if k in known}
    trainer = TrainerConfig(engine=args.engine, device=str(teacher.device), steps=steps, micro_batch_size=micro_batch,
                            lr=1e-4, warmup_steps=1, log_every=log_every, ckpt_every=10**9, keep_last=1,
                            resume="never", select="last", eval_every=0, bf16=preset["bf16"], **extra)
    cfg = Config(trainer=trainer, drafter=node, target=TargetConfig(source="hf", name=teacher.name), seed=0,
                 logger=LoggerConfig(name="none"))
    torch.manual_seed(0)
    drafter = build_drafter(node, teacher)
    drafter.bind_target(teacher, initialize=True)
    data = rows(micro_batch * (steps + 1), preset["seq"], teacher.vocab_size)
    drafter.prepare(data)
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"{kind}-{mode}-"))
    logger = MetricsLogger(run_dir, cfg.logger, asdict(cfg), resumed=False)
    if teacher.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        engine = build_engine(trainer)
        train(cfg, teacher, drafter, data, collate, functools.partial(forward_kl), engine, run_dir, logger)
    finally:
        logger.close()
    engine.close()
    wall = time.perf_counter() - start
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in logged if "perf/tokens_per_s" in r]
    later = logged[1:] or logged  # the first window holds start-up (and compilation)
    med = lambda key: statistics.median(r[key] for r in later) if all(r.get(key) is not None for r in later) else None
    out = {"engine": args.engine, "micro_batch": micro_batch, "steps": steps, "wall_s": wall,
           "losses": [r["train/loss"] for r in logged], "tokens_per_s": med("perf/tokens_per_s"),
           "tflops": med("perf/tflops"), "mfu": med("perf/mfu"), "data_wait_s": med("perf/data_wait_s"),
           "peak_mem_gb": max(r["perf/peak_mem_gb"] for r in logged),
           "teacher_share": statistics.median(r["perf/teacher_s"] / max(r["perf/teacher_s"] + r["perf/drafter_s"], 1e-9)
                                              for r in later)}
    out.update({k: v for k, v in logged[-1].items() if k.startswith("compile/") or k == "perf/teacher_flops_share"})
    del drafter
    return out


def fit(teacher, kind, mode, args, preset, work) -> dict:
    """``run_one`` at the largest micro-batch that fits (an out-of-memory error tries the next smaller one)."""
    sizes = [int(s) for s in args.micro_batches.split(",")] if args.micro_batches else preset["micro_batches"]
    errors = []
    for size in sizes:
        try:
            return run_one(teacher, kind, mode, size, args, preset, work)
        except torch.OutOfMemoryError as e:
            errors.append(f"micro_batch {size}: out of memory ({str(e).splitlines()[0][:120]})")
            torch.cuda.empty_cache()
    return {"error": "; ".join(errors)}


def side_by_side(args) -> None:
    """Eager tokens/s of this checkout and ``--base`` (an older one) per kind, in alternating subprocesses (base,
    this, base, this, ...), each kind ``--rounds`` times: the ratio of their medians, measured side by side."""
    result = {"machine": machine_info(), "settings": vars(args), "kinds": {}}
    out_path = Path(args.out)
    for kind in args.kinds.split(","):
        runs = {"base": [], "this": []}
        for _ in range(args.rounds):
            for name, code in (("base", args.base), ("this", str(ROOT))):
                with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--code", code, "--preset", args.preset,
                           "--kinds", kind, "--modes", "eager", "--out", tmp.name]
                    cmd += ["--threads", str(args.threads)] if args.threads else []
                    cmd += ["--steps", str(args.steps)] if args.steps else []
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    run = json.loads(Path(tmp.name).read_text())["runs"][kind]["eager"]
                    if run.get("tokens_per_s") is None:
                        raise SystemExit(f"{kind} on {code}: no tokens/s ({run.get('error', 'no logged window')})")
                    runs[name].append(run["tokens_per_s"])
        med = {k: statistics.median(v) for k, v in runs.items()}
        result["kinds"][kind] = {"base_tokens_per_s": runs["base"], "this_tokens_per_s": runs["this"],
                                 "base_median": med["base"], "this_median": med["this"],
                                 "ratio": med["this"] / med["base"]}
        print(f"{kind}: {json.dumps(result['kinds'][kind])}", flush=True)
        out_path.write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--micro-batches", default=None, help="sizes to try, largest first (default: the preset's)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak (default: its table)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile-backend", default=None, help="trainer.compile_backend (default: inductor)")
    ap.add_argument("--engine", default="single", help="trainer.engine (fsdp / ddp: launch under torchrun)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--code", default=None, help="import the project from this checkout instead")
    ap.add_argument("--base", default=None, help="side by side: eager tokens/s of this checkout against BASE's")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.base:
        args.out = args.out or str(ROOT / "scripts" / "results" / f"bench_train_side_by_side_{args.preset}_cpu.json")
        return side_by_side(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per rank (torchrun's LOCAL_RANK)
        device = torch.device("cuda", world_from_env()[2])
        torch.cuda.set_device(device)
    out_path = Path(args.out or ROOT / "scripts" / "results" / f"bench_train_kinds_{args.preset}_{device.type}.json")
    main_rank = world_from_env()[0] == 0
    result = {"machine": machine_info(), "settings": {**vars(args), "preset_values": preset}, "runs": {}}
    if device.type == "cuda":
        result["machine"]["gpu"] = torch.cuda.get_device_name(device)
    teacher = build_target(preset["target"], DTYPES[preset["dtype"]], device)
    with tempfile.TemporaryDirectory() as work:
        for kind in args.kinds.split(","):
            runs = result["runs"].setdefault(kind, {})
            for mode in args.modes.split(","):
                print(f"== {kind} {mode}", flush=True)
                try:
                    runs[mode] = fit(teacher, kind, mode, args, preset, Path(work))
                except Exception as e:  # one kind failing must not lose the others' figures
                    runs[mode] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
                print(f"   {json.dumps(runs[mode])}", flush=True)
                eager, compiled = runs.get("eager", {}), runs.get("compiled", {})
                if eager.get("tokens_per_s") and compiled.get("tokens_per_s"):
                    runs["compiled_vs_eager"] = compiled["tokens_per_s"] / eager["tokens_per_s"]
                if main_rank:
                    out_path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = out_path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(result, indent=1))
                    tmp.replace(out_path)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
