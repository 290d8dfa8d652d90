"""``target.toy``: the toy target's architecture and pretraining budget, and its one validator.

The dataclass is the schema: the field types are what ``ToyTargetConfig.__post_init__`` checks (Hydra's ConfigStore
registers the same class through ``distill.teacher.TargetConfig``), so the two cannot drift. The check is stricter
than OmegaConf's coercion on purpose: a hand-written dict with ``steps="5"`` or ``autocast_bf16=1`` is a typo.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

# Positive integers / floats; vocab_size has its own floor below.
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "max_seq_len", "steps",
             "batch_size", "lr")
_MIN_VOCAB = 258  # the 256 byte tokens plus the 2 special tokens


@dataclass
class ToyTargetConfig:
    """``target.toy``: the toy target's architecture and pretraining budget (in steps, not minutes)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    max_seq_len: int = 256
    steps: int = 2000
    batch_size: int = 8
    lr: float = 4e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    corpus_max_bytes: Optional[int] = None
    autocast_bf16: bool = True  # only where the build device computes bf16 natively (else float32: distill.precision)

    def __post_init__(self) -> None:
        for key, (types, nullable) in _field_types().items():
            setattr(self, key, _checked(key, getattr(self, key), types, nullable))
        self._check_ranges()

    def _check_ranges(self) -> None:
        for key in _POSITIVE:
            if getattr(self, key) <= 0:
                raise ValueError(f"target.toy.{key}={getattr(self, key)!r} must be > 0")
        if self.vocab_size < _MIN_VOCAB:
            raise ValueError(f"target.toy.vocab_size={self.vocab_size} is below {_MIN_VOCAB}, the 256 byte tokens plus "
                             "2 special tokens; raise it")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"target.toy.hidden_size={self.hidden_size} is not divisible by target.toy.num_heads="
                             f"{self.num_heads}; pick a head count that divides it")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"target.toy.warmup_steps={self.warmup_steps} must be in [0, steps={self.steps}]")


def _field_types() -> dict[str, tuple[tuple[type, ...], bool]]:
    """field -> (accepted types, whether None is allowed), read off the dataclass's annotations. A float field also
    takes an int (``lr=1``)."""
    hints = typing.get_type_hints(ToyTargetConfig)
    out = {}
    for f in dataclasses.fields(ToyTargetConfig):
        args = typing.get_args(hints[f.name])
        base = next((a for a in args if a is not type(None)), hints[f.name])
        out[f.name] = ((int, float) if base is float else (base,), type(None) in args)
    return out


def _checked(key: str, value: Any, types: tuple[type, ...], nullable: bool) -> Any:
    if value is None and nullable:
        return None
    # isinstance(True, int) holds, and a bool step count is surely a typo: bools pass only where bool is the type.
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
        raise ValueError(f"target.toy.{key}={value!r} has type {type(value).__name__}; set it to a {names}")
    return float(value) if float in types else value  # so lr=1 and lr=1.0 share one cache key


DEFAULT_TOY_CFG: dict[str, Any] = asdict(ToyTargetConfig())


def toy_config(toy_cfg: Mapping[str, Any] | ToyTargetConfig) -> ToyTargetConfig:
    """The validated config for ``toy_cfg`` (a plain dict, an OmegaConf node or a ``ToyTargetConfig``): every key
    must be given (the cache key covers them all); unknown keys are ignored with a warning."""
    if isinstance(toy_cfg, ToyTargetConfig):
        toy_cfg = asdict(toy_cfg)  # re-checked: a field may have been set after construction
    names = list(DEFAULT_TOY_CFG)
    for key in names:
        if key not in toy_cfg:
            raise ValueError(f"missing config key target.toy.{key}; add it (default: {DEFAULT_TOY_CFG[key]!r})")
    extra = sorted(set(toy_cfg) - set(names))
    if extra:
        logger.warning("ignoring unknown keys target.toy.%s", ", target.toy.".join(extra))
    return ToyTargetConfig(**{key: toy_cfg[key] for key in names})
