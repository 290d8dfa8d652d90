"""Decoding speed of this checkout against another (the code before a change), side by side: the same target, the
same trained drafters, the same prompts, timed alternately in rounds in one run.

    python scripts/bench_decode.py --preset toy --prepare --medusa-dir RUN_M --eagle1-dir RUN_E1 --eagle3-dir RUN_E3
    python scripts/bench_decode_side_by_side.py --base ../before --preset toy --threads 2 --rounds 3 \\
        --medusa-dir RUN_M --eagle1-dir RUN_E1 --eagle3-dir RUN_E3

The first command trains the drafters (and builds the target and the draft LM) once; this script only loads them, in
both checkouts, from the same run dirs. It starts one worker process per checkout (``PYTHONPATH`` pointing at it,
its own ``scripts/bench_decode.py`` building the target, drafters and decoder exactly as that checkout's benchmark
does), warms each up (every method decodes the first prompt, plain decoding decodes them all: the greedy reference),
then per round and method asks each worker in turn to decode every prompt, the order alternating between rounds and
methods so neither checkout always goes first. Only one worker runs at a time; the other waits on its pipe.

Per method and checkout: tokens/s over the prompts (the decoders' own timers, prefill included, as
``eval.run.evaluate`` counts them), τ, and whether every output matched that checkout's plain greedy decoding; the
medians over rounds, the ratio of the medians (this / base) and the per-round ratios, whose spread (with plain vs
plain's) is the run's noise. Results are written after every round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("plain", "lookup", "medusa-chain", "medusa-tree", "draft_model", "eagle1", "eagle3")

# One checkout's decoding, driven over its pipes: a JSON line per request on stdin, a JSON line per answer on
# stdout (everything else goes to stderr). Runs with PYTHONPATH = that checkout, so every import is its own.
WORKER = r"""
import json, logging, sys
from pathlib import Path
import torch

spec = json.loads(sys.argv[1])
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
torch.set_num_threads(spec["threads"])
sys.path.insert(0, str(Path(spec["code"]) / "scripts"))
import bench_decode as bd
from distill.teacher import load_teacher
from eval.run import _cast, build_decoder, eval_prompts, proposal_dtype
from heads.base import build_drafter
from train.engine import resolve_device
try:
    from heads.saved import load_drafter
except ImportError:  # the layout before drafter saving moved to heads.saved
    from heads.base import load_drafter

preset = bd.PRESETS[spec["preset"]]
cfg, draft_cfg = bd.load_cfg(preset, spec["overrides"], preset["medusa_steps"])
device = resolve_device(cfg.trainer.device)
teacher = load_teacher(cfg.target, device=device)
methods = spec["methods"]

def saved(kind):
    path = Path(spec["dirs"][kind]) / "drafter"
    if not (path / "config.json").is_file():
        raise SystemExit(f"no trained {kind} drafter at {path}: train it first (scripts/bench_decode.py --prepare)")
    return load_drafter(path, teacher)

drafters = {}
if "medusa-chain" in methods or "medusa-tree" in methods:
    medusa = saved("medusa")
    if "medusa-chain" in methods:
        import copy
        drafters["medusa-chain"] = copy.deepcopy(medusa)
        drafters["medusa-chain"].set_tree("chain")
    if "medusa-tree" in methods:
        medusa.set_tree(spec["tree"])
        drafters["medusa-tree"] = medusa
if "draft_model" in methods:
    draft = build_drafter(draft_cfg, teacher)
    draft.bind_target(teacher, initialize=False)
    drafters["draft_model"] = draft.to(device)
if "lookup" in methods:
    drafters["lookup"] = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
for kind in ("eagle1", "eagle3"):
    if kind in methods:
        drafters[kind] = saved(kind)

prompts, _ = eval_prompts(cfg.eval, teacher.tokenizer)
prompts = [torch.tensor([list(p)], dtype=torch.long) for p in prompts]
dcfg = cfg.decoder
decoder = build_decoder(teacher, dcfg)
max_new, k = cfg.eval.max_new_tokens, cfg.eval.num_draft
policy = cfg.eval.drafter_dtype
dtype = proposal_dtype(policy, teacher.device)
dtypes = {n: str(_cast(decoder, d, dtype, policy == "auto", prompts[0], k)) for n, d in drafters.items()}

def decode(method):
    tokens, seconds, stats, outs, draft, steps = 0, 0.0, None, [], 0.0, 0
    for idx, p in enumerate(prompts):
        decoder.reseed(dcfg.seed + idx)
        gen = decoder.plain(p, max_new) if method == "plain" else decoder.speculative(drafters[method], p, max_new, k)
        tokens += len(gen.new_tokens)
        seconds += gen.seconds
        draft, steps = draft + gen.draft_seconds, steps + sum(gen.nodes_per_forward.values())
        stats = gen.stats if stats is None else stats.merge(gen.stats)
        outs.append(gen.new_tokens)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tau": stats.tau if stats.forwards else None,
            "draft_ms_per_step": 1e3 * draft / steps if steps else None}, outs

for method in methods:  # one-off costs (buffers, static drafts, allocator), as eval.run.evaluate's warm-up
    if method != "plain":
        decoder.speculative(drafters[method], prompts[0], max_new, k)
_, reference = decode("plain")
print(json.dumps({"ready": True, "target": teacher.identity(), "drafter_dtypes": dtypes, "torch": torch.__version__,
                  "drafter_params": {n: sum(p.numel() for p in d.parameters()) for n, d in drafters.items()}}),
      flush=True)
for line in sys.stdin:
    method = json.loads(line)["method"]
    row, outs = decode(method)
    row["identical_to_greedy"] = sum(o == r for o, r in zip(outs, reference))
    print(json.dumps(row), flush=True)
"""


class Worker:
    """One checkout's worker process (see ``WORKER``)."""

    def __init__(self, code: Path, spec: dict, log: Path):
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": str(spec["threads"])}
        self.code = code
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps({**spec, "code": str(code)})], cwd=code,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the worker for {self.code} stopped (exit {self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def ask(self, method: str) -> dict:
        self.proc.stdin.write(json.dumps({"method": method}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def summarize(rounds: list[dict], methods: list[str]) -> dict:
    """Per method: each checkout's median tokens/s and τ over rounds, the ratio of the medians (this / base), and
    the per-round ratios' range."""
    out = {}
    for m in methods:
        base = [r[m]["base"]["tokens_per_s"] for r in rounds]
        this = [r[m]["this"]["tokens_per_s"] for r in rounds]
        ratios = [t / b for t, b in zip(this, base)]
        row = {}
        for side, tps in (("base", base), ("this", this)):
            taus = [r[m][side]["tau"] for r in rounds if r[m][side]["tau"] is not None]
            drafts = [r[m][side]["draft_ms_per_step"] for r in rounds if r[m][side].get("draft_ms_per_step")]
            med = statistics.median(tps)
            row[side] = {"tokens_per_s": med, "tau": statistics.median(taus) if taus else None,
                         "draft_ms_per_step": statistics.median(drafts) if drafts else None,
                         "identical_to_greedy": min(r[m][side]["identical_to_greedy"] for r in rounds),
                         "spread": (max(tps) - min(tps)) / med}  # (max - min) / median over rounds
        row["ratio"] = row["this"]["tokens_per_s"] / row["base"]["tokens_per_s"]
        row["round_ratios"] = ratios
        out[m] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the checkout to compare this one with")
    ap.add_argument("--preset", default="toy", help="scripts/bench_decode.py preset (both checkouts must have it)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", default="default", help="the Medusa tree (inference.tree preset or paths)")
    ap.add_argument("--medusa-dir", default=None, help="run dir of the trained Medusa heads (medusa-* methods)")
    ap.add_argument("--eagle1-dir", default=None, help="run dir of the trained EAGLE-1 drafter")
    ap.add_argument("--eagle3-dir", default=None, help="run dir of the trained EAGLE-3 drafter")
    ap.add_argument("--work", type=Path, default=Path("/tmp") / "bench_decode_side_by_side", help="worker logs")
    ap.add_argument("--out", type=Path, default=Path("bench_decode_side_by_side.json"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both checkouts, e.g. eval.num_prompts=10")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        ap.error(f"--methods={args.methods!r}: unknown {unknown}; valid: {','.join(METHODS)}")
    dirs = {"medusa": args.medusa_dir, "eagle1": args.eagle1_dir, "eagle3": args.eagle3_dir}
    for m in methods:
        kind = "medusa" if m.startswith("medusa") else m
        if kind in dirs and not dirs[kind]:
            ap.error(f"--methods includes {m}: pass --{kind}-dir (a run dir of scripts/bench_decode.py --prepare)")
    dirs = {k: str(Path(v).resolve()) for k, v in dirs.items() if v}
    spec = {"preset": args.preset, "methods": methods, "threads": args.threads, "tree": args.tree, "dirs": dirs,
            "overrides": args.overrides}
    args.work.mkdir(parents=True, exist_ok=True)
    codes = {"base": args.base.resolve(), "this": ROOT}
    t0 = time.perf_counter()
    workers = {side: Worker(code, spec, args.work / f"{side}.log") for side, code in codes.items()}
    ready = {side: w.read() for side, w in workers.items()}
    if ready["base"]["target"] != ready["this"]["target"]:
        raise SystemExit(f"the checkouts loaded different targets: {ready['base']['target']} vs "
                         f"{ready['this']['target']}")
    out = {"preset": args.preset, "methods": methods, "threads": args.threads, "rounds": args.rounds,
           "overrides": args.overrides, "target": ready["this"]["target"],
           "drafter_params": ready["this"]["drafter_params"],
           "drafter_dtypes": {side: r["drafter_dtypes"] for side, r in ready.items()},
           "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
                       "torch_threads": args.threads, "torch": ready["this"]["torch"],
                       "python": platform.python_version()},
           "setup_seconds": time.perf_counter() - t0, "per_round": []}
    for r in range(args.rounds):
        row = {}
        for i, m in enumerate(methods):
            order = ("base", "this") if (r + i) % 2 == 0 else ("this", "base")
            row[m] = {side: workers[side].ask(m) for side in order}
            print(f"round {r} {m:<13} " + "  ".join(
                f"{side} {row[m][side]['tokens_per_s']:7.1f} tok/s tau {row[m][side]['tau'] or 0:.2f}"
                for side in ("base", "this")), flush=True)
        out["per_round"].append(row)
        out["summary"] = summarize(out["per_round"], methods)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2) + "\n")
        os.replace(tmp, args.out)
    for w in workers.values():
        w.close()
    for m, s in out["summary"].items():
        print(f"{m:<13} base {s['base']['tokens_per_s']:7.1f}  this {s['this']['tokens_per_s']:7.1f}  "
              f"ratio {s['ratio']:.3f}  rounds {min(s['round_ratios']):.3f}-{max(s['round_ratios']):.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
