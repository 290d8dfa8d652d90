"""Training memory at a real vocabulary: peak RSS and tokens/s of a 2-step ``python -m train`` per drafter kind.

    python scripts/bench_memory.py                                   # after: this checkout, seq 2048 and 8192
    python scripts/bench_memory.py --code ../base --label before --seqs 1024 2048 --kinds eagle1
    python scripts/bench_memory.py --table scripts/results/bench_memory_cpu.json   # the table + Llama-3-8B
    python scripts/bench_memory.py --ab ../base --seqs 1024 --threads 1             # tokens/s A/B, same load

Target: a random-weight Llama with the Llama-3 vocabulary (V 128,256, hidden 512, 2 layers, 8 heads, untied
embeddings: 0.15B parameters, ~0.6 GB of weights), built once under ``$SPECDRAFT_CACHE`` with the tiny toy target's
tokenizer (its ids cover only the first 512 rows of the vocabulary, which changes no tensor shape). Each run is
``python -m train target.source=hf target.name=<that dir> drafter=<kind> data.max_length=<seq>
trainer.micro_batch_size=1 trainer.steps=2 eval.enabled=false`` on the CPU, one at a time in a subprocess whose
address space is capped (``--max-gb``, via ``resource.RLIMIT_AS``) so a runaway run fails itself, not the machine.
Peak memory is the child's RSS high-water mark (``wait4`` rusage ``ru_maxrss``); tokens/s is the loop's second
window (``perf/tokens_per_s`` of step 1: one whole training step, start-up excluded).

``--device cuda`` runs the same 2-step trainings on a GPU (bf16 target, ``trainer.bf16`` autocast as configured,
no address-space cap): peak memory is then the child's ``torch.cuda.max_memory_allocated`` (and ``_reserved``),
written at exit by a small launcher around ``python -m train`` so the "before" checkout, which does not log it on
a GPU, is measured the same way; tokens/s is the median of steps 1.. (``--steps``, default 6 on a GPU: one step at
seq 2048 takes milliseconds). Results go to ``bench_memory_gpu.json``; ``--gpu-table`` prints them.

``--code`` runs another checkout's ``python -m train`` (the base commit, for the "before" figures) against the same
target and data. Results merge into ``--out`` keyed by label / kind / seq, so runs can be added one at a time.
``--table`` prints the table (with ``after_first_pass``, the chunked loss's first version, where kept) and the Llama-3-8B
projection (``project_8b``). ``--ab <checkout>`` measures
tokens/s fairly on a shared machine: per kind and length, that checkout's run and this one's back to back (``--rounds``
times, alternating), so both see the same load; each pair is kept under ``ab`` with its after/before ratio (pairs
of later invocations against the same checkout are added). ``--cpu-steps S`` adds tokens per CPU second to each
side of a pair: the CPU time of an S-step run minus a 1-step run's, i.e. S - 1 training steps with start-up, target
load and data excluded; at 1 thread this barely moves with the machine's load, where wall tokens/s moves 2-3x.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from train.checkpoint import fresh_scratch_run

ROOT = Path(__file__).resolve().parents[1]

KINDS = {
    "medusa": ["drafter=medusa"],
    "eagle1": ["drafter=eagle1"],
    "eagle3": ["drafter=eagle3", "drafter.draft_vocab_size=32000"],
    "draft_model": ["drafter=draft_model"],
}
VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE = 128_256, 512, 2, 8, 1408
# The base commit's figures at seq 2048 (peak RSS, GB), quoted where a run is not repeated here.
ISSUE_BEFORE = {"medusa": {"2048": 20.6}, "eagle1": {"2048": 8.4}, "eagle3": {"2048": 9.6}, "draft_model": {"2048": 9.7}}
CORPUS_BYTES = 3_000_000  # stdlib text: enough 8192-token rows for 2 steps with the tiny 512-token tokenizer


def build_target(cache: Path) -> Path:
    """The random-weight Llama directory (model + tokenizer), built once."""
    path = cache / f"bench-llama-v{VOCAB}-h{HIDDEN}-l{LAYERS}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from distill.atomic import write_dir_atomically
    from distill.toy import load_or_build_toy_target
    from omegaconf import OmegaConf

    tiny = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "target" / "tiny.yaml"))["toy"]
    _, tokenizer = load_or_build_toy_target(tiny, cache_dir=str(cache))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=16_384, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    return write_dir_atomically(path, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)),
                                replace=False)  # never deletes a directory this function did not finish


# Runs ``python -m train`` with sys.argv as given and, at exit, writes the process's CUDA peak memory as JSON to
# $BENCH_CUDA_PEAK: the same measurement for any checkout (the "before" one does not log it on a GPU).
CUDA_PEAK_LAUNCHER = """
import atexit, json, os, runpy, sys
import torch
def _peak():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        with open(os.environ["BENCH_CUDA_PEAK"], "w") as f:
            json.dump({"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}, f)
atexit.register(_peak)
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("train", run_name="__main__", alter_sys=True)
"""


def run_once(code: Path, target: Path, kind: str, seq: int, work: Path, threads: int, max_gb: float,
             extra: list[str], steps: int = 2, device: str = "cpu") -> dict:
    run_dir = work / f"{code.name}-{kind}-{seq}"
    fresh_scratch_run(run_dir)  # a run cut short is not in results; trainer.resume=never needs it empty
    overrides = ["target=tiny", "target.source=hf", f"target.name={target}", *KINDS[kind],
                 f"data.max_length={seq}", f"data.corpus_max_bytes={CORPUS_BYTES}", "trainer.micro_batch_size=1",
                 "trainer.grad_accum=1", f"trainer.steps={steps}", "trainer.warmup_steps=1", "trainer.log_every=1",
                 "trainer.ckpt_every=1000000", "trainer.resume=never", f"trainer.device={device}",
                 f"trainer.num_threads={threads}", "eval.enabled=false", f"hydra.run.dir={run_dir}", *extra]
    if device != "cpu":
        overrides.append("target.dtype=bfloat16")
    peak_file = work / f"{code.name}-{kind}-{seq}.cuda_peak.json"
    peak_file.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(code), "BENCH_CUDA_PEAK": str(peak_file)}
    cap = int(max_gb * 2**30)

    def limit() -> None:  # in the child: a run past the cap fails its own allocation (CPU only: CUDA maps far more
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))  # address space than it uses)

    command = [sys.executable, "-m", "train"] if device == "cpu" else [sys.executable, "-c", CUDA_PEAK_LAUNCHER]
    log_path = work / f"{code.name}-{kind}-{seq}.log"
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen([*command, *overrides], cwd=code, env=env, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=limit if device == "cpu" else None)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    result = {"kind": kind, "seq": seq, "steps": steps, "overrides": overrides, "wall_s": wall, "load_before": load_before,
              "load_after": os.getloadavg()[0], "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,
              "exit_status": os.waitstatus_to_exitcode(status), "address_space_cap_gb": max_gb,
              "cpu_s": usage.ru_utime + usage.ru_stime}
    metrics = run_dir / "metrics.jsonl"
    if result["exit_status"] == 0 and metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        rows = [r for r in rows if "perf/tokens_per_s" in r]
        later = [r["perf/tokens_per_s"] for r in rows if r.get("step", 0) >= 1] or [rows[-1]["perf/tokens_per_s"]]
        result["tokens_per_s"] = later[0] if device == "cpu" else statistics.median(later)
        result["tokens_per_s_steps"] = later
        result["step_s"] = seq / result["tokens_per_s"]
        if all("perf/peak_mem_gb" in r for r in rows):
            result["loop_peak_mem_gb"] = max(r["perf/peak_mem_gb"] for r in rows) * 2**30 / 1e9
        result["train_loss"] = [r["train/loss"] for r in rows]
        if peak_file.is_file():
            peak = json.loads(peak_file.read_text())
            result["peak_cuda_gb"], result["peak_cuda_reserved_gb"] = peak["allocated"] / 1e9, peak["reserved"] / 1e9
    else:
        result["log_tail"] = log_path.read_text().splitlines()[-15:]
    return result


# --- the Llama-3-8B projection --------------------------------------------------------------------------------

# Llama-3-8B: hidden 4096, 32 layers, V 128,256, MLP 14,336, 8 KV heads; bf16 weights 16.06 GB (the frozen target).
D8, I8, KV8 = 4096, 14_336, 1024
GPU_GB, TARGET_GB, CONTEXT_GB = 80.0, 16.06, 2.0  # CUDA context + allocator slack: an assumption, stated
# Trainable parameters of each drafter as configured for an 8B target (formulas from heads/*.py); the optimizer
# keeps 16 bytes each (fp32 weight + fp32 grad + AdamW's two fp32 moments; bf16 is autocast, not stored).
DRAFTER_PARAMS_8B = {
    "medusa": 4 * (D8 * D8 + D8 + D8 * VOCAB),  # 4 heads: ResBlock + its own lm_head
    "eagle1": 2 * D8 * D8 + 4 * D8 * D8 + 3 * D8 * I8 + 2 * D8,  # fc(2D->D), layer; lm_head is the target's
    "eagle3": 3 * D8 * D8 + 3 * 2 * D8 * D8 + D8 * D8 + 3 * D8 * I8 + 32_000 * D8 + 4 * D8,  # fc(3D), 2D-wide qkv
    "draft_model": 2 * D8 * VOCAB + 2 * D8 * D8 + 2 * D8 * KV8 + 3 * D8 * I8 + 3 * D8,  # 1 layer + emb + lm_head
}


def measured_points(data: dict, label: str, kind: str) -> list[tuple[int, float, str]]:
    """(seq, peak bytes, 'measured' | 'quoted') for one drafter kind: this machine's runs, plus the quoted
    base-commit figure where that length was not run here."""
    runs = data.get(label, {}).get(kind, {})
    pts = {int(s): (r["peak_rss_gb"] * 1e9, "measured") for s, r in runs.items() if r.get("exit_status") == 0}
    if label == "before":
        for s, gb in data.get("quoted_before", {}).get(kind, {}).items():
            pts.setdefault(int(s), (gb * 1e9, "quoted"))
    return sorted((s, b, how) for s, (b, how) in pts.items())


def per_token_bytes(points: list[tuple[int, float, str]], seq: int) -> tuple[float, str] | None:
    """(bytes per token at ``seq``, how it was obtained). The fixed part (weights, optimizer state, interpreter) is
    the intercept of the line through the two shortest lengths; at a measured ``seq`` the per-token part is what
    remains of its peak divided by ``seq`` (quadratic terms such as the TTT mask averaged in), beyond the longest
    measured length it is that length's (extrapolated linearly)."""
    if len(points) < 2:
        return None
    (s0, m0, _), (s1, m1, _) = points[0], points[1]
    fixed = m0 - (m1 - m0) / (s1 - s0) * s0
    at = {s: (m, how) for s, m, how in points}
    if seq in at:
        return (at[seq][0] - fixed) / seq, at[seq][1]
    s_last, m_last, _ = points[-1]
    return (m_last - fixed) / s_last, f"extrapolated from seq {s_last}"


# Hidden-sized [D] tensors per token each drafter keeps for backward, read from heads/*.py (an estimate, not a
# measurement): Medusa ~6 per head x 4; EAGLE-1 one layer (fc input/output, norms, q/k/v, attention, MLP at ~3.5 D
# wide x 3, residuals) ~30; EAGLE-3 the same per TTT step with 2D-wide inputs and the steps' keys, ~38 x 7 + the 3D
# features; the draft model one decoder layer and its embeddings ~35. On the toy (D 512) these are < 15% of the
# measured bytes; on the 8B (D 4096) they are not, so they are added at 4096 x 2 bytes (bf16 autocast).
HIDDEN_TENSORS = {"medusa": 24, "eagle1": 30, "eagle3": 7 * 38 + 3, "draft_model": 35}
TEACHER_HIDDEN_8B = 33 * D8 * 2  # the HF forward keeps all 33 hidden states (bf16) until it returns


def project_8b(bytes_per_token_toy: float, kind: str, seq: int) -> dict:
    """Llama-3-8B on one 80 GB GPU from the toy's measured per-token bytes (V 128,256 like Llama-3, hidden 512,
    float32 on CPU). Per token: the toy's bytes as measured (its vocabulary-sized tensors are the same count at the
    same V; kept at float32, so an upper bound where bf16 autocast would halve the teacher's logits), plus the
    hidden-sized tensors at D 4096 (``HIDDEN_TENSORS``) and the teacher's 33 hidden states. Fixed: target weights,
    the drafter's optimizer state (``DRAFTER_PARAMS_8B`` x 16 bytes) and ``CONTEXT_GB``. The micro-batch is the
    largest whose rows fit 80 GB (0: not even one)."""
    per_token = bytes_per_token_toy + HIDDEN_TENSORS[kind] * D8 * 2 + TEACHER_HIDDEN_8B
    fixed_gb = TARGET_GB + 16 * DRAFTER_PARAMS_8B[kind] / 1e9 + CONTEXT_GB
    row_gb = per_token * seq / 1e9
    fits = max(0, int((GPU_GB - fixed_gb) // row_gb))
    return {"bytes_per_token_toy": round(bytes_per_token_toy), "bytes_per_token_8b": round(per_token),
            "fixed_gb": round(fixed_gb, 1), "gb_per_row": round(row_gb, 2), "micro_batch_fits_80gb": fits,
            "peak_gb_at_that_batch": round(fixed_gb + max(fits, 1) * row_gb, 1)}


def projection(data: dict) -> dict:
    out = {}
    for label in ("before", "after"):
        for kind in KINDS:
            points = measured_points(data, label, kind)
            for seq in (2048, 8192):
                got = per_token_bytes(points, seq)
                if got:
                    out.setdefault(label, {}).setdefault(kind, {})[str(seq)] = {**project_8b(got[0], kind, seq),
                                                                                "toy_figure": got[1]}
    return out


def projection_table(data: dict) -> str:
    proj = projection(data)
    lines = ["| drafter | seq | code | toy bytes/token (from) | 8B bytes/token | 8B fixed GB | GB per row | micro-batch on 80 GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        for seq in ("2048", "8192"):
            for label in ("before", "after"):
                p = proj.get(label, {}).get(kind, {}).get(seq)
                if p:
                    lines.append(f"| {kind} | {seq} | {label} | {p['bytes_per_token_toy']:,} ({p['toy_figure']}) | "
                                 f"{p['bytes_per_token_8b']:,} | "
                                 f"{p['fixed_gb']} | {p['gb_per_row']} | {p['micro_batch_fits_80gb']} |")
    return "\n".join(lines)


def table(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = ["| drafter | seq | before peak GB | first pass GB | after peak GB | ratio | before tokens/s | after tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        seqs = sorted({int(s) for label in ("before", "after", "after_first_pass")
                       for s in data.get(label, {}).get(kind, {})})
        for seq in seqs:
            b = data.get("before", {}).get(kind, {}).get(str(seq), {})
            a = data.get("after", {}).get(kind, {}).get(str(seq), {})
            q = data.get("quoted_before", {}).get(kind, {}).get(str(seq))
            bpk = b.get("peak_rss_gb") if b.get("exit_status") == 0 else q
            bmark = "" if b.get("exit_status") == 0 or bpk is None else " (quoted)"
            ratio = f"{a['peak_rss_gb'] / bpk:.2f}x" if a.get("exit_status") == 0 and bpk else "-"
            first = data.get("after_first_pass", {}).get(kind, {}).get(str(seq), {})
            lines.append(f"| {kind} | {seq} | {_f(bpk)}{bmark} | {_f(first.get('peak_rss_gb'))} | "
                         f"{_f(a.get('peak_rss_gb'))} | {ratio} | "
                         f"{_f(b.get('tokens_per_s'), '.0f')} | {_f(a.get('tokens_per_s'), '.0f')} |")
    return "\n".join(lines)


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def ab_pairs(base: Path, target: Path, kinds: list[str], seqs: list[int], args, out: Path) -> None:
    """``--ab``: before (``base``) and after (this checkout) back to back, ``args.rounds`` pairs per kind and length,
    which of the two runs first alternating from round to round (use an even number of rounds).
    The last after run is also this length's ``after`` row (its peak RSS does not depend on the load)."""
    for kind in kinds:
        for seq in seqs:
            pairs = []
            for round_ in range(args.rounds):
                pair = {"first": "before" if round_ % 2 == 0 else "after"}
                # The second run of a pair measured 3-6% slower with identical code (EAGLE-1, seq 1024, quiet
                # machine): odd rounds run after first, so --rounds 2k cancels the order.
                order = (("before", base), ("after", ROOT))
                for label, code in (order if round_ % 2 == 0 else order[::-1]):
                    r = run_once(code, target, kind, seq, args.work, args.threads, args.max_gb, args.extra, args.steps)
                    if label == "after":
                        last_after = r
                    pair[label] = {k: r.get(k) for k in ("peak_rss_gb", "tokens_per_s", "exit_status", "load_before",
                                                          "load_after", "wall_s", "cpu_s", "log_tail") if k in r}
                    if args.cpu_steps and r["exit_status"] == 0:
                        # CPU seconds of (cpu_steps - 1) steps: a 1-step run's CPU (start-up, target, data, step 1)
                        # subtracted from a cpu_steps run's, so the figure is the loop's own and the machine's load
                        # barely moves it (wall tokens/s on a shared machine moves 2-3x)
                        short = run_once(code, target, kind, seq, args.work, args.threads, args.max_gb, args.extra, 1)
                        long = run_once(code, target, kind, seq, args.work, args.threads, args.max_gb, args.extra,
                                        args.cpu_steps)
                        if short["exit_status"] == 0 and long["exit_status"] == 0:
                            pair[label]["tokens_per_cpu_s"] = (args.cpu_steps - 1) * seq / (long["cpu_s"] - short["cpu_s"])
                ok = all(pair[x].get("tokens_per_s") for x in ("before", "after"))
                pair["tokens_per_s_ratio"] = pair["after"]["tokens_per_s"] / pair["before"]["tokens_per_s"] if ok else None
                if all(pair[x].get("tokens_per_cpu_s") for x in ("before", "after")):
                    pair["tokens_per_cpu_s_ratio"] = pair["after"]["tokens_per_cpu_s"] / pair["before"]["tokens_per_cpu_s"]
                pairs.append(pair)
                print(f"ab {kind} seq {seq}: before {pair['before'].get('tokens_per_s')} after "
                      f"{pair['after'].get('tokens_per_s')} tokens/s, ratio {pair['tokens_per_s_ratio']}; per CPU s "
                      f"{pair.get('tokens_per_cpu_s_ratio')}", flush=True)
            data = json.loads(out.read_text()) if out.is_file() else {}
            data.setdefault("after", {}).setdefault(kind, {})[str(seq)] = {**last_after, "code": str(ROOT),
                                                                            "note": "the --ab pair's after run"}
            earlier = data.setdefault("ab", {}).setdefault(kind, {}).get(str(seq), {})
            kept = earlier.get("pairs", []) if earlier.get("before_code") == str(base) else []  # a later invocation adds
            data["ab"][kind][str(seq)] = {
                "before_code": str(base), "after_code": str(ROOT), "threads": args.threads, "steps": args.steps,
                "pairs": kept + pairs}
            out.write_text(json.dumps(data, indent=2) + "\n")


def ab_table(data: dict) -> str:
    lines = ["| drafter | seq | before tokens/s | after tokens/s | after / before (per pair) | per CPU second (per pair) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        for seq, row in sorted(data.get("ab", {}).get(kind, {}).items(), key=lambda kv: int(kv[0])):
            pairs = row["pairs"]
            mean = lambda label: sum(p[label].get("tokens_per_s") or 0 for p in pairs) / len(pairs)
            ratios = ", ".join("-" if p["tokens_per_s_ratio"] is None else f"{p['tokens_per_s_ratio']:.2f}" for p in pairs)
            cpu = ", ".join(f"{p['tokens_per_cpu_s_ratio']:.2f}" for p in pairs if p.get("tokens_per_cpu_s_ratio"))
            lines.append(f"| {kind} | {seq} | {mean('before'):.0f} | {mean('after'):.0f} | {ratios} | {cpu or '-'} |")
    return "\n".join(lines)


def run_sides(base: Path | None, target: Path, args, out: Path) -> None:
    """Per kind and length, the "before" checkout's run (``base``, if given) and this one's back to back, which runs
    first alternating; without ``base``, ``--code``'s runs under ``--label``. Each is kept as it finishes."""
    from eval.report import machine_info

    for i, (kind, seq) in enumerate((k, s) for k in args.kinds for s in args.seqs):
        sides = [("before", base), ("after", ROOT)] if base else [(args.label, args.code.resolve())]
        for label, code in (sides if i % 2 == 0 else sides[::-1]):
            r = run_once(code, target, kind, seq, args.work, args.threads, args.max_gb, args.extra, args.steps,
                         args.device)
            data = json.loads(out.read_text()) if out.is_file() else {}
            data.setdefault("machine", machine_info())
            if args.device == "cpu":
                data.setdefault("quoted_before", ISSUE_BEFORE)
            data.setdefault(label, {}).setdefault(kind, {})[str(seq)] = {**r, "code": str(code)}
            out.write_text(json.dumps(data, indent=2) + "\n")
            peak = (f"peak {r['peak_rss_gb']:.2f} GB" if args.device == "cpu" else
                    f"CUDA peak {r.get('peak_cuda_gb', float('nan')):.2f} GB (reserved "
                    f"{r.get('peak_cuda_reserved_gb', float('nan')):.2f})")
            print(f"{label} {kind} seq {seq}: {peak}, {r.get('tokens_per_s', float('nan')):.0f} tokens/s, exit "
                  f"{r['exit_status']}", flush=True)


def gpu_table(data: dict) -> str:
    lines = ["| drafter | seq | before CUDA peak GB | after CUDA peak GB | ratio | before tokens/s | after tokens/s | "
             "ratio |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        seqs = sorted({int(s) for label in ("before", "after") for s in data.get(label, {}).get(kind, {})})
        for seq in seqs:
            b = data.get("before", {}).get(kind, {}).get(str(seq), {})
            a = data.get("after", {}).get(kind, {}).get(str(seq), {})
            bp, ap = b.get("peak_cuda_gb"), a.get("peak_cuda_gb")
            bt, at = b.get("tokens_per_s"), a.get("tokens_per_s")
            fail = lambda r: "" if not r or r.get("exit_status") == 0 else " (failed)"
            lines.append(f"| {kind} | {seq} | {_f(bp, '.2f')}{fail(b)} | {_f(ap, '.2f')}{fail(a)} | "
                         f"{f'{ap / bp:.2f}x' if ap and bp else '-'} | {_f(bt, '.0f')} | {_f(at, '.0f')} | "
                         f"{f'{at / bt:.2f}x' if at and bt else '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="checkout whose `python -m train` runs")
    parser.add_argument("--label", default="after", help="key in the JSON (before / after)")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--seqs", nargs="*", type=int, default=[2048, 8192])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="training steps (tokens/s: step 1's window; with 1 step "
                        "step 0's, start-up included, and the peak misses the second step's AdamW state)")
    parser.add_argument("--max-gb", type=float, default=16.0, help="address-space cap per run (GB)")
    parser.add_argument("--out", type=Path, default=ROOT / "scripts" / "results" / "bench_memory_cpu.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp") / "bench_memory")
    parser.add_argument("--table", type=Path, default=None, help="print the table of this JSON and exit")
    parser.add_argument("--ab", type=Path, default=None, help="a 'before' checkout: tokens/s A/B against this one")
    parser.add_argument("--rounds", type=int, default=1, help="--ab: before/after pairs per kind and length")
    parser.add_argument("--cpu-steps", type=int, default=0, help="--ab: also tokens per CPU second, from a 1-step and "
                        "a this-many-step run of each side (robust to the machine's load)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: CUDA peak memory and "
                        "tokens/s on a GPU, before (--ab) and after back to back, into bench_memory_gpu.json")
    parser.add_argument("--gpu-table", type=Path, default=None, help="print the GPU table of this JSON and exit")
    parser.add_argument("extra", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    if args.gpu_table:
        print(gpu_table(json.loads(args.gpu_table.read_text())))
        return
    if args.table:
        data = json.loads(args.table.read_text())
        data["llama3_8b_projection"] = projection(data)
        args.table.write_text(json.dumps(data, indent=2) + "\n")
        print(table(args.table) + "\n\n" + projection_table(data) + "\n\n" + ab_table(data))
        return
    from distill.toy import default_cache_dir

    args.work = args.work.resolve()  # runs of another checkout start in that checkout: a relative dir would move
    cache = default_cache_dir()
    target = build_target(cache)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        if args.steps == 2:
            args.steps = 6  # one step at seq 2048 takes milliseconds: the median of steps 1..5
        if args.out == ROOT / "scripts" / "results" / "bench_memory_cpu.json":
            args.out = ROOT / "scripts" / "results" / "bench_memory_gpu.json"
        run_sides(args.ab.resolve() if args.ab else None, target, args, args.out)
        print(gpu_table(json.loads(args.out.read_text())))
        return
    if args.ab:  # on a CPU, --ab pairs tokens/s over rounds (and CPU seconds): ab_pairs
        ab_pairs(args.ab.resolve(), target, args.kinds, args.seqs, args, args.out)
        return
    run_sides(None, target, args, args.out)


if __name__ == "__main__":
    main()
