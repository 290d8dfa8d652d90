"""Decoding speed of every drafter kind in this checkout against another (``--base``, the code before a change), side
by side in one run: batch 1 and batch 8 on the tests' tiny target, 1 thread.

    python scripts/bench_decode_base.py --base ../before --rounds 3

Each checkout runs in its own worker process (``PYTHONPATH`` pointing at it), which builds the same tiny target
(``tests.drafters.tiny_llama`` at init 0.2: 4 layers, as EAGLE-3 and P-EAGLE read layers 1..3; hidden 32,
vocabulary 128) and the same seeded drafters
(``tests.drafters.build``: every kind's test-sized drafter, its weights moved off their init, so drafts are accepted
and rejected) and decodes the same prompts, greedy, γ = 4: at batch 1 through ``Decoder.speculative`` (one prompt
at a time), at batch 8 through ``Decoder.batch.speculative`` (all prompts at once). Per round and method each worker
decodes in turn, the order alternating. Reported per method, batch and checkout: tokens/s (the decoders' own
timers, prefill included), τ, and whether every output matched plain greedy decoding; the medians over rounds and
the ratio of the medians (this / base). A tiny target makes every step's host work count (a 4-layer forward at
hidden 32 is a fraction of a millisecond): the ratios bound what a change costs per step, not what a user's model would see.
Results are written after every round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("plain", "lookup", "medusa", "eagle1", "eagle3", "draft_model", "dflash", "dspark", "dflash2", "peagle")

WORKER = r"""
import json, sys
import torch

spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from heads.base import build_drafter
from inference.decoder import Decoder
from distill.teacher import Teacher
from tests.drafters import NODES, build, perturbed, tiny_llama

teacher = Teacher(tiny_llama(initializer_range=0.2, num_hidden_layers=4), tokenizer=None, name="tiny-llama-4")
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 128, (1, n), generator=gen) for n in spec["lengths"]]
prompts = [torch.cat([p, p[:, :6]], 1) for p in prompts]  # something for lookup to find
new, gamma = spec["new"], spec["gamma"]
decoder = Decoder(teacher)
drafters = {}
for kind in spec["kinds"]:
    if kind == "lookup":
        drafters[kind] = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    elif kind == "peagle":
        torch.manual_seed(5)
        drafters[kind] = build_drafter(NODES["peagle"], teacher)
        drafters[kind].bind_target(teacher, initialize=True)
        drafters[kind] = perturbed(drafters[kind], 5, 0.3)
    elif kind != "plain":
        drafters[kind] = build(kind, teacher)
reference = [decoder.plain(p, new).new_tokens for p in prompts]

def run(kind, batch):
    drafter = drafters.get(kind)
    if batch == 1:
        gens = [decoder.plain(p, new) if drafter is None else decoder.speculative(drafter, p, new, gamma)
                for p in prompts]
        seconds = sum(g.seconds for g in gens)
    else:
        rows = [p[0] for p in prompts]
        out = decoder.batch.plain(rows, new) if drafter is None else decoder.batch.speculative(drafter, rows, new,
                                                                                               gamma)
        gens, seconds = out.generations, out.seconds
    tokens = sum(len(g.new_tokens) for g in gens)
    forwards = sum(sum(g.nodes_per_forward.values()) for g in gens) if drafter is not None else tokens
    return {"tokens_per_s": tokens / seconds, "tau": tokens / max(forwards, 1),
            "identical": [g.new_tokens for g in gens] == reference}

for kind in spec["kinds"]:  # warm-up: every (kind, batch) once
    for batch in spec["batches"]:
        run(kind, batch)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    kind, batch = json.loads(line)
    print(json.dumps(run(kind, batch)), flush=True)
"""


def commit_of(code: Path) -> str:
    """The checkout's commit, with ``+changes`` when its tracked files differ from it; ``unknown`` outside git."""
    run = lambda *cmd: subprocess.run(["git", "-C", str(code), *cmd], capture_output=True, text=True)
    head = run("rev-parse", "--short", "HEAD")
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+changes" if run("diff", "--quiet", "HEAD").returncode else "")


def start(code: Path, spec: dict, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": str(spec["threads"])}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(spec)], cwd=code, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"))
    return proc


def ask(proc: subprocess.Popen, request) -> dict:
    if request is not None:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker stopped (exit {proc.wait()}); see its log under --work")
    return json.loads(line)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the checkout to compare this one with")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--work", type=Path, default=Path("/tmp") / "bench_decode_base", help="worker logs")
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "results" / "bench_decode_base_tiny_cpu.json")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    spec = {"threads": args.threads, "kinds": args.kinds, "batches": args.batches, "new": args.new, "gamma": 4,
            "lengths": [9, 14, 20, 26, 31, 12, 17, 40]}
    codes = {"this": ROOT, "base": args.base.resolve()}
    workers = {name: start(code, spec, args.work / f"{name}.log") for name, code in codes.items()}
    for proc in workers.values():
        ask(proc, None)  # ready (warmed up)
    runs: dict = {}
    result = {"settings": {**spec, "rounds": args.rounds,  # each checkout by its commit (a dirty tree says so)
                           "commits": {side: commit_of(code) for side, code in codes.items()}},
              "machine": {"cpu_count": os.cpu_count(), "threads": args.threads, "platform": platform.platform(),
                          "python": platform.python_version()}}
    for r in range(args.rounds):
        for i, kind in enumerate(args.kinds):
            for batch in args.batches:
                order = ["this", "base"] if (r + i) % 2 == 0 else ["base", "this"]
                for name in order:
                    runs.setdefault(f"{kind}@{batch}", {}).setdefault(name, []).append(
                        ask(workers[name], [kind, batch]))
        table = {}
        for key, sides in runs.items():
            med = {name: statistics.median(x["tokens_per_s"] for x in rows) for name, rows in sides.items()}
            table[key] = {"tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                          "ratio": round(med["this"] / med["base"], 3),
                          "tau": {k: round(rows[-1]["tau"], 2) for k, rows in sides.items()},
                          "identical": {k: all(x["identical"] for x in rows) for k, rows in sides.items()},
                          "round_ratios": [round(a["tokens_per_s"] / b["tokens_per_s"], 3)
                                           for a, b in zip(sides["this"], sides["base"])]}
        result["rounds_done"], result["methods"] = r + 1, table
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(args.out)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['ratio']}" for k, v in table.items()), flush=True)
    for proc in workers.values():
        proc.stdin.close()
        proc.wait()


if __name__ == "__main__":
    main()
