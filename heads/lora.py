"""LoRA through ``peft``, shared by the draft model (``drafter.lora``) and Medusa-2 (LoRA on the target).

A LoRA spec is a plain mapping in yaml::

    lora:
      r: 8                 # rank
      alpha: 16            # scale = alpha / r
      dropout: 0.0
      target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]

``lora_config(spec, key)`` checks it (errors name ``key``, the bad value and the fix) and returns a
``peft.LoraConfig``; ``peft`` is imported only when a spec is used. For adapters living inside a model (Medusa-2):
``inject_lora`` wraps its layers in place, ``remove_lora`` unwraps them (merging first if asked), ``save_peft_adapter``
writes PEFT's directory format; ``distill.teacher.adapters_disabled`` switches them off for a while.
"""

from __future__ import annotations

import sys
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


# --- adapters injected into a live model (Medusa-2: the target itself carries the LoRA) ----------------------------
# ``peft.inject_adapter_in_model`` wraps each targeted Linear in place (``base_layer`` + ``lora_A`` / ``lora_B``), so
# no copy of the model's weights is made; the helpers below find those wrappers, take them out again (optionally
# merging them into the base weights first) and write the adapter in PEFT's own on-disk format.

ADAPTER = "default"  # peft's adapter name; one adapter per model here


def lora_layers(model) -> dict:
    """Module path -> peft tuner layer, for every adapter wrapper currently in ``model`` (empty without peft)."""
    if "peft" not in sys.modules:  # nothing can have injected one
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def inject_lora(model, spec: Mapping[str, Any], key: str) -> dict:
    """Wrap ``model``'s ``spec.target_modules`` Linear layers with LoRA in place; returns ``lora_layers(model)``.

    Refused, naming ``key.target_modules`` and leaving the model as it was: the output embedding (in tied models
    merging into it would also move the input embedding) and layers that are not plain Linear."""
    from peft import inject_adapter_in_model
    from torch import nn

    if lora_layers(model):
        raise ValueError(f"{key}: the model already carries LoRA adapters; remove them first (heads.lora.remove_lora)")
    check_targets_exist(model, spec, key)
    wanted = check_lora_spec(spec, key)["target_modules"]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is output and name} & set(wanted))
    if head:
        raise ValueError(f"{key}.target_modules={wanted} names the output embedding {head}; a LoRA merged into it "
                         f"would also move the tied input embedding. Name the decoder's projections, e.g. "
                         f"{list(LLAMA_MODULES)}")
    inject_adapter_in_model(lora_config(spec, key), model, adapter_name=ADAPTER)
    layers = lora_layers(model)
    bad = sorted(name for name, m in layers.items() if type(m.get_base_layer()) is not nn.Linear)
    if bad:
        remove_lora(model, merge=False)
        raise ValueError(f"{key}.target_modules={wanted} wraps {bad}, which are not plain Linear layers; name the "
                         f"decoder's projections, e.g. {list(LLAMA_MODULES)}")
    return layers


def remove_lora(model, merge: bool) -> int:
    """Take every LoRA wrapper out of ``model`` in place, putting its base layer back; with ``merge``, first add
    ``B @ A * scale`` into the base weight (peft's own merge, NaN-checked), so the model computes what the adapted
    one did. Returns how many layers were unwrapped."""
    layers = lora_layers(model)
    for name, layer in layers.items():
        if merge:
            layer.merge(safe_merge=True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    if "peft_config" in vars(model):  # inject_adapter_in_model leaves its config on the model; a plain model has none
        del model.peft_config
    return len(layers)


def save_peft_adapter(path, spec: Mapping[str, Any], key: str, weights: Mapping[str, tuple],
                      base_model: str | None) -> None:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
    ``peft.PeftModel.from_pretrained(base, path)`` loads. ``weights``: module path in the causal LM (e.g.
    ``model.layers.0.self_attn.q_proj``) -> (A [r, in], B [out, r])."""
    from pathlib import Path

    from distill.atomic import save_tensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = lora_config(spec, key)
    config.task_type = "CAUSAL_LM"
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(path))
    # PeftModel names a parameter base_model.model.<path>.lora_A.<adapter>.weight; the file drops the adapter name.
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().contiguous().cpu()
    save_tensors(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
