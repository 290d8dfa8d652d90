"""32-bit integer hashing on tensors: random numbers as pure functions of a key, in fixed-shape int64 ops (no
generator state), so a recorded step replays fresh draws and every rank draws what one process would.

``mix32`` is a bijection of [0, 2^32) (xor-shift / multiply rounds with the constants of C. Wellons' lowbias32).
"""

from __future__ import annotations

from torch import Tensor

MASK32 = 0xFFFFFFFF


def mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x, c < 2**32 in int64 arithmetic without overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash with good avalanche, a bijection of [0, 2^32)."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)
