"""DSpark's export adapter: DFlash's tensors and config (``serve.dflash``, the same rows per engine) plus the Markov
head (``markov_head.markov_w1`` [V, r], ``markov_head.markov_w2`` [V, r]: the full vocabulary, as the lm_head the
engines share) and the confidence head (``confidence_head.proj.weight`` [1, D (+ r)], ``confidence_head.proj.bias``
[1]), and the DSpark fields each engine reads:

    vllm         ``method: dspark`` (``vllm/model_executor/models/qwen3_dspark.py``: ``Qwen3DSparkForCausalLM``,
                 registered as ``Qwen3DSparkModel``): DFlash's z-lab config plus ``markov_rank``, ``draft_vocab_size``
                 (W2's rows), ``enable_confidence_head``, ``confidence_head_with_markov`` (a biased ``proj``) and
                 ``sample_from_anchor: false``: its DSpark speculator reads the block layout from the draft config
                 and defaults to DeepSpec's (slot k predicts anchor + k + 1); specdraft trains DFlash's (slot k
                 predicts anchor + k, the anchor a bonus token). Its loader prefixes ``model.`` to every name.
    speculators  vllm-project/speculators' ``DSparkSpeculatorConfig`` (``speculators/models/dspark/config.py``):
                 DFlash's speculators fields with ``speculators_model_type: dspark`` and the same DSpark fields;
                 vLLM serves it with the same model.
    sglang       refused: ``python/sglang/srt/models/dspark.py`` drafts in DeepSpec's layout only and refuses
                 speculators-layout checkpoints; a specdraft DSpark would be read one slot early there.

The Markov head is exported as the ``vanilla`` kind (the bias of the previous token alone), the only one specdraft
trains. Each engine is one ``DSparkEngine`` row over its DFlash row; ``check`` runs DFlash's transcription on the
backbone tensors and checks the heads' tensors and fields against what the loader builds from them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from heads.base import TargetDims
from heads.dspark.model import DSparkDrafter
from serve.adapter import read_weights
from serve.dflash import ENGINES as DFLASH_ENGINES
from serve.dflash import DFlashAdapter, DFlashEngine, _layer_problems, as_zlab
from serve.model_card import model_card

HEADS = ("markov_head.", "confidence_head.")
# What make vllm-check meets: vLLM's DSpark speculator lives in its model runner V2 (CUDA, Triton); on a CPU vLLM runs
# the V1 runner, which refuses the method at start-up.
VLLM_RUNNER_NOTE = ("vLLM serves `method: dspark` on its model runner V2 only (a CUDA GPU with Triton): vLLM 0.32.0 on "
                    "a CPU (the V1 runner) refuses it at start-up with \"Model Runner V1 does not support: dspark "
                    "speculative decoding\": measure its served acceptance on a GPU (`python -m eval drafter_path=... "
                    "eval.engine=vllm`).")
LAYOUT = ("DFlash's (sample_from_anchor: false): slot k predicts anchor + k; SGLang's DSpark drafts in DeepSpec's "
          "layout (slot k predicts anchor + k + 1) and refuses speculators-layout checkpoints")


def dspark_fields(drafter: DSparkDrafter) -> dict[str, Any]:
    """The DSpark keys vLLM's and speculators' DSpark configs read."""
    if drafter.markov_head is None:
        raise ValueError("drafter.markov_rank=0: vLLM's and speculators' DSpark drafts need the Markov head "
                         "(markov_rank > 0); retrain with drafter.markov_rank > 0, or train drafter=dflash")
    return {"markov_rank": drafter.markov_rank, "markov_head_type": "vanilla",
            "draft_vocab_size": drafter.dims.vocab_size,
            "enable_confidence_head": drafter.confidence_head is not None,
            "confidence_head_with_markov": drafter.confidence_with_markov, "sample_from_anchor": False}


def _vllm_serve(target: str, export_dir: str, num_tokens: int) -> str:
    spec = {"method": "dspark", "model": export_dir, "num_speculative_tokens": num_tokens}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def _speculators_serve(target: str, export_dir: str, num_tokens: int) -> str:
    return f"vllm serve {export_dir}   # or, explicitly:\n" + _vllm_serve(target, export_dir, num_tokens)


def _vllm_config(config: dict, drafter: DSparkDrafter) -> dict:
    return {**config, "architectures": ["Qwen3DSparkModel"], **dspark_fields(drafter)}


def _speculators_config(config: dict, drafter: DSparkDrafter) -> dict:
    spec = {**config["speculators_config"], "algorithm": "dspark"}
    return {**config, "architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark",
            **dspark_fields(drafter), "speculators_config": spec}


def _speculators_type(config: dict) -> list[str]:
    if config.get("speculators_model_type") != "dspark":
        return [f"speculators_model_type={config.get('speculators_model_type')!r}, speculators' DSpark config "
                f"registers 'dspark'"]
    return []


def _as_dflash(config: dict, row: DFlashEngine) -> dict:
    """The DFlash view of a DSpark config: what ``serve.dflash``'s transcription of the same loader reads."""
    view = {**config, "architectures": [row.architecture]}
    if "speculators_model_type" in view:
        view["speculators_model_type"] = "dflash"
        view["speculators_config"] = {**view.get("speculators_config", {}), "algorithm": "dflash"}
    return view


def head_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The Markov and confidence tensors the engines build from ``config``."""
    view = as_zlab(config)
    V, D, r = view["vocab_size"], view["hidden_size"], config["markov_rank"]
    shapes = {"markov_head.markov_w1.weight": (V, r),
              "markov_head.markov_w2.weight": (config.get("draft_vocab_size") or V, r)}
    if config.get("enable_confidence_head"):
        width = D + (r if config.get("confidence_head_with_markov") else 0)
        shapes.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return shapes


def field_problems(config: dict) -> list[str]:
    problems = []
    rank = config.get("markov_rank")
    if not isinstance(rank, int) or rank < 1:
        problems.append(f"markov_rank={rank!r}: the engines' DSpark drafts need a Markov head (an integer >= 1)")
    if config.get("markov_head_type", "vanilla") != "vanilla":
        problems.append(f"markov_head_type={config.get('markov_head_type')!r}: specdraft exports the vanilla head")
    if config.get("sample_from_anchor") is not False:
        problems.append(f"sample_from_anchor={config.get('sample_from_anchor')!r} must be false: the engines default "
                        f"to DeepSpec's layout, and this drafter was trained in {LAYOUT.split(';')[0]}")
    if config.get("draft_vocab_size") not in (None, as_zlab(config).get("vocab_size")):
        problems.append(f"draft_vocab_size={config.get('draft_vocab_size')}: a reduced vocabulary needs lm_head and "
                        f"d2t tensors the export does not carry")
    if config.get("confidence_head_with_markov") and not config.get("enable_confidence_head"):
        problems.append("confidence_head_with_markov=true without enable_confidence_head")
    return problems


def tensor_problems(state: dict[str, torch.Tensor], config: dict) -> list[str]:
    want = head_shapes(config)
    heads = {k: v for k, v in state.items() if k.startswith(HEADS)}
    return ([f"tensor {k!r} is missing" for k in sorted(set(want) - set(heads))]
            + [f"tensor {k!r} is not part of the DSpark heads the config describes"
               for k in sorted(set(heads) - set(want))]
            + [f"tensor {k!r} has shape {tuple(heads[k].shape)}, the loader builds {want[k]}"
               for k in sorted(set(want) & set(heads)) if tuple(heads[k].shape) != want[k]])


@dataclass(frozen=True)
class DSparkEngine:
    """One engine's DSpark loader: its DFlash row (the backbone), its DSpark config and its serve command."""

    dflash: DFlashEngine
    config: Callable[[dict, DSparkDrafter], dict]  # (the DFlash row's config, drafter) -> the DSpark config
    serve: Callable[[str, str, int], str]
    architecture: str
    format_problems: Callable[[dict], list[str]] = lambda config: []  # its format's own keys


ENGINES = {
    "vllm": DSparkEngine(DFLASH_ENGINES["vllm"], _vllm_config, _vllm_serve, "Qwen3DSparkModel"),
    "speculators": DSparkEngine(DFLASH_ENGINES["speculators"], _speculators_config, _speculators_serve,
                                "DSparkSpeculator", _speculators_type),
}


class DSparkAdapter:
    kinds = ("dspark",)
    needs_training = True
    refused = {("sglang", "dspark"): f"this drafter's block layout is {LAYOUT}; export with format=vllm or "
                                     f"speculators",
               ("hf", "dspark"): "DSpark has no Hugging Face reference model class; export with format=vllm or "
                                 "speculators"}
    engines = ENGINES

    def supports(self, engine: str, kind: str) -> bool:
        return engine in self.engines

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        dspark_fields(drafter)  # refuse before writing anything
        DFlashAdapter().write(out, drafter, engine, config, output_dir)  # the backbone and the heads' tensors
        written = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(self.engines[engine].config(written, drafter), indent=2))

    def sidecar(self, drafter) -> dict[str, Any]:
        # the engines schedule the block their own way; a reload here decodes with the drafter's own cut
        return {"confidence_threshold": drafter.confidence_threshold}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        row = self.engines[engine]
        problems = []
        if config.get("architectures") != [row.architecture]:
            problems.append(f"architectures={config.get('architectures')}, {engine}'s DSpark loader expects "
                            f"{[row.architecture]}")
        problems += row.format_problems(config) + field_problems(config)
        if problems:
            return problems
        view = _as_dflash(config, row.dflash)
        problems = row.dflash.config_problems(view) + _layer_problems(row.dflash, view, target)
        files = sorted(path.glob("*.safetensors"))
        if problems or not files:
            return problems + ([] if files else [f"{path} has no *.safetensors weights"])
        state = {k: v for f in files for k, v in read_weights(f).items()}
        backbone = {k: v for k, v in state.items() if not k.startswith(HEADS)}
        return row.dflash.tensor_problems(backbone, as_zlab(view)) + tensor_problems(state, config)

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        config = json.loads((path / "config.json").read_text())
        view = as_zlab(config)
        dflash = view["dflash_config"]
        theta = (view.get("rope_parameters") or {}).get("rope_theta", view.get("rope_theta", 1e6))
        window = view.get("sliding_window") if "sliding_attention" in (view.get("layer_types") or []) else None
        drafter = DSparkDrafter(dims, block_size=view["block_size"], num_layers=view["num_hidden_layers"],
                                layers=[i + 1 for i in dflash["target_layer_ids"]],
                                num_heads=view["num_attention_heads"], num_kv_heads=view["num_key_value_heads"],
                                intermediate_size=view["intermediate_size"], rope_theta=theta,
                                rms_norm_eps=view["rms_norm_eps"], mask_token_id=dflash["mask_token_id"],
                                sliding_window=window, markov_rank=config["markov_rank"],
                                confidence_head=bool(config.get("enable_confidence_head")),
                                confidence_with_markov=bool(config.get("confidence_head_with_markov")),
                                confidence_threshold=sidecar.get("confidence_threshold")
                                if config.get("enable_confidence_head") else None)
        state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in read_weights(f).items()}
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
        return drafter

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return self.engines[engine].serve(target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        tokens = drafter.get("depth") or (drafter.get("block_size") or 16) - 1
        line = self.serve_command(engine, kind, serve_target, str(output_dir), tokens)
        return model_card(engine, kind, config, report, line, [VLLM_RUNNER_NOTE, ""] if engine != "sglang" else [])
