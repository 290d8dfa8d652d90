"""The protocol every drafter family's export adapter implements, and what the adapters share.

An adapter owns everything one drafter family needs to be served (torchtitan's per-model ``StateDictAdapter`` is the
pattern): it writes the engine's layout, checks a directory against that engine loader's transcription, loads an
export back into a drafter (reading only what the engine reads), says which engines it refuses and why, and writes
the serve command for the model card. ``serve/export.py`` looks the adapter up once, by the drafter's kind, and never
branches on the kind or the engine itself.

The shape of an adapter: a table with one row per engine (a frozen dataclass holding what that engine's loader reads:
config keys, tensor names and shapes, small functions for the parts that differ, its serve command), and where a
family has several kinds, a row per kind as well (``serve/eagle.py``'s ``KINDS``). The adapter looks the row up
once per call; its methods hold the steps every row shares and never branch on the engine or the kind. Refusals are
data too: ``refused`` maps (engine, kind) to the reason.

Adding an engine: its name in ``ENGINES`` and one row per adapter (an engine row, or a refusal with its reason).
Adding a drafter kind: one adapter file (or a subclass of its family's adapter: ``Medusa2Adapter``), listed in
``serve.export.ADAPTERS``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch
from safetensors.torch import load_file

from distill.teacher import DTYPES
from heads.base import TargetDims

log = logging.getLogger(__name__)

ENGINES = ("vllm", "sglang", "speculators", "hf")
SIDECAR = "specdraft_export.json"  # target identity and provenance, beside the engine's own files


class ExportAdapter(Protocol):
    """One drafter family's side of every engine. ``kinds``: the drafter kinds (``Drafter.name``) it serves;
    ``refused``: (engine, kind) -> why that engine cannot serve it, ``("*", kind)`` for every engine."""

    kinds: tuple[str, ...]
    refused: Mapping[tuple[str, str], str]
    needs_training: bool  # an untrained drafter of this family is refused (a draft LM is usable as it comes)

    def supports(self, engine: str, kind: str) -> bool:
        """Whether the adapter has a row for ``engine`` (what its loader reads); every engine in ``ENGINES`` is
        either supported or refused, never neither."""

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        """Fill ``out`` (a temporary directory, swapped in as ``output_dir``) with the engine's files."""

    def sidecar(self, drafter) -> dict[str, Any]:
        """Extra provenance the sidecar records for this family (may be empty)."""

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        """Every way ``path`` (whose config.json is ``config``) departs from what the engine's loader reads."""

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        """A drafter rebuilt from the export's engine-facing files only, not yet bound to a target."""

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        """The model card (README.md), with the command that serves the export."""


def refusal(adapter: ExportAdapter, engine: str, kind: str) -> str | None:
    return adapter.refused.get((engine, kind)) or adapter.refused.get(("*", kind))


# --- what every adapter reads about the target -------------------------------------------------------------------


def target_dtype(config: dict) -> torch.dtype:
    """The dtype the target was trained against (target.dtype): heads are served in the target's dtype."""
    return DTYPES[(config.get("target_config") or {}).get("dtype", "float32")]


def serve_name(config: dict) -> str:
    """What a serving engine can resolve as the target: the hub id, or for the embedded toy target the local
    directory it is cached in (``specdraft/tiny-stdlib`` names no hub repository)."""
    target_cfg = config.get("target_config") or {}
    if target_cfg.get("source") == "toy" and target_cfg.get("toy"):
        from distill.toy import toy_cache_path

        return str(toy_cache_path(target_cfg["toy"], target_cfg.get("cache_dir")).resolve())
    return str(target_cfg.get("name") or config.get("target", {}).get("name"))


def target_facts(config: dict) -> dict:
    """model_type (the engines whitelist EAGLE-3 targets by it), architecture and max_positions (the drafter's
    config must not cap the served context below the target's) of the target, read from its config.json when it
    can be resolved here (a local dir, or the hub cache); the toy target is a Llama."""
    target_cfg = config.get("target_config") or {}
    if target_cfg.get("source") == "toy":
        return {"model_type": "llama", "architecture": "LlamaForCausalLM",
                "max_positions": (target_cfg.get("toy") or {}).get("max_seq_len")}
    recorded = {"model_type": (config.get("target") or {}).get("model_type")}  # saved by training (older drafters lack it)
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(target_cfg.get("name"), revision=target_cfg.get("revision"))
    except (OSError, ValueError, TypeError) as e:
        if recorded["model_type"] is None:
            log.warning("could not read the target's config (%s): its model family is not checked against the "
                        "engines' EAGLE support, and the drafter config says max_position_embeddings=4096", e)
        return recorded
    return {"model_type": hf.model_type, "architecture": (hf.architectures or [None])[0],
            "max_positions": getattr(hf, "max_position_embeddings", None)}


# --- files the adapters share --------------------------------------------------------------------------------------


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".pt":  # FasterDecoding's torch.save'd dict of tensors: weights only, no code
        return torch.load(path, map_location="cpu", weights_only=True)
    return load_file(str(path))


def vocab_problem(size: Any, target: dict) -> list[str]:
    """The export's vocabulary against the target's (when the target is known)."""
    if target and size != target.get("vocab_size"):
        return [f"vocab_size={size} differs from the target's {target.get('vocab_size')}"]
    return []


def check_hf_model(path: Path, config: dict, target: dict) -> list[str]:
    """A plain HF causal LM: loading it as transformers does (its checkpoint-name conversions included: GPT-NeoX's
    ``embed_out``, MoE experts saved one by one) must leave no tensor missing, unexpected or mis-shaped."""
    from transformers import AutoModelForCausalLM

    problems = [f"config.json lacks {key}" for key in ("architectures", "model_type", "vocab_size") if key not in config]
    problems += vocab_problem(config.get("vocab_size"), target)
    files = sorted(path.glob("*.safetensors"))
    if problems or not files:
        return problems + ([] if files else [f"{path} has no *.safetensors weights"])
    try:
        _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    except (RuntimeError, ValueError, OSError) as e:  # e.g. MoE experts that cannot be fused back: not loadable
        return problems + [f"transformers cannot load it: {e}"]
    name = config["architectures"][0]
    problems += [f"tensor {k!r} is not part of {name}" for k in sorted(info.get("unexpected_keys") or [])]
    problems += [f"tensor {k!r} is missing" for k in sorted(info.get("missing_keys") or [])]
    problems += [f"tensor {m[0] if isinstance(m, (tuple, list)) else m!r} has the wrong shape"
                 for m in sorted(info.get("mismatched_keys") or [], key=str)]
    return problems
