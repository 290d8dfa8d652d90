"""The step decoder's ways of running side by side, one process, the same prompts: CUDA graphs over eager steps,
graphs over compiled steps (``decoder.compile=true``), and HF ``generate()`` with its compiled static cache.

    python scripts/bench_decode_modes.py --preset gpu --target-steps 150 --eagle1-dir RUN --out modes.json
    python scripts/bench_decode_modes.py --preset tiny --modes eager,compiled   # CPU: checks the script end to end

Unlike ``bench_decode.py`` it runs no cost model, no dtype timing and no baseline drafter, so a compiled run pays
for only the buckets a decode uses (plain, EAGLE-1's tree verification and its draft step): it fits a short GPU
lease. The first prompt warms every bucket up (compiles, then records); the rest are timed. Per mode: plain and
EAGLE-1 tokens/s, EAGLE-1's τ and speedup over that mode's plain, whether each output equals that mode's plain
decoding (bf16 may differ where two logits tie within rounding), and ``vs_eager``: each of the mode's outputs against
plain decoding through eager steps (no compile, no CUDA graphs; decoded once, before the modes), with the first
differing position and the target's logit gap there (``eval.mismatch``). The JSON is written after each mode.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import PRESETS, compose_cfg, load_cfg, trained  # noqa: E402

log = logging.getLogger("bench_decode_modes")
MODES = {"eager": {"cuda_graphs": "off", "compile": "off"}, "graphs": {"compile": "off"}, "compiled": {"compile": "on"}}


def eager_reference(teacher, prompts, max_new: int) -> tuple[list[list[int]], float]:
    """Plain decoding of the timed prompts through eager steps: (new tokens per prompt, seconds)."""
    from inference.decoder import Decoder, DecoderConfig

    decoder = Decoder(teacher, DecoderConfig(cuda_graphs="off", compile="off"))
    t0 = time.perf_counter()
    out = [decoder.plain(p, max_new).new_tokens for p in prompts]
    return out, time.perf_counter() - t0


def decode_mode(teacher, drafter, prompts, max_new: int, num_draft: int, settings: dict,
                reference: list[list[int]] | None = None) -> dict:
    from eval.mismatch import against_reference
    from inference.decoder import Decoder, DecoderConfig

    decoder = Decoder(teacher, DecoderConfig(**settings))
    t0 = time.perf_counter()
    decoder.plain(prompts[0], max_new)
    log.info("%s: plain warmed up in %.1fs", settings, time.perf_counter() - t0)
    if drafter is not None:
        decoder.speculative(drafter, prompts[0], max_new, num_draft)
        decoder.speculative(drafter, prompts[0], max_new, num_draft)  # a bucket is recorded at its second use
    warm = time.perf_counter() - t0
    plain_s = spec_s = 0.0
    tokens = spec_tokens = same = forwards = 0
    outputs = {"plain": [], **({"eagle1": []} if drafter is not None else {})}
    for p in prompts[1:]:
        ref = decoder.plain(p, max_new)
        plain_s, tokens = plain_s + ref.seconds, tokens + len(ref.new_tokens)
        outputs["plain"].append(ref.new_tokens)
        if drafter is not None:
            gen = decoder.speculative(drafter, p, max_new, num_draft)
            spec_s, spec_tokens = spec_s + gen.seconds, spec_tokens + len(gen.new_tokens)
            forwards += gen.stats.forwards
            same += gen.new_tokens == ref.new_tokens
            outputs["eagle1"].append(gen.new_tokens)
    out = {"settings": settings, "warmup_seconds": warm, "plain_tokens_per_s": tokens / plain_s,
           "timed_prompts": len(prompts) - 1, "steps": decoder.batch.describe()}
    if drafter is not None:
        spec_tps = spec_tokens / spec_s
        out.update(eagle1_tokens_per_s=spec_tps, eagle1_speedup=spec_tps / out["plain_tokens_per_s"],
                   eagle1_tau=spec_tokens / max(forwards, 1), eagle1_identical_prompts=same)
    if reference is not None:
        out["vs_eager"] = against_reference(teacher.model, prompts[1:], reference, outputs)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--target-steps", type=int, default=None)
    ap.add_argument("--eagle1-dir", default=None, help="train EAGLE-1 into this run dir, or reuse the drafter there")
    ap.add_argument("--plain-only", action="store_true", help="no EAGLE-1: plain decoding in each mode only")
    ap.add_argument("--modes", default="graphs,hf_static,compiled", help=f"comma-separated, in order: "
                    f"{','.join(MODES)},hf_static")
    ap.add_argument("--prompts", type=int, default=6, help="prompts: the first warms up, the rest are timed")
    ap.add_argument("--out", default="bench_decode_modes.json")
    ap.add_argument("--no-eager-check", action="store_true", help="skip the eager reference (vs_eager)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    preset = PRESETS[args.preset]
    if args.target_steps is not None:
        preset = {**preset, "target_toy": {**preset.get("target_toy", {}), "steps": args.target_steps}}
    cfg, _ = load_cfg(preset, args.overrides, preset["medusa_steps"])

    from distill.teacher import load_teacher
    from eval.baselines import hf_generate_static
    from eval.report import machine_info
    from eval.run import eval_prompts
    from inference.sampling import GREEDY
    from train.engine import resolve_device

    device = resolve_device(cfg.trainer.device)
    teacher = load_teacher(cfg.target, device=device)
    drafter = None
    if not args.plain_only:
        eagle_cfg = compose_cfg(preset, args.overrides, "eagle1", preset["eagle_steps"])
        drafter, _ = trained(eagle_cfg, args.eagle1_dir, teacher, "eagle1")
        drafter.to(next(teacher.model.parameters()).dtype)
    ids, _ = eval_prompts(cfg.eval, teacher.tokenizer)
    prompts = [torch.tensor([list(p)], dtype=torch.long) for p in ids[: args.prompts]]
    max_new, num_draft = cfg.eval.max_new_tokens, cfg.eval.num_draft
    out = {"preset": args.preset, "target": teacher.identity(), "dtype": cfg.target.dtype, "device": str(device),
           "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None, "torch": torch.__version__,
           "max_new_tokens": max_new, "num_draft": num_draft, "machine": machine_info(), "modes": {}}
    path = Path(args.out)

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2, default=str))
        os.replace(tmp, path)

    modes = [m for m in args.modes.split(",") if m]
    reference = None
    if not args.no_eager_check and set(modes) - {"hf_static"}:
        reference, seconds = eager_reference(teacher, prompts[1:], max_new)
        out["eager_plain"] = {"seconds": seconds, "new_tokens": sum(map(len, reference))}
        log.info("eager plain decoding of the %d timed prompts (the reference): %.1fs", len(reference), seconds)
    for mode in modes:
        t0 = time.perf_counter()
        try:
            if mode == "hf_static":
                hf_generate_static(teacher, prompts[0], max_new, GREEDY, None)  # compiles
                runs = [hf_generate_static(teacher, p, max_new, GREEDY, None) for p in prompts[1:]]
                tps = sum(len(r["new_tokens"]) for r in runs) / sum(r["seconds"] for r in runs)
                out["modes"][mode] = {"plain_tokens_per_s": tps}
            else:
                out["modes"][mode] = decode_mode(teacher, drafter, prompts, max_new, num_draft, MODES[mode],
                                                 reference)
        except Exception as exc:  # keep what the other modes measured; the failure is part of the result
            log.exception("mode %s failed", mode)
            out["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        out["modes"][mode]["seconds"] = time.perf_counter() - t0
        save()
        print(mode, {k: v for k, v in out["modes"][mode].items() if k != "settings"}, flush=True)
    static = out["modes"].get("hf_static", {}).get("plain_tokens_per_s")
    for mode, row in out["modes"].items():
        if static and "plain_tokens_per_s" in row and mode != "hf_static":
            row["plain_over_hf_static"] = row["plain_tokens_per_s"] / static
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
