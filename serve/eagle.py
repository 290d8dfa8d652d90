"""EAGLE-1 / EAGLE-3 serving layouts: the tensors and config.json each engine's loader reads, a transcription of each
loader's name mapping (to prove that every engine parameter is set and no exported tensor is skipped), and the way
back from engine parameters to a specdraft drafter (to decode an export and compare it with the checkpoint).

Each engine is one ``EagleEngine`` row in ``ENGINES`` and each variant one ``EagleKind`` row in ``KINDS`` (its config
writer, its own tensors, the layers it is fed): adding an engine is one row, and no function branches on either.

Our drafter (heads/eagle/model.py) -> the engines' ``LlamaForCausalLM{Eagle,Eagle3}``:
    layer.{q,k,v,o}_proj          -> {P}self_attn.{q,k,v,o}_proj   (vLLM / SGLang pack q,k,v into qkv_proj on load)
    layer.{gate,up,down}_proj     -> {P}mlp.{gate,up,down}_proj     (gate,up packed into gate_up_proj on load)
    layer.post_attention_layernorm-> {P}post_attention_layernorm
    input_layernorm, hidden_norm  -> {P}input_layernorm, {P}hidden_norm   (EAGLE-3 only)
    fc, norm, lm_head             -> fc, norm, lm_head                      (norm / lm_head: EAGLE-3 only)
    d2t (absolute target ids)     -> d2t as OFFSETS: the engines compute target = draft + d2t[draft]
    t2d (draft index or -1)       -> t2d as bool (in the draft vocabulary or not)
{P} is ``midlayer.`` for vLLM / SGLang EAGLE-3 (SGLang names its one layer so; vLLM renames it to layers.0) and
``layers.0.`` for EAGLE-1 and the speculators format. Embeddings (and EAGLE-1's lm_head) are the target's: no engine
needs them in the export, so they are not written (both engines share the target's when absent).

EAGLE-3.1 and the draft attention window (EAGLE-3 and P-EAGLE; written only when set, so a plain export is unchanged):
    fc_norm.{i}, input_norm       -> fc_norm.{i}, input_norm   (vLLM: model.fc_norm.{i} / model.input_norm on load)
    fc_norm, norm_before_fc,      -> top-level config keys, where vLLM's Eagle3 model (and ``update_eagle3`` for the
    norm_output                      speculators format) and speculators' Eagle3SpeculatorConfig read them
    sliding_window W              -> the Llama config's ``layer_types: [sliding_attention, ...]`` and ``sliding_window``
                                     (vLLM's LlamaAttention per draft layer; speculators' transformer_layer_config)
A row lists the ones its engine carries (``eagle31``); another set on the drafter is refused with the reason.

Layer ids (EAGLE-3's ``eagle_aux_hidden_state_layer_ids``): our index i is HF ``hidden_states[i]``, the input of
0-based decoder layer i. vLLM and speculators capture "the input of layer i" for id i: the same number. SGLang's
``set_eagle3_layers_to_capture`` adds 1 to each id before capturing the input of that layer: it is written as i - 1.
Index L (the final, *normed* output) exists in no engine: each captures un-normed layer inputs, so it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from distill.atomic import save_tensors
from heads.base import TargetDims
from heads.eagle.model import EagleDrafter
from serve.adapter import serve_name, target_dtype, target_facts, vocab_problem
from serve.model_card import model_card

# vllm/config/speculative.py (SpeculativeConfig, ``eagle3_target_supported``): a substring test on the target's
# model_type; any other target is refused by vLLM at start-up.
VLLM_EAGLE3_TARGETS = ("llama", "qwen", "minicpm", "gpt_oss", "hunyuan_vl", "hunyuan_v1_dense", "afmoe")
# Families whose forward multiplies the embedding output (Gemma: sqrt(D)); drafters here read that scaled
# embedding (distill.teacher.TargetEmbedding), the engines' EAGLE modules do not.
SCALED_EMBEDDING_FAMILIES = ("gemma",)
_LAYER = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
          "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
          "down_proj": "mlp.down_proj", "post_attention_layernorm": "post_attention_layernorm"}


def _vllm_serve(kind: str, target: str, export_dir: str, num_tokens: int, tree: dict) -> str:
    # an explicit method: vLLM otherwise guesses it from the path string
    spec = {"method": KINDS[kind].method[0], "model": export_dir, "num_speculative_tokens": num_tokens}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def _sglang_serve(kind: str, target: str, export_dir: str, num_tokens: int, tree: dict) -> str:
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {KINDS[kind].method[1]} "
            f"--speculative-draft-model-path {export_dir} --speculative-num-steps {num_tokens} "
            f"--speculative-eagle-topk {tree.get('top_k', 4)} "
            f"--speculative-num-draft-tokens {tree.get('total_tokens', 16)}")


def _speculators_serve(kind: str, target: str, export_dir: str, num_tokens: int, tree: dict) -> str:
    # vLLM reads the verifier and the method from the speculators config itself
    return f"vllm serve {export_dir}   # or, explicitly:\n" + _vllm_serve(kind, target, export_dir, num_tokens, tree)


def _safeailab_serve(kind: str, target: str, export_dir: str, num_tokens: int, tree: dict) -> str:
    return (f"EaModel.from_pretrained(use_eagle3=False, base_model_path='{target}', ea_model_path='{export_dir}', "
            f"total_token={tree.get('total_tokens', 16)}, depth={num_tokens}, top_k={tree.get('top_k', 4)})"
            f"   # SafeAILab/EAGLE")


@dataclass(frozen=True)
class EagleEngine:
    """One engine's EAGLE loader, as read from its source (``loaders``), and the facts the export follows from it."""

    architectures: dict[str, list[str]]  # kind -> config.json ``architectures`` (the class the engine builds)
    loaders: dict[str, str]  # kind -> the source file(s) the names and keys were read from
    serve: Callable[[str, str, str, int, dict], str]  # (kind, target, export dir, num tokens, tree) -> command
    refused: dict[str, str] = field(default_factory=dict)  # kind -> why this engine cannot serve it
    packed: bool = True  # vLLM / SGLang modules pack q,k,v and gate,up on load (and prefix ``model.``)
    midlayer: bool = False  # the EAGLE-3 layer is named ``midlayer.`` in the export
    keeps_midlayer: bool = False  # ... and in the engine's own parameters (SGLang; vLLM renames it to layers.0)
    eagle1_fc_bias: bool = True  # its EAGLE-1 fc has a bias (written as zeros: ours is trained without)
    eagle1_config: dict[str, Any] = field(default_factory=dict)  # extra EAGLE-1 config keys its model reads
    layer_id_offset: int = 0  # it captures the input of layer id + offset (SGLang: 1)
    nested_layer_ids: bool = False  # reads eagle_aux_hidden_state_layer_ids from a nested eagle_config (SGLang)
    speculators_config: bool = False  # the speculators format: the Llama config nested, a verifier block
    eagle3_target_whitelist: bool = False  # refuses EAGLE-3 targets outside VLLM_EAGLE3_TARGETS
    strict: bool = False  # rejects an unknown tensor (else skips it silently)
    eagle31: tuple[str, ...] = ()  # the EAGLE-3.1 flags and the window its EAGLE-3 model reads (``EAGLE31``)
    eagle31_refused: str = ""  # why it cannot carry the others


# The drafter's settings an export must carry for the engine to build the trained architecture.
EAGLE31 = ("fc_norm", "norm_before_fc", "norm_output", "sliding_window")


ENGINES = {
    "vllm": EagleEngine(
        # vLLM's EAGLEConfig renames LlamaForCausalLM to EagleLlamaForCausalLM (method eagle) and keeps
        # LlamaForCausalLMEagle3 (method eagle3)
        architectures={"eagle1": ["LlamaForCausalLM"], "eagle3": ["LlamaForCausalLMEagle3"]},
        loaders={"eagle1": "vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM.load_weights, "
                           "LlamaModel)",
                 "eagle3": "vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights, "
                           "LlamaModel.load_weights); vllm/transformers_utils/configs/eagle.py; "
                           "vllm/config/speculative.py"},
        serve=_vllm_serve, midlayer=True, eagle1_fc_bias=False, eagle3_target_whitelist=True,
        # llama_eagle3.py (fc_norm, input_norm, norm_output via getattr on its config), llama.py (LlamaAttention:
        # per-layer sliding window from layer_types, draft layers indexed past the target's)
        eagle31=EAGLE31),
    "sglang": EagleEngine(  # SGLang picks the class named in architectures
        architectures={"eagle1": ["LlamaForCausalLMEagle"], "eagle3": ["LlamaForCausalLMEagle3"]},
        loaders={"eagle1": "python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle)",
                 "eagle3": "python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3.load_weights); "
                           "model_runner.py (eagle_config.eagle_aux_hidden_state_layer_ids)"},
        serve=_sglang_serve, midlayer=True, keeps_midlayer=True, layer_id_offset=1, nested_layer_ids=True,
        eagle31_refused="the SGLang LlamaForCausalLMEagle3 this export follows builds no fc_norm / input_norm (its "
                        "loader would skip their weights without a word), feeds the pre-norm state to the next draft "
                        "step and gives its attention no sliding window: it would serve plain EAGLE-3 with the wrong "
                        "inputs"),
    "hf": EagleEngine(
        architectures={"eagle1": ["LlamaForCausalLM"]},
        loaders={"eagle1": "SafeAILab/EAGLE eagle/model/cnets1.py (Model: fc with bias, layer 0 without "
                           "input_layernorm, embedding read from the base model) and ea_model.py "
                           "(EaModel.from_pretrained(use_eagle3=False): pytorch_model.bin else model.safetensors, "
                           "load_state_dict(strict=False))"},
        refused={"eagle3": "SafeAILab/EAGLE's EAGLE-3 takes its target layers from its own modified modeling files, "
                           "with no config key to name them, so a drafter trained on other layers would be fed other "
                           "features; the hub-standard EAGLE-3 layout is format=speculators (vLLM auto-detects it), "
                           "or use format=vllm / format=sglang"},
        serve=_safeailab_serve, packed=False,
        eagle1_config={"pretraining_tp": 1}),  # SafeAILab's cnets1 reads config.pretraining_tp directly
    "speculators": EagleEngine(
        architectures={"eagle3": ["Eagle3Speculator"]},
        loaders={"eagle3": "vllm-project/speculators 0.9.0 speculators/models/eagle3 (Eagle3DraftModel, "
                           "Eagle3SpeculatorConfig) - loaded for real by tests/test_export_eagle.py"},
        refused={"eagle1": "speculators 0.9.0 has no EAGLE-1 model class (its eagle3 config requires auxiliary "
                           "layers and its own lm_head); use format=vllm, sglang or hf"},
        serve=_speculators_serve, packed=False, speculators_config=True, eagle3_target_whitelist=True, strict=True,
        # Eagle3SpeculatorConfig's fields, Eagle3DraftModel's fc_norm / input_norm and its sliding_attention layers
        eagle31=EAGLE31),
}


def layer_prefix(engine: str, kind: str) -> str:
    return "midlayer." if KINDS[kind].midlayer and ENGINES[engine].midlayer else "layers.0."


def engine_layer_ids(engine: str, layers: list[int], num_layers: int) -> list[int]:
    """Our hidden-state indices in ``engine``'s ``eagle_aux_hidden_state_layer_ids`` convention; ValueError with
    the reason when the engine cannot capture them."""
    resolved = [num_layers if i == -1 else i for i in layers]
    low = ENGINES[engine].layer_id_offset
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"drafter.layers={layers} repeats a layer: the engines capture each layer once, so they "
                         f"cannot feed the same feature twice; retrain with distinct drafter.layers")
    bad = [i for i in resolved if not low <= i < num_layers]
    if bad:
        raise ValueError(
            f"drafter.layers={layers} contains {bad}: {engine} captures the inputs of decoder layers "
            f"{low}..{num_layers - 1} (hidden-state indices) and never the final normed output (index {num_layers}); "
            f"retrain with drafter.layers inside {low}..{num_layers - 1}, e.g. "
            f"[{max(low, 1)}, {max(low, num_layers // 2)}, {num_layers - 1}]")
    return [i - low for i in resolved]


def written_layer_ids(engine: str, config: dict) -> list[int] | None:
    """The ``eagle_aux_hidden_state_layer_ids`` an export's config gives the engine, where that engine reads them
    (SGLang: nested in ``eagle_config``; vLLM and speculators: top level)."""
    if ENGINES[engine].nested_layer_ids:
        return (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return config.get("eagle_aux_hidden_state_layer_ids")


def our_layers(engine: str, kind: str, config: dict) -> list[int]:
    """The hidden-state indices an export's config makes the engine capture, in our convention (the inverse of
    ``engine_layer_ids``): what the engine would actually feed the drafter."""
    return KINDS[kind].layers(engine, config)


def _aux_layers(engine: str, config: dict) -> list[int]:
    return [i + ENGINES[engine].layer_id_offset for i in written_layer_ids(engine, config)]


def check_target_family(engine: str, kind: str, model_type: str | None) -> None:
    if model_type and any(name in model_type for name in SCALED_EMBEDDING_FAMILIES):
        raise ValueError(
            f"the engines' EAGLE drafters embed tokens with the raw embedding table and put no soft-cap on the logits, "
            f"while a {model_type!r} target's forward scales its embeddings by sqrt(hidden_size) (and Gemma-2 "
            f"soft-caps its logits): the drafter was trained on the target's own read-outs, so an engine would feed "
            f"it other inputs. Evaluate it with `python -m eval`; serving it needs an engine-side embedding scale")
    if ENGINES[engine].eagle3_target_whitelist and KINDS[kind].target_whitelist and model_type:
        if not any(name in model_type for name in VLLM_EAGLE3_TARGETS):
            raise ValueError(f"vLLM serves EAGLE-3 only for targets whose model_type contains one of "
                             f"{list(VLLM_EAGLE3_TARGETS)} (vllm/config/speculative.py); this target is {model_type!r}")


def eagle31_of(drafter) -> dict[str, Any]:
    """The EAGLE-3.1 flags and the window set on ``drafter`` (none: a plain EAGLE-3 / EAGLE-1)."""
    values = {k: getattr(drafter, "fc_norm_on" if k == "fc_norm" else k, None) for k in EAGLE31}
    return {k: v for k, v in values.items() if v not in (None, False)}


def check_eagle31(engine: str, drafter) -> None:
    """Refuse an export to an engine that cannot build what the drafter was trained with."""
    row = ENGINES[engine]
    for key, value in eagle31_of(drafter).items():
        if key not in row.eagle31:
            carried = [name for name, r in ENGINES.items() if key in r.eagle31]
            raise ValueError(f"drafter.{key}={value!r}: {engine} cannot carry it: {row.eagle31_refused}. Export "
                             f"with format={' or format='.join(carried)}, or retrain without drafter.{key}")


def eagle31_settings(config: dict) -> dict[str, Any]:
    """The drafter settings an export's config gives the engine (``EAGLE31``), for rebuilding it."""
    c = config.get("transformer_layer_config", config)
    sliding = "sliding_attention" in (c.get("layer_types") or [])
    return {"fc_norm": bool(config.get("fc_norm")), "norm_before_fc": bool(config.get("norm_before_fc")),
            "norm_output": bool(config.get("norm_output")), "sliding_window": c["sliding_window"] if sliding else None}


def sizes(drafter) -> dict[str, Any]:
    layer = drafter.layer
    return {"D": drafter.dims.hidden_size, "V": drafter.dims.vocab_size, "Vd": drafter.draft_vocab_size,
            "h": layer.num_heads, "hd": layer.head_dim, "I": layer.gate_proj.out_features,
            "F": len(drafter.teacher_layers), "theta": layer.theta}


def engine_state(drafter, engine: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of the export, under the engine's names, floats in ``dtype`` (the target's)."""
    kind, prefix = drafter.variant, layer_prefix(engine, drafter.variant)
    ours = {k: v.detach() for k, v in drafter.state_dict().items()}
    out = {prefix + _LAYER[k.split(".", 1)[1].rsplit(".", 1)[0]] + ".weight": v
           for k, v in ours.items() if k.startswith("layer.")}
    out["fc.weight"] = ours["fc.weight"]
    if KINDS[kind].fc_bias and ENGINES[engine].eagle1_fc_bias:  # their EAGLE-1 fc has a bias; ours is trained without
        out["fc.bias"] = torch.zeros(drafter.dims.hidden_size)
    out.update({(prefix if where == "layer" else "") + name: ours[name] for name, where, _ in KINDS[kind].own})
    out.update({k: v for k, v in ours.items() if k.startswith(("fc_norm.", "input_norm."))})  # EAGLE-3.1's
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    if drafter.draft_vocab_size != drafter.dims.vocab_size:  # EAGLE-3's own draft vocabulary
        d2t = ours["d2t"].long()
        out["d2t"] = (d2t - torch.arange(d2t.shape[0])).contiguous()  # offsets: target = draft + d2t[draft]
        out["t2d"] = (ours["t2d"] >= 0).contiguous()
    return out


def llama_config(drafter, dtype: str, max_positions: int) -> dict[str, Any]:
    """The one-layer Llama the engines build the drafter from."""
    s = sizes(drafter)
    config = {"model_type": "llama", "hidden_size": s["D"], "num_hidden_layers": 1, "num_attention_heads": s["h"],
              "num_key_value_heads": s["h"], "head_dim": s["hd"], "intermediate_size": s["I"], "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": s["theta"], "rope_scaling": None,
              "max_position_embeddings": max_positions or 4096, "vocab_size": s["V"], "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype}
    window = getattr(drafter, "sliding_window", None)
    if window is not None:  # every draft layer (P-EAGLE's stacked ones too) attends within the window
        layers = 1 + len(getattr(drafter, "upper", ()))
        config.update(layer_types=["sliding_attention"] * layers, sliding_window=window, use_sliding_window=True)
    return config


def engine_config(drafter, engine: str, target: dict, dtype: str, num_tokens: int) -> dict[str, Any]:
    """The export's config.json: the kind's config around the one-layer Llama, in the engine's keys."""
    base = llama_config(drafter, dtype, target.get("max_positions") or 0)
    return KINDS[drafter.variant].config(drafter, engine, target, base, dtype, num_tokens)


def _eagle1_config(drafter, engine: str, target: dict, base: dict, dtype: str, num_tokens: int) -> dict[str, Any]:
    row = ENGINES[engine]
    return {"architectures": row.architectures["eagle1"], **base, "bias": row.eagle1_fc_bias, **row.eagle1_config}


def _eagle3_config(drafter, engine: str, target: dict, base: dict, dtype: str, num_tokens: int) -> dict[str, Any]:
    kind, s, row = "eagle3", sizes(drafter), ENGINES[engine]
    ids = engine_layer_ids(engine, list(drafter.teacher_layers), target["num_layers"])
    eagle3 = {"draft_vocab_size": s["Vd"], "target_hidden_size": s["D"], "norm_before_residual": False}
    if eagle31_of(drafter).keys() - {"sliding_window"}:  # all three, explicit, once one is set
        eagle3.update(fc_norm=drafter.fc_norm_on, norm_before_fc=drafter.norm_before_fc,
                      norm_output=drafter.norm_output)
    if row.speculators_config:
        verifier = {"name_or_path": target.get("serve_name") or target.get("name"),
                    "architectures": [target.get("architecture") or "LlamaForCausalLM"]}
        return {"architectures": row.architectures[kind], "speculators_model_type": "eagle3",
                "transformer_layer_config": {k: v for k, v in base.items() if k != "torch_dtype"},
                **eagle3, "eagle_aux_hidden_state_layer_ids": ids, "torch_dtype": dtype,
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy", "verifier": verifier,
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_tokens}]}}
    config = {"architectures": row.architectures[kind], **base, **eagle3, "bias": False}
    if row.nested_layer_ids:  # SGLang's model runner reads the ids from the nested eagle_config only
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    else:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    return config


def _eagle3_check(engine: str, config: dict) -> list[str]:
    ids = written_layer_ids(engine, config)
    problems = []
    if not ids or len(ids) != 3:
        problems.append(f"eagle_aux_hidden_state_layer_ids={ids!r}: {engine} needs the 3 target layers "
                        f"({'nested in eagle_config' if ENGINES[engine].nested_layer_ids else 'top level'})")
    if "norm_before_residual" not in config:
        problems.append("config.json lacks norm_before_residual (the residual convention must be explicit)")
    return problems


_SHARED = " not in this export: the engine shares the target's own (the drafter was trained on them)."


def _eagle1_notes(drafter: dict) -> list[str]:
    return ["The target's embeddings and lm_head are" + _SHARED, ""]


def _eagle3_notes(drafter: dict) -> list[str]:
    return [f"The target's embeddings are{_SHARED} Target layers (specdraft hidden-state indices, HF "
            f"`hidden_states[i]`): {drafter.get('layers')}; config.json writes them in this engine's own "
            f"`eagle_aux_hidden_state_layer_ids` convention (SGLang: index - 1, nested in `eagle_config`).", ""]


@dataclass(frozen=True)
class EagleKind:
    """What one EAGLE variant exports beyond what both share (``fc`` and one decoder layer's projections)."""

    method: tuple[str, str]  # (vLLM method, SGLang algorithm)
    fc_inputs: int  # fc reads F x D: EAGLE-1 [embedding; final hidden], EAGLE-3 three target layers
    attention_inputs: int  # q/k/v read 1 x D (EAGLE-1) or [embedding; fc output], 2 x D (EAGLE-3)
    config: Callable[..., dict]  # (drafter, engine, target, llama base, dtype, num tokens) -> config.json
    layers: Callable[[str, dict], list[int]]  # (engine, config) -> the hidden-state indices the engine feeds it
    notes: Callable[[dict], list[str]]  # the model card's notes, from the saved drafter config
    check: Callable[[str, dict], list[str]] = lambda engine, config: []  # its own config keys
    # (tensor, where, shape) of its own tensors: "layer" under the layer's prefix, "top" beside fc (``model.`` in a
    # packed engine's parameters), "head" bare; shapes in D (hidden size) and Vd (draft vocabulary)
    own: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    fc_bias: bool = False  # the engines' class has an fc bias (written as zeros where the engine row says so)
    draft_vocab: bool = False  # a draft vocabulary of its own (draft_vocab_size, d2t / t2d)
    midlayer: bool = False  # its layer is named ``midlayer.`` where the engine row says so
    target_whitelist: bool = False  # refused for targets outside an engine's EAGLE-3 list (vLLM's)


KINDS = {
    "eagle1": EagleKind(method=("eagle", "EAGLE"), fc_inputs=2, attention_inputs=1, config=_eagle1_config,
                        layers=lambda engine, config: [-1],  # the engines feed it the final (normed) hidden state
                        notes=_eagle1_notes, fc_bias=True),
    "eagle3": EagleKind(method=("eagle3", "EAGLE3"), fc_inputs=3, attention_inputs=2, config=_eagle3_config,
                        layers=_aux_layers, notes=_eagle3_notes, check=_eagle3_check,
                        own=(("input_layernorm.weight", "layer", ("D",)), ("hidden_norm.weight", "layer", ("D",)),
                             ("norm.weight", "top", ("D",)), ("lm_head.weight", "head", ("Vd", "D"))),
                        draft_vocab=True, midlayer=True, target_whitelist=True),
}


# --- the loaders, transcribed ------------------------------------------------------------------------------------


def engine_params(engine: str, kind: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters the engine's model class owns that its loader must fill from the export (shared-with-target
    parameters, embed_tokens and EAGLE-1's lm_head, excluded), with their shapes, from the export's config."""
    c = config.get("transformer_layer_config", config)
    D, h, kv, I = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    hd = c.get("head_dim") or D // h
    k = KINDS[kind]
    F, inp = k.fc_inputs, k.attention_inputs * D
    row = ENGINES[engine]
    if not row.packed:  # plain torch modules: unpacked projections
        p = "layers.0."
        params = {p + "self_attn.q_proj.weight": (h * hd, inp), p + "self_attn.k_proj.weight": (kv * hd, inp),
                  p + "self_attn.v_proj.weight": (kv * hd, inp), p + "mlp.gate_proj.weight": (I, D),
                  p + "mlp.up_proj.weight": (I, D)}
    else:
        p = "model." + ("midlayer." if k.midlayer and row.keeps_midlayer else "layers.0.")
        params = {p + "self_attn.qkv_proj.weight": ((h + 2 * kv) * hd, inp), p + "mlp.gate_up_proj.weight": (2 * I, D)}
    params.update({p + "self_attn.o_proj.weight": (D, h * hd), p + "mlp.down_proj.weight": (D, I),
                   p + "post_attention_layernorm.weight": (D,)})
    top = "model." if row.packed else ""
    params[top + "fc.weight"] = (D, F * D)
    if k.fc_bias and config.get("bias"):
        params[top + "fc.bias"] = (D,)
    where = {"layer": p, "top": top, "head": ""}
    params.update({where[place] + name: tuple(D if n == "D" else config["draft_vocab_size"] for n in shape)
                   for name, place, shape in k.own})
    params.update({f"{top}fc_norm.{i}.weight": (D,) for i in range(F) if config.get("fc_norm")})  # EAGLE-3.1's
    if config.get("norm_before_fc"):
        params[top + "input_norm.weight"] = (F * D,)
    return params


def load_like_engine(engine: str, kind: str, state: dict[str, torch.Tensor], config: dict
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[str]]:
    """Apply the engine loader's own renames / packing to the exported tensors: (engine parameters, the target ids
    of the draft vocabulary as the engine computes them or None, problems). A problem is an exported tensor the
    loader would skip, a parameter it would leave unset, or a shape it would reject."""
    row = ENGINES[engine]
    params, problems, vocab = {}, [], None
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name == "t2d":
            continue  # every loader skips t2d (the engines only use d2t)
        if name == "d2t":
            vocab = tensor.long() + torch.arange(tensor.shape[0])  # vLLM: base + draft_id_to_target_id; SGLang: hot_token_id
            continue
        if not row.packed:
            params[name] = tensor
            continue
        mapped = name if row.keeps_midlayer else name.replace("midlayer.", "layers.0.")
        full = mapped if mapped.startswith("lm_head") else "model." + mapped
        for packed, part in ((".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                             (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")):
            if part in full:
                shards.setdefault(full.replace(part, packed), {})[part] = tensor
                break
        else:
            params[full] = tensor
    for name, parts in shards.items():  # packed in the loader's shard order: q, k, v / gate, up
        order = (".q_proj", ".k_proj", ".v_proj") if "qkv" in name else (".gate_proj", ".up_proj")
        missing = [o for o in order if o not in parts]
        if missing:
            problems.append(f"{name}: shards {missing} are missing, the packed parameter would be partly unset")
            continue
        params[name] = torch.cat([parts[o] for o in order], 0)
    expected = engine_params(engine, kind, config)
    for name, tensor in params.items():
        if name not in expected:
            problems.append(f"tensor for {name!r} matches no parameter of the {engine} model: its loader would "
                            f"{'reject it' if row.strict else 'skip it silently'}")
        elif tuple(tensor.shape) != expected[name]:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, the {engine} model's is {expected[name]}")
    problems += [f"{name} {shape} is never set by the export (the model would keep uninitialised memory)"
                 for name, shape in expected.items() if name not in params]
    if KINDS[kind].draft_vocab and config.get("draft_vocab_size") != config.get("vocab_size", config.get(
            "transformer_layer_config", {}).get("vocab_size")) and vocab is None:
        problems.append("draft_vocab_size is smaller than the vocabulary but d2t is missing: drafts would be read "
                        "as the first draft_vocab_size target ids")
    return params, vocab, problems


def drafter_from_engine(engine: str, kind: str, params: dict[str, torch.Tensor], vocab: torch.Tensor | None,
                        config: dict, dims: TargetDims, layers: list[int], decode: dict):
    """A specdraft EagleDrafter holding exactly the engine's parameters (packed ones split back), for decoding."""
    c = config.get("transformer_layer_config", config)
    D, I = c["hidden_size"], c["intermediate_size"]
    flags = eagle31_settings(config)  # all off for EAGLE-1 (whose config has none of them)
    drafter = EagleDrafter(dims, variant=kind, layers=layers, num_heads=c["num_attention_heads"],
                           intermediate_size=I, rope_theta=c["rope_theta"],
                           draft_vocab_size=config.get("draft_vocab_size") if KINDS[kind].draft_vocab else None, **flags,
                           **decode)
    get = {k.replace("model.", "", 1).replace("midlayer.", "layers.0."): v for k, v in params.items()}
    p = "layers.0."
    if p + "self_attn.qkv_proj.weight" in get:
        q, k, v = get.pop(p + "self_attn.qkv_proj.weight").split([D, D, D], 0)
        get.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v})
        gate, up = get.pop(p + "mlp.gate_up_proj.weight").split([I, I], 0)
        get.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
    state = {f"layer.{ours}.weight": get[p + theirs + ".weight"] for ours, theirs in _LAYER.items()}
    state["fc.weight"] = get["fc.weight"]
    state.update({name: get[(p if place == "layer" else "") + name] for name, place, _ in KINDS[kind].own})
    state.update({k: v for k, v in get.items() if k.startswith(("fc_norm.", "input_norm."))})  # EAGLE-3.1's
    own = drafter.state_dict()
    state = {k: v.to(own[k].dtype) for k, v in state.items()}
    if vocab is not None:
        t2d = torch.full((dims.vocab_size,), -1, dtype=torch.long)
        t2d[vocab] = torch.arange(vocab.shape[0])
        state.update(d2t=vocab, t2d=t2d)
    else:
        state.update(d2t=own["d2t"], t2d=own["t2d"])
    drafter.load_state_dict(state, strict=True)
    return drafter


# --- the adapter -----------------------------------------------------------------------------------------------


class EagleAdapter:
    kinds = tuple(KINDS)
    needs_training = True
    refused = {(engine, kind): reason for engine, row in ENGINES.items() for kind, reason in row.refused.items()}

    def supports(self, engine: str, kind: str) -> bool:
        return engine in ENGINES and kind in ENGINES[engine].architectures

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        kind = drafter.variant
        facts = target_facts(config)
        check_target_family(engine, kind, facts.get("model_type"))
        check_eagle31(engine, drafter)
        dtype = target_dtype(config)
        target = {**config.get("target", {}), **facts, "serve_name": serve_name(config)}
        num_tokens = drafter.depth or 4
        config_out = engine_config(drafter, engine, target, str(dtype).removeprefix("torch."), num_tokens)
        save_tensors(engine_state(drafter, engine, dtype), out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config_out, indent=2))

    def sidecar(self, drafter) -> dict[str, Any]:
        return {}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        """The config keys the engine reads, then the export run through the engine loader's own name mapping: every
        tensor lands on a parameter, every parameter is set, shapes agree, d2t maps into the vocabulary."""
        row = ENGINES[engine]
        weights = path / "model.safetensors"
        if not weights.is_file():
            return [f"{weights} is missing ({row.loaders[kind]} reads it)"]
        want = row.architectures[kind]
        problems = [] if config.get("architectures") == want else [
            f"config.json architectures={config.get('architectures')!r}, expected {want!r}"]
        layer_cfg = config.get("transformer_layer_config", config)
        problems += vocab_problem(layer_cfg.get("vocab_size"), target)
        problems += KINDS[kind].check(engine, config)
        state = load_file(str(weights))
        _, vocab, mapped = load_like_engine(engine, kind, state, config)
        problems += mapped
        if vocab is not None and not (vocab.min() >= 0 and vocab.max() < layer_cfg["vocab_size"]
                                      and vocab.unique().numel() == vocab.numel()):
            problems.append("d2t offsets do not map the draft vocabulary onto distinct target ids")
        if "t2d" in state and state["t2d"].dtype != torch.bool:
            problems.append(f"t2d has dtype {state['t2d'].dtype}; the loaders expect bool")
        return problems

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        config = json.loads((path / "config.json").read_text())
        params, vocab, problems = load_like_engine(engine, kind, load_file(str(path / "model.safetensors")), config)
        if problems:
            raise ValueError(f"{path} does not load into {engine}'s {kind}: " + "; ".join(problems))
        saved = sidecar["drafter"]
        decode = {k: saved[k] for k in ("tree", "top_k", "depth", "total_tokens") if k in saved}
        return drafter_from_engine(engine, kind, params, vocab, config, dims, our_layers(engine, kind, config), decode)

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return ENGINES[engine].serve(kind, target, export_dir, num_tokens, tree or {})

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        line = self.serve_command(engine, kind, serve_target, str(output_dir), drafter.get("depth") or 4, drafter)
        return model_card(engine, kind, config, report, line, KINDS[kind].notes(drafter))
