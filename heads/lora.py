"""LoRA through ``peft``, shared by the draft model (``drafter.lora``) and Medusa-2 (LoRA on the target).

A LoRA spec is a plain mapping in yaml::

    lora:
      r: 8                 # rank
      alpha: 16            # scale = alpha / r
      dropout: 0.0
      target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]

``lora_config(spec, key)`` checks it (errors name ``key``, the bad value and the fix) and returns a
``peft.LoraConfig``; ``peft`` is imported only when a spec is used.
"""

from __future__ import annotations

from typing import Any, Mapping

LLAMA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULTS: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": list(LLAMA_MODULES)}


def check_lora_spec(spec: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``spec`` merged over the defaults; unknown keys and out-of-range values are refused, naming ``key``."""
    unknown = sorted(set(spec) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"{key} has unknown keys {unknown}; valid: {sorted(DEFAULTS)}")
    full = {**DEFAULTS, **dict(spec)}
    if not isinstance(full["r"], int) or full["r"] < 1:
        raise ValueError(f"{key}.r={full['r']!r} must be an integer >= 1 (the LoRA rank), e.g. {key}.r=8")
    if not full["alpha"] > 0:
        raise ValueError(f"{key}.alpha={full['alpha']!r} must be > 0 (LoRA scale = alpha / r), e.g. {key}.alpha=16")
    if not 0 <= full["dropout"] < 1:
        raise ValueError(f"{key}.dropout={full['dropout']!r} must lie in [0, 1)")
    modules = full["target_modules"]
    if isinstance(modules, str):
        modules = [modules]
    if not modules:
        raise ValueError(f"{key}.target_modules is empty; name the Linear layers to adapt, e.g. {list(LLAMA_MODULES)}")
    full["target_modules"] = list(modules)
    return full


def lora_config(spec: Mapping[str, Any], key: str):
    """A ``peft.LoraConfig`` for ``spec`` (see ``check_lora_spec``)."""
    from peft import LoraConfig

    full = check_lora_spec(spec, key)
    return LoraConfig(r=full["r"], lora_alpha=full["alpha"], lora_dropout=full["dropout"],
                      target_modules=full["target_modules"], bias="none")


def check_targets_exist(model, spec: Mapping[str, Any], key: str) -> None:
    """Refuse a spec none of whose ``target_modules`` names a layer of ``model`` (peft's own error is generic)."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    wanted = check_lora_spec(spec, key)["target_modules"]
    if not set(wanted) & names:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise ValueError(f"{key}.target_modules={wanted} matches no layer of {type(model).__name__}; "
                         f"its Linear layers are named {linear}")
