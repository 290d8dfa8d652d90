"""DFlash2's export adapter: DFlash's tensors and config (``serve.dflash``, the same rows per engine) plus every layer's
block convolutions (``layers.i.{attention,mlp}_conv.base_kernel`` [2, K, D], ``...kernel_projection.weight``
[2 K D / G, D]) and the path selector (``candidate_selector.predecessor_codebook`` and ``.successor_codebook``
[V, r], ``candidate_selector.hidden_projection.weight`` [r, D]), the names of the published checkpoints, and the
fields each engine reads:

    vllm         ``method: dflash`` with ``architectures: [DFlash2DraftModel]``
                 (``vllm/model_executor/models/qwen3_dflash2.py``, ``DFlash2Qwen3ForCausalLM``): DFlash's z-lab
                 config, its ``dflash_config`` also holding ``conv_kernel_size``, ``conv_group_size``,
                 ``selector_rank`` and ``selector_top_k``; the codebooks are stored as plain tensors (no ``.weight``)
                 and every name is prefixed ``model.`` by its loader. vLLM's selector walk lives in its model runner
                 V2 (``v1/worker/gpu/spec_decode/dflash2``).
    speculators  vllm-project/speculators 0.9.0's ``DFlash2SpeculatorConfig`` (``speculators/models/dflash2``):
                 DFlash's speculators fields with ``speculators_model_type: dflash2``, ``architectures:
                 [DFlash2DraftModel]`` and the same four fields at the top level; vLLM's converter
                 (``transformers_utils/configs/speculators/algos.py``, ``update_dflash2``) maps it to the vllm layout.
    sglang       refused: SGLang's DFlash2 loader has not been transcribed here.

A drafter trained without convolutions (``conv: false``) or without the selector exports them as the identity the
modules start as (base kernels [1, 0] and zero projections; a zero hidden projection, under which the walk takes each
slot's top candidate), so the engines' DFlash2 model drafts what it drafts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from distill.atomic import save_tensors
from heads.base import TargetDims
from heads.dflash2.conv import BlockConv
from heads.dflash2.model import CandidateSelector, DFlash2Drafter
from serve.adapter import read_weights
from serve.dflash import ENGINES as DFLASH_ENGINES
from serve.dflash import WEIGHTS, DFlashAdapter, DFlashEngine, _layer_problems, as_zlab
from serve.model_card import model_card

ARCHITECTURE = "DFlash2DraftModel"
SELECTOR = "candidate_selector."
CODEBOOKS = ("predecessor_codebook", "successor_codebook")
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
VLLM_RUNNER_NOTE = ("vLLM walks DFlash2's selector in its model runner V2 (a CUDA GPU with Triton): vLLM 0.32.0 on a CPU "
                    "(the V1 runner) refuses the export at start-up with \"Model Runner V1 does not support: DFlash "
                    "candidate-head drafts\": measure its served acceptance on a GPU (`python -m eval drafter_path=... "
                    "eval.engine=vllm`).")


def dflash2_fields(drafter: DFlash2Drafter) -> dict[str, int]:
    conv = drafter.layers[0].attention_conv if drafter.conv else None
    sel = drafter.candidate_selector
    return {"conv_kernel_size": conv.kernel_size if conv else 2,
            "conv_group_size": conv.group_size if conv else _group_size(drafter.dims.hidden_size),
            "selector_rank": sel.hidden_projection.out_features if sel else 1,
            "selector_top_k": drafter.selector_top_k if sel else 1}


def _group_size(hidden: int) -> int:
    return 16 if hidden % 16 == 0 else 1


def engine_state(drafter: DFlash2Drafter) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the engines' names, the modules it was trained without as their identity."""
    state = {k: v for k, v in drafter.state_dict().items() if k != "d2t"}
    fields = dflash2_fields(drafter)
    D, V = drafter.dims.hidden_size, drafter.dims.vocab_size
    if not drafter.conv:
        identity = BlockConv(D, drafter.block_size, fields["conv_kernel_size"], fields["conv_group_size"]).state_dict()
        for i in range(len(drafter.layers)):
            for side in ("attention_conv", "mlp_conv"):
                state.update({f"layers.{i}.{side}.{k}": v.clone() for k, v in identity.items()})
    if drafter.candidate_selector is None:
        state.update({f"{SELECTOR}{k}": v for k, v in CandidateSelector(V, D, 1).state_dict().items()})
    for name in CODEBOOKS:  # the engines hold the codebooks as plain parameters
        state[f"{SELECTOR}{name}"] = state.pop(f"{SELECTOR}{name}.weight")
    return state


def _vllm_config(config: dict, drafter: DFlash2Drafter) -> dict:
    return {**config, "architectures": [ARCHITECTURE],
            "dflash_config": {**config["dflash_config"], **dflash2_fields(drafter)}}


def _speculators_config(config: dict, drafter: DFlash2Drafter) -> dict:
    spec = {**config["speculators_config"], "algorithm": "dflash2"}
    return {**config, "architectures": [ARCHITECTURE], "speculators_model_type": "dflash2",
            **dflash2_fields(drafter), "speculators_config": spec}


def _vllm_fields(config: dict) -> dict:
    return config.get("dflash_config") or {}


def _speculators_problems(config: dict) -> list[str]:
    if config.get("speculators_model_type") != "dflash2":
        return [f"speculators_model_type={config.get('speculators_model_type')!r}, vLLM's speculators converter "
                f"registers 'dflash2'"]
    return []


def module_shapes(config: dict, fields: dict) -> dict[str, tuple[int, ...]]:
    """The convolution and selector tensors an engine builds from ``config`` and the DFlash2 ``fields``."""
    view = as_zlab(config)
    D, V, L = view["hidden_size"], view["vocab_size"], view["num_hidden_layers"]
    K, G, r = fields["conv_kernel_size"], D // fields["conv_group_size"], fields["selector_rank"]
    shapes = {f"{SELECTOR}{name}": (V, r) for name in CODEBOOKS}
    shapes[f"{SELECTOR}hidden_projection.weight"] = (r, D)
    for i in range(L):
        for side in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{side}.base_kernel"] = (2, K, D)
            shapes[f"layers.{i}.{side}.kernel_projection.weight"] = (2 * K * G, D)
    return shapes


def field_problems(fields: dict, config: dict) -> list[str]:
    D = as_zlab(config).get("hidden_size")
    problems = [f"{key}={fields.get(key)!r} must be an integer >= 1" for key in FIELDS
                if not isinstance(fields.get(key), int) or fields.get(key) < 1]
    if not problems and D % fields["conv_group_size"]:
        problems.append(f"conv_group_size={fields['conv_group_size']} does not divide hidden_size={D}")
    return problems


def _is_module(name: str) -> bool:
    return name.startswith(SELECTOR) or "_conv." in name


@dataclass(frozen=True)
class DFlash2Engine:
    """One engine's DFlash2 loader: its DFlash row (the backbone), its config, where it reads the DFlash2 fields."""

    dflash: DFlashEngine  # its serve command is DFlash's: the same method, the architecture in the config
    config: Callable[[dict, DFlash2Drafter], dict]
    architecture: str
    fields: Callable[[dict], dict]
    format_problems: Callable[[dict], list[str]] = lambda config: []


ENGINES = {
    "vllm": DFlash2Engine(DFLASH_ENGINES["vllm"], _vllm_config, ARCHITECTURE, _vllm_fields),
    "speculators": DFlash2Engine(DFLASH_ENGINES["speculators"], _speculators_config, ARCHITECTURE,
                                 lambda config: config, _speculators_problems),
}


class DFlash2Adapter:
    kinds = ("dflash2",)
    needs_training = True
    refused = {("sglang", "dflash2"): "SGLang's DFlash2 loader has not been transcribed here; export with "
                                      "format=vllm or speculators",
               ("hf", "dflash2"): "DFlash2 has no Hugging Face reference model class; export with format=vllm or "
                                  "speculators"}
    engines = ENGINES

    def supports(self, engine: str, kind: str) -> bool:
        return engine in self.engines

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        DFlashAdapter().write(out, drafter, engine, config, output_dir)  # the backbone, its config and its refusals
        dtype = next(iter(read_weights(out / WEIGHTS).values())).dtype
        state = {k: v.detach().to(dtype).contiguous() for k, v in engine_state(drafter).items()}
        save_tensors(state, out / WEIGHTS, metadata={"format": "pt"})
        written = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(self.engines[engine].config(written, drafter), indent=2))

    def sidecar(self, drafter) -> dict[str, Any]:
        # what the engines' model always has, and this drafter may have been trained without
        return {"conv": drafter.conv, "selector": drafter.candidate_selector is not None}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        row = self.engines[engine]
        problems = []
        if config.get("architectures") != [row.architecture]:
            problems.append(f"architectures={config.get('architectures')}, {engine}'s DFlash2 loader expects "
                            f"{[row.architecture]}")
        fields = row.fields(config)
        problems += row.format_problems(config) + field_problems(fields, config)
        if problems:
            return problems
        view = {**config, "architectures": [row.dflash.architecture]}
        if "speculators_model_type" in view:
            view["speculators_model_type"] = "dflash"
        problems = row.dflash.config_problems(view) + _layer_problems(row.dflash, view, target)
        files = sorted(path.glob("*.safetensors"))
        if problems or not files:
            return problems + ([] if files else [f"{path} has no *.safetensors weights"])
        state = {k: v for f in files for k, v in read_weights(f).items()}
        backbone = {k: v for k, v in state.items() if not _is_module(k)}
        want = module_shapes(view, fields)
        modules = {k: tuple(v.shape) for k, v in state.items() if _is_module(k)}
        return (row.dflash.tensor_problems(backbone, as_zlab(view))
                + [f"tensor {k!r} is missing" for k in sorted(set(want) - set(modules))]
                + [f"tensor {k!r} is not part of the DFlash2 modules the config describes"
                   for k in sorted(set(modules) - set(want))]
                + [f"tensor {k!r} has shape {modules[k]}, the loader builds {want[k]}"
                   for k in sorted(set(want) & set(modules)) if modules[k] != want[k]])

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        config = json.loads((path / "config.json").read_text())
        view = as_zlab(config)
        dflash = view["dflash_config"]
        fields = self.engines[engine].fields(config)
        theta = (view.get("rope_parameters") or {}).get("rope_theta", view.get("rope_theta", 1e6))
        window = view.get("sliding_window") if "sliding_attention" in (view.get("layer_types") or []) else None
        drafter = DFlash2Drafter(dims, block_size=view["block_size"], num_layers=view["num_hidden_layers"],
                                 layers=[i + 1 for i in dflash["target_layer_ids"]],
                                 num_heads=view["num_attention_heads"], num_kv_heads=view["num_key_value_heads"],
                                 intermediate_size=view["intermediate_size"], rope_theta=theta,
                                 rms_norm_eps=view["rms_norm_eps"], mask_token_id=dflash["mask_token_id"],
                                 sliding_window=window, conv_kernel_size=fields["conv_kernel_size"],
                                 conv_group_size=fields["conv_group_size"], selector_rank=fields["selector_rank"],
                                 selector_top_k=fields["selector_top_k"])
        state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in read_weights(f).items()}
        for name in CODEBOOKS:
            state[f"{SELECTOR}{name}.weight"] = state.pop(f"{SELECTOR}{name}")
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
        return drafter

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return self.engines[engine].dflash.serve(target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        tokens = drafter.get("depth") or (drafter.get("block_size") or 16) - 1
        line = self.serve_command(engine, kind, serve_target, str(output_dir), tokens)
        return model_card(engine, kind, config, report, line, [VLLM_RUNNER_NOTE, ""])
