"""The loss path's own memory: one training step's distillation terms (forward + backward) at a real vocabulary,
before (materialised logits, ``distill.losses`` of an older checkout) and after (``distill.chunked``), on CPU.

    python scripts/bench_loss_memory.py --before ../base                     # every kind, forward KL
    python scripts/bench_loss_memory.py --before ../base --kinds eagle1 --losses fkl rkl jsd tvd topk_fkl
    python scripts/bench_loss_memory.py --table                                # print the table

``scripts/bench_memory.py`` measures whole ``python -m train`` runs; this isolates what the issue calls the loss
path: from the drafter's last hidden states [N, D] and the teacher's signal to the summed loss and the gradients
w.r.t. the hidden states and the trainable projections. Each (implementation, kind, divergence) runs in a fresh
subprocess that builds its inputs with no temporaries (so the process's RSS high-water mark equals its RSS at that
point), records RSS, runs the terms and backward, and reads the high-water mark (``ru_maxrss``):

- ``loss_gb``: peak minus RSS after the inputs: the loss path's own working memory;
- ``inputs_gb``: the inputs that differ by implementation: the teacher's signal (before: dense [N, V] float32 logits,
  what the old teacher handed the loss; after: the same dense logits, or, ``projected``, the final hidden state
  [N, D] whose rows each chunk projects through the frozen lm_head, what online EAGLE-1 / Medusa / draft-model
  training now hands it);
- ``total_gb`` = inputs + loss.

Kinds (shapes of the issue's measurement: V 128,256, D 512, seq 2048, micro-batch 1, so N = 2048 rows):
``eagle1`` one term through the frozen lm_head; ``medusa`` 4 terms, each head's own trainable [V, D] projection, all
summed before backward as the training loop does; ``eagle3`` 7 TTT terms through a trainable draft lm_head over
V_d = 32,000 draft-vocabulary columns of the teacher. The draft-model kind is ``eagle1``'s shape with a trainable
projection (same loss path).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"eagle1": (1, None, False), "medusa": (4, None, True), "eagle3": (7, 32000, True)}  # terms, V_d, trainable
LOSSES = {"fkl": ("forward_kl", {}), "rkl": ("reverse_kl", {}), "jsd": ("jsd", {"beta": 0.5}),
          "tvd": ("total_variation", {}), "topk_fkl": ("topk_forward_kl", {"k": 32})}


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e9


def worker(impl: str, code: str, kind: str, loss: str, n: int, vocab: int, dim: int, chunk: int) -> dict:
    """One measurement in this (fresh) process; ``impl`` before | after | after_projected."""
    sys.path.insert(0, code)
    import functools

    import torch
    from torch import nn

    import distill.losses as losses

    if impl != "before":  # imported before the first RSS reading: their code is not the loss path's memory
        from distill.chunked import CHUNK_ELEMENTS, TeacherRows, chunked_divergence
        from distill.teacher_output import TeacherOutput
    torch.manual_seed(0)
    terms, draft_vocab, trainable = KINDS[kind]
    draft_vocab = draft_vocab and min(draft_vocab, vocab // 2)
    fn = functools.partial(getattr(losses, LOSSES[loss][0]), temperature=1.0, **LOSSES[loss][1])
    width = draft_vocab or vocab
    rss0 = rss_gb()
    hidden = [torch.randn(n, dim, requires_grad=True) for _ in range(terms)]  # each term's student rows
    shared_head = nn.Linear(dim, width, bias=False)
    heads = [nn.Linear(dim, width, bias=False) for _ in range(terms)] if kind == "medusa" else [shared_head] * terms
    for h in heads:
        h.requires_grad_(trainable)
    cols = torch.randperm(vocab)[:draft_vocab].sort().values if draft_vocab else None
    lm_head = nn.Linear(dim, vocab, bias=False).requires_grad_(False)  # the target's, for the projected teacher
    if impl == "after_projected":
        final_ND = torch.randn(n, dim)
        teacher_NV = None
    else:
        with torch.no_grad():
            teacher_NV = torch.empty(n, vocab)
            for i in range(0, n, 256):  # the teacher's logits, built in slices (no [N, V] temporary)
                teacher_NV[i: i + 256] = lm_head(torch.randn(min(256, n - i), dim))
    rss_in = rss_gb()
    peak_in = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    cpu0 = time.process_time()
    if impl == "before":
        total = 0
        for k in range(terms):
            t_rows = teacher_NV if cols is None else teacher_NV[:, cols]  # the old EAGLE-3 gather, per TTT step
            total = total + fn(heads[k](hidden[k]), t_rows, None)[0]
    else:
        if impl == "after_projected":
            signal = TeacherOutput(logits_BTV=None, final_BTD=final_ND[None], readout=lm_head, vocab_size=vocab)
        else:
            signal = TeacherOutput(logits_BTV=teacher_NV[None])
        b_N, t_N = torch.zeros(n, dtype=torch.long), torch.arange(n)
        total = 0
        for k in range(terms):
            total = total + chunked_divergence(hidden[k], heads[k], TeacherRows(signal, b_N, t_N, cols), fn,
                                               chunk or CHUNK_ELEMENTS)[0]
    total.backward()
    cpu = time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    assert all(h.grad is not None and torch.isfinite(h.grad).all() for h in hidden)
    return {"impl": impl, "kind": kind, "loss": loss, "n": n, "vocab": vocab, "dim": dim, "terms": terms,
            "draft_vocab": draft_vocab, "loss_value": float(total.detach()), "rss_start_gb": round(rss0, 3),
            "inputs_gb": round(rss_in - rss0, 3), "peak_gb": round(peak, 3), "loss_gb": round(peak - max(rss_in, peak_in), 3),
            "total_gb": round(peak - rss0, 3), "loss_cpu_s": round(cpu, 2),
            "chunk_elements": None if impl == "before" else chunk or CHUNK_ELEMENTS}


def run(impl: str, code: Path, kind: str, loss: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", impl, str(code), kind, loss, str(args.n), str(args.vocab), str(args.dim),
           str(args.chunk_elements or 0)]
    cap = int(args.max_gb * 1e9)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": str(args.threads)},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    if proc.returncode != 0:
        return {"impl": impl, "kind": kind, "loss": loss, "exit_status": proc.returncode,
                "error": proc.stderr.strip().splitlines()[-1:] or ["?"], "address_space_cap_gb": args.max_gb}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "exit_status": 0, "code": str(code)}


def table(data: dict) -> str:
    lines = ["| kind | loss | before: loss path GB | after: loss path GB | after / before | after, projected teacher: "
             "teacher + loss GB | / before's teacher + loss |", "|---|---|---|---|---|---|---|"]
    for key, row in data["rows"].items():
        b, a, p = row.get("before", {}), row.get("after", {}), row.get("after_projected", {})
        f = lambda r, k: f"{r[k]:.2f}" if k in r else f"over {r.get('address_space_cap_gb', '?')} GB cap" if r else "-"
        ratio = f"{a['loss_gb'] / b['loss_gb']:.2f}×" if "loss_gb" in a and "loss_gb" in b else "-"
        pr = f"{p['total_gb'] / b['total_gb']:.2f}×" if "total_gb" in p and "total_gb" in b else "-"
        kind, loss = key.split("/")
        loss = loss.replace(" @", ", chunk elements ")
        lines.append(f"| {kind} | {loss} | {f(b, 'loss_gb')} | {f(a, 'loss_gb')} | {ratio} | {f(p, 'total_gb')} | {pr} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        impl, code, kind, loss, n, vocab, dim, chunk = sys.argv[2:10]
        print(json.dumps(worker(impl, code, kind, loss, int(n), int(vocab), int(dim), int(chunk))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, help="a checkout with the materialised losses (e.g. a git worktree of an older commit)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--losses", nargs="+", default=["fkl"], choices=list(LOSSES))
    ap.add_argument("--n", type=int, default=2048, help="rows (seq x micro-batch)")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk-elements", type=int, default=None, help="after: trainer.loss_chunk_elements (default 2^25)")
    ap.add_argument("--max-gb", type=float, default=18.0, help="address-space cap per run")
    ap.add_argument("--out", type=Path, default=ROOT / "scripts" / "results" / "bench_loss_memory_cpu.json")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    data = json.loads(args.out.read_text()) if args.out.is_file() else {"rows": {}}
    if args.table:
        print(table(data))
        return
    if args.before is None:
        ap.error("--before <checkout> is required to measure (or --table)")
    import torch

    data["machine"] = {"platform": platform.platform(), "cpu_count": __import__("os").cpu_count(),
                       "torch": torch.__version__, "threads": args.threads}
    for kind in args.kinds:
        for loss in args.losses:
            suffix = f" @{args.chunk_elements}" if args.chunk_elements else ""
            row = data["rows"].setdefault(f"{kind}/{loss}{suffix}", {})
            impls = [("before", args.before.resolve()), ("after", ROOT)]
            if KINDS[kind][1] is None:  # a full-vocabulary teacher: the projected form applies
                impls.append(("after_projected", ROOT))
            for impl, code in impls:
                row[impl] = run(impl, code, kind, loss, args)
                print(kind, loss, impl, {k: row[impl].get(k) for k in ("inputs_gb", "loss_gb", "total_gb", "error")},
                      flush=True)
                args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(table(data))


if __name__ == "__main__":
    main()
