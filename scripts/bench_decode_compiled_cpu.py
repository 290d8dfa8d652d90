"""Batch-8 speculative decoding on a CPU with the decoder's steps uncompiled and compiled, every drafter kind's
static draft step vmapped over the bucket's rows: what the vmap costs uncompiled, and whether compiling pays there.

    python scripts/bench_decode_compiled_cpu.py --kinds eagle1 draft_model dflash

The tests' tiny target (``tests.drafters.tiny_llama`` at init 0.2, 4 layers, hidden 32, vocabulary 128), the seeded
test drafters (``tests.drafters.build``), 8 prompts decoded together, greedy, γ = 4, 48 new tokens each, 1 thread.
Per kind and ``--backends`` entry (``off``: uncompiled; else ``torch.compile``'s backend for every step the decoder
runs, verify and draft): one warm-up decode (compilation included, its seconds reported), then ``--repeats`` timed
decodes (the decoder's own timer); the median tokens/s, and whether every row matched plain greedy decoding. The JSON
is written after every kind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from distill.teacher import Teacher  # noqa: E402
from inference.batch_decoder import BucketDecoder  # noqa: E402
from tests.drafters import build, tiny_llama  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["eagle1", "draft_model", "dflash"])
    ap.add_argument("--backends", nargs="+", default=["off", "inductor"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "results" / "bench_decode_compiled_tiny_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="There is a performance drop")
    teacher = Teacher(tiny_llama(initializer_range=0.2, num_hidden_layers=4), tokenizer=None, name="tiny-llama-4")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (9, 14, 20, 26, 31, 12, 17, 40)]
    reference = BucketDecoder(teacher, cuda_graphs="off", compile="off").plain(prompts, 48)
    want = [g.new_tokens for g in reference.generations]
    result = {"settings": {"batch": len(prompts), "new": 48, "gamma": 4, "repeats": args.repeats},
              "machine": {"cpu_count": os.cpu_count(), "threads": 1, "torch": torch.__version__,
                          "platform": platform.platform()}, "runs": {}}
    for kind in args.kinds:
        drafter = build(kind, teacher)
        for backend in args.backends:
            kw = {"compile": "off"} if backend == "off" else {"compile": "on", "compile_backend": backend}
            decoder = BucketDecoder(teacher, cuda_graphs="off", **kw)
            start = time.perf_counter()
            decoder.speculative(drafter, prompts, 48, 4)
            warm = time.perf_counter() - start
            rates, same = [], True
            for _ in range(args.repeats):
                out = decoder.speculative(drafter, prompts, 48, 4)
                rates.append(sum(len(g.new_tokens) for g in out.generations) / out.seconds)
                same &= [g.new_tokens for g in out.generations] == want
            result["runs"][f"{kind}[{backend}]"] = {"kind": kind, "backend": backend, "warm_up_s": round(warm, 1),
                                                    "tokens_per_s": round(statistics.median(rates), 1),
                                                    "identical": same}
            print(kind, backend, result["runs"][f"{kind}[{backend}]"], flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            tmp.replace(args.out)


if __name__ == "__main__":
    main()
