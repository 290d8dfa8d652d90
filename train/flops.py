"""Achieved TFLOP/s and MFU of a training run: per micro-batch FLOPs from shapes (each drafter's ``train_flops``,
``distill.flops``), and the accelerator's dense bf16 peak.

MFU = model FLOPs per second / (world size x the peak). Model FLOPs count attention only where the mask lets a
query see a key, with no recomputation (``distill.flops``): the work the step needs, whatever kernel runs it. The
``dense`` figure (every attention call's whole product) is what a profiler's FLOP counter shows; it is not logged.
"""

from __future__ import annotations

import logging
import re
from typing import Callable

import torch
from torch import Tensor

from distill.flops import StepFlops, TargetShape

log = logging.getLogger(__name__)

# Dense (not 2:4-sparse) bf16 tensor-core peaks in TFLOP/s, from each vendor's spec sheet (sheets list the sparse
# figure, 2x these, beside or instead of them). Matched in order on torch.cuda.get_device_name(), case-insensitive.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"h100.*pcie", 756.0),  # NVIDIA H100 datasheet: PCIe 1,513 sparse
    (r"h100.*nvl", 835.0),  # H100 NVL: 1,671 sparse
    (r"h100|gh200", 989.0),  # H100 SXM5 (device name "H100 80GB HBM3"), GH200: 1,979 sparse
    (r"h200", 989.0),  # NVIDIA H200 datasheet: 1,979 sparse
    (r"h800.*pcie", 756.0),  # H800: the H100's compute with a narrower interconnect
    (r"h800", 989.0),
    (r"h20\b", 148.0),  # NVIDIA H20: 296 sparse
    (r"b200", 2250.0),  # NVIDIA HGX B200: 4.5 PFLOPS sparse per GPU
    (r"a100|a800", 312.0),  # NVIDIA A100 datasheet: 624 sparse
    (r"a10g?\b", 125.0),  # NVIDIA A10 datasheet: 250 sparse (AWS's A10G has no NVIDIA sheet; may run lower)
    (r"l40s", 362.0),  # NVIDIA L40S datasheet: 733 sparse
    (r"l40\b", 181.0),  # NVIDIA L40 datasheet: 362 sparse
    (r"\bl4\b", 121.0),  # NVIDIA L4 datasheet: 242 sparse
    (r"4090", 165.2),  # Ada whitepaper: RTX 4090 BF16 with FP32 accumulate, 330.4 sparse
    (r"mi300x|mi325x", 1307.4),  # AMD Instinct MI300X / MI325X spec: 2,614.9 with sparsity
    (r"mi250x", 383.0),  # AMD Instinct MI250X spec
)


def device_peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The dense bf16 peak per device (``trainer.peak_tflops`` when set); None on a CPU or an unlisted accelerator,
    where MFU is then not logged."""
    if override is not None:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, peak in PEAK_TFLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            return peak
    log.info("no bf16 peak is listed for %r: perf/mfu is not logged; set trainer.peak_tflops to log it", name)
    return None


class FlopMeter:
    """The FLOPs this rank has run since the last logging step and since the start, one Python float per micro-batch:
    the count is made once per batch shape and drafter stage (shapes are static in a run) and never touches a
    tensor's values, so it adds no device sync; ranks' counts are summed on logging steps only."""

    def __init__(self, drafter, teacher, world_size: int, peak_tflops: float | None):
        self.drafter, self.teacher, self.world_size, self.peak = drafter, teacher, world_size, peak_tflops
        self._target: TargetShape | None = None  # read on the first batch, once the drafter is bound (LoRA inside)
        self._counts: dict[tuple, StepFlops | None] = {}
        self.window = self.run = self.run_teacher = 0.0  # model FLOPs: since the last logging step, since the start
        self._counted = True

    def add(self, batch) -> None:
        """Count one micro-batch (its [B, T] shape only)."""
        if not self._counted:
            return
        B, T = batch["input_ids"].shape
        key = (B, T, *self.drafter.flops_stage)
        if key not in self._counts:
            if self._target is None:
                try:
                    self._target = TargetShape.of(self.teacher)
                except ValueError as e:  # a target whose layers cannot be found: train on, without the figures
                    log.warning("perf/tflops and perf/mfu are not logged: %s", e)
                    self._counted = False
                    return
            self._counts[key] = self.drafter.train_flops(self._target, B, T)
        step = self._counts[key]
        if step is None:
            self._counted = False
            return
        model = step.total.model
        self.window += model
        self.run += model
        self.run_teacher += step.teacher.model

    def metrics(self, window_s: float, run_s: float, all_reduce_sum: Callable[[Tensor], Tensor],
                device: torch.device) -> dict:
        """``perf/tflops`` (model TFLOP/s of all ranks over the window), ``perf/mfu`` (its fraction of world size x
        peak, where a peak is known), their run means (``*_mean``) and the teacher's share of the run's FLOPs; resets
        the window. ``all_reduce_sum``: the engine's, a collective every rank calls (a logging step's)."""
        if not self._counted:
            return {}
        sums = all_reduce_sum(torch.tensor([self.window, self.run, self.run_teacher], dtype=torch.float64,
                                           device=device)).tolist()
        window, run, teacher = sums
        out = {"perf/tflops": window / max(window_s, 1e-9) / 1e12, "perf/tflops_mean": run / max(run_s, 1e-9) / 1e12,
               "perf/teacher_flops_share": teacher / max(run, 1.0)}
        if self.peak:
            out["perf/mfu"] = out["perf/tflops"] / (self.world_size * self.peak)
            out["perf/mfu_mean"] = out["perf/tflops_mean"] / (self.world_size * self.peak)
        self.window = 0.0
        return out
