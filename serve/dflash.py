"""DFlash's export adapter: vLLM (``method: dflash``) reads a z-lab style checkpoint: a Qwen3-style draft config
with ``block_size``, ``num_target_layers`` and ``dflash_config`` (``target_layer_ids``: 0-based target layers whose
outputs it captures, i.e. our hidden-state index - 1, which vLLM turns back into aux layer ids by adding 1;
``mask_token_id``), and safetensors named as the draft's modules (``fc``, ``hidden_norm``, ``layers.i.self_attn.
{q,k,v,o}_proj / q_norm / k_norm``, ``layers.i.{input,post_attention}_layernorm``, ``layers.i.mlp.{gate,up,down}_proj``,
``norm``; vLLM's loader prefixes ``model.`` and stacks q/k/v and gate/up itself). No embedding or lm_head: the
engine shares the target's, as the drafter does. ``check`` is a transcription of what that loader builds from the
config (``vllm/model_executor/models/qwen3_dflash.py``): every tensor, its shape, and the config fields it reads.

SGLang (``DFLASH``) and the speculators format are refused until their loaders are transcribed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from heads.base import TargetDims
from heads.dflash import DFlashDrafter
from serve.adapter import read_weights, target_dtype, target_facts, vocab_problem
from serve.eagle import SCALED_EMBEDDING_FAMILIES
from serve.model_card import model_card

WEIGHTS = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"


def _vllm_serve(target: str, export_dir: str, num_tokens: int) -> str:
    spec = {"method": "dflash", "model": export_dir, "num_speculative_tokens": num_tokens}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def engine_config(drafter: DFlashDrafter, dtype: str, max_positions: int | None) -> dict[str, Any]:
    D, V, L = drafter.dims.hidden_size, drafter.dims.vocab_size, drafter.dims.num_layers
    attn = drafter.layers[0].self_attn
    theta = attn.theta
    window = {}
    if drafter.sliding_window is not None:
        # vLLM takes a sliding-window DFlash layer as causal unless dflash_config.causal says otherwise
        window = {"layer_types": ["sliding_attention"] * len(drafter.layers), "sliding_window": drafter.sliding_window,
                  "use_sliding_window": True}
    return {**window,
        "architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": D, "vocab_size": V,
        "intermediate_size": drafter.layers[0].mlp.gate_proj.out_features,
        "num_hidden_layers": len(drafter.layers), "num_attention_heads": attn.h, "num_key_value_heads": attn.g,
        "head_dim": attn.hd, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "rms_norm_eps": drafter.norm.eps, "rope_theta": theta, "rope_parameters": {"rope_type": "default",
                                                                                   "rope_theta": theta},
        "max_position_embeddings": max_positions or 4096, "torch_dtype": dtype,
        "block_size": drafter.block_size, "num_target_layers": L,
        "dflash_config": {"target_layer_ids": [i - 1 for i in drafter.teacher_layers],
                          "mask_token_id": drafter.mask_token_id,
                          **({"causal": False} if window else {})},
    }


def engine_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor vLLM's DFlash draft builds from ``config`` (names as in the checkpoint), with its shape."""
    D, H, G = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or D // H
    inter = config["intermediate_size"]
    shapes = {"fc.weight": (D, D * len(config["dflash_config"]["target_layer_ids"])), "hidden_norm.weight": (D,),
              "norm.weight": (D,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (G * hd, D),
            p + "self_attn.v_proj.weight": (G * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, D), p + "mlp.up_proj.weight": (inter, D),
            p + "mlp.down_proj.weight": (D, inter)})
    return shapes


class DFlashAdapter:
    kinds = ("dflash",)
    needs_training = True
    refused = {("sglang", "dflash"): "SGLang's DFLASH loader is not transcribed in specdraft yet; export with "
                                     "format=vllm (vLLM method: dflash)",
               ("speculators", "dflash"): "specdraft writes DFlash in vLLM's (z-lab) layout only; export with "
                                          "format=vllm",
               ("hf", "dflash"): "DFlash has no Hugging Face reference model class; export with format=vllm"}

    def supports(self, engine: str, kind: str) -> bool:
        return engine == "vllm"

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        bad = [i for i in drafter.teacher_layers if not 1 <= i < drafter.dims.num_layers]
        if bad:
            raise ValueError(f"drafter.layers={list(drafter.teacher_layers)}: vLLM captures the outputs of decoder "
                             f"layers 1..{drafter.dims.num_layers - 1} (hidden-state indices), not {bad} (0: the "
                             f"embeddings, {drafter.dims.num_layers}: the final normed output); retrain with layers "
                             f"in that range to serve this drafter")
        dtype = target_dtype(config)
        facts = target_facts(config)
        model_type = facts.get("model_type")
        if model_type and any(name in model_type for name in SCALED_EMBEDDING_FAMILIES):
            raise ValueError(f"vLLM's DFlash draft embeds tokens with the raw embedding table and puts no soft-cap on "
                             f"the logits, while a {model_type!r} target's forward scales its embeddings by "
                             f"sqrt(hidden_size): the drafter was trained on the target's own read-outs, so the engine "
                             f"would feed it other inputs. Evaluate it with `python -m eval` instead")
        # d2t (drafter.draft_vocab_size) only narrows specdraft's own decoding; the engine drafts over every id
        state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items() if k != "d2t"}
        save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
        cfg = engine_config(drafter, str(dtype).removeprefix("torch."), facts.get("max_positions"))
        (out / "config.json").write_text(json.dumps(cfg, indent=2))

    def sidecar(self, drafter) -> dict[str, Any]:
        return {}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        need = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size", "block_size", "dflash_config")
        problems = [f"config.json lacks {key}" for key in need if key not in config]
        if problems:
            return problems
        if config["architectures"] != [ARCHITECTURE]:
            problems.append(f"architectures={config['architectures']}, vLLM's dflash method expects [{ARCHITECTURE!r}]")
        dflash = config["dflash_config"]
        ids = dflash.get("target_layer_ids")
        if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            problems.append(f"dflash_config.target_layer_ids={ids!r} must be a non-empty list of 0-based layers")
        elif target.get("num_layers") and max(ids) >= target["num_layers"] - 1:
            problems.append(f"dflash_config.target_layer_ids={ids} reaches the target's last layer or beyond")
        mask = dflash.get("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < config["vocab_size"]:
            problems.append(f"dflash_config.mask_token_id={mask!r} is not a token id of the vocabulary")
        types = config.get("layer_types")
        if types is not None:
            if types != ["sliding_attention"] * config["num_hidden_layers"]:
                problems.append(f"layer_types={types}: specdraft's DFlash layers are all full or all sliding_attention")
            if not isinstance(config.get("sliding_window"), int):
                problems.append("sliding_attention layers need an integer sliding_window (vLLM refuses to start)")
            if dflash.get("causal") is not False:
                problems.append("dflash_config.causal must be false: vLLM runs sliding_attention DFlash layers "
                                "causally otherwise, and the block was trained non-causal")
        if not isinstance(config["block_size"], int) or config["block_size"] < 2:
            problems.append(f"block_size={config['block_size']!r} must be an integer >= 2")
        problems += vocab_problem(config["vocab_size"], target)
        if problems:
            return problems
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return [f"{path} has no *.safetensors weights"]
        state = {k: v for f in files for k, v in read_weights(f).items()}
        want = engine_shapes(config)
        problems += [f"tensor {k!r} is missing" for k in sorted(set(want) - set(state))]
        problems += [f"tensor {k!r} is not part of vLLM's DFlash draft" for k in sorted(set(state) - set(want))]
        problems += [f"tensor {k!r} has shape {tuple(state[k].shape)}, vLLM builds {want[k]}"
                     for k in sorted(set(want) & set(state)) if tuple(state[k].shape) != want[k]]
        return problems

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        config = json.loads((path / "config.json").read_text())
        dflash = config["dflash_config"]
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 1e6))
        drafter = DFlashDrafter(dims, block_size=config["block_size"], num_layers=config["num_hidden_layers"],
                                layers=[i + 1 for i in dflash["target_layer_ids"]],
                                num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                                intermediate_size=config["intermediate_size"], rope_theta=theta,
                                rms_norm_eps=config["rms_norm_eps"], mask_token_id=dflash["mask_token_id"],
                                sliding_window=config.get("sliding_window") if config.get("layer_types") else None)
        state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in read_weights(f).items()}
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
        return drafter

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return _vllm_serve(target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        tokens = drafter.get("depth") or (drafter.get("block_size") or 16) - 1
        line = self.serve_command(engine, kind, serve_target, str(output_dir), tokens)
        return model_card(engine, kind, config, report, line, [])
