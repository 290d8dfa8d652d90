"""The drafters' training attention, kernel by kernel (``trainer.attention``): forward + backward time and peak memory
of one attention call under each structured mask (EAGLE's training-time-test steps, DFlash's blocks, P-EAGLE's
chains), at the shapes given.

    python scripts/bench_train_attention.py                         # CPU, toy-like shapes, 1 thread: dense, tiled
    python scripts/bench_train_attention.py --device cuda --seq 4096  # GPU: dense, tiled, flex (compiled)

Output JSON (``--out``): machine, settings, and per (mask, kernel) the median milliseconds and, on CUDA, the peak
memory above the inputs. EAGLE's explicit-scores CPU path (``heads.eagle.attention``) is timed beside them on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eval.report import machine_info
from heads.eagle.attention import explicit_ttt_attention
from heads.train_attention import attend, dflash_block_mask, parallel_chain_mask, train_attention, ttt_step_mask


def masks(B: int, T: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    attn = torch.ones(B, T, dtype=torch.bool)
    attn[-1, T * 3 // 4:] = False  # one right-padded row
    n = max(1, T // 8)
    anchors = torch.stack([torch.randperm(T - 2, generator=g)[:n].sort().values + 1 for _ in range(B)])
    attn, anchors = attn.to(device), anchors.to(device)
    out = {f"ttt_step{j}": ttt_step_mask(attn, j) for j in range(3)}
    out["dflash"] = dflash_block_mask(anchors, attn, 16)
    out["dflash_window"] = dflash_block_mask(anchors, attn, 16, T // 4)
    out["peagle"] = parallel_chain_mask(attn, anchors, [n, n * 7 // 10, n // 2])
    return out


def timed(fn, device: torch.device, repeats: int) -> tuple[float, int | None]:
    for _ in range(2):  # warm-up (and compilation, for flex)
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kernels = ("dense", "tiled", "flex") if device.type == "cuda" else ("dense", "tiled")
    rows = []
    for name, mask in masks(args.batch, args.seq, device).items():
        leaf = lambda n: torch.randn(args.batch, args.heads, n, args.head_dim, device=device, dtype=dtype,
                                     requires_grad=True)
        q, k, v = leaf(mask.Q), leaf(mask.KV), leaf(mask.KV)
        runs = {kernel: (lambda kernel=kernel: _step(kernel, q, k, v, mask)) for kernel in kernels}
        if name != "ttt_step0" and name.startswith("ttt") and device.type == "cpu":
            steps = mask.KV // mask.Q
            keys = [(k[:, :, i * mask.Q:(i + 1) * mask.Q], v[:, :, i * mask.Q:(i + 1) * mask.Q]) for i in range(steps)]
            runs["explicit"] = lambda: explicit_ttt_attention(q, keys).sum().backward()
        for kernel, fn in runs.items():
            ms, peak = timed(fn, device, args.repeats)
            rows.append({"mask": name, "Q": mask.Q, "KV": mask.KV, "kernel": kernel, "ms": round(ms, 2),
                         "peak_bytes": peak})
            print(f"{name:14s} Q={mask.Q:6d} KV={mask.KV:6d} {kernel:8s} {ms:9.2f} ms"
                  + (f"  peak {peak / 2**20:.1f} MiB" if peak is not None else ""))
    result = {"machine": machine_info(), "settings": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def _step(kernel: str, q, k, v, mask) -> None:
    with train_attention(kernel):
        attend(q, k, v, mask).sum().backward()


if __name__ == "__main__":
    main()
