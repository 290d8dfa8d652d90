"""Whether a device computes bf16 natively.

"bf16 where the device supports it" (``trainer.bf16``, the toy target's ``autocast_bf16``, ``eval.drafter_dtype=auto``)
asks this: elsewhere bf16 is emulated, and a CPU without AVX512-BF16 / AMX runs a bf16-autocast training step many
times slower than in float32 (about 30x for the toy's), with no memory to save that matters on a CPU.
"""

from __future__ import annotations

import torch


def native_bf16(device: torch.device | str) -> bool:
    """True on a CUDA GPU that reports bf16 support, a CPU whose oneDNN build has bf16 kernels for it, and other
    accelerators (left to their own autocast); False on a CPU that would emulate it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a private op: absent from some builds
            return False
    return True
