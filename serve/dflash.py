"""DFlash's export adapter. Every engine reads the same tensors (the z-lab checkpoints' names: ``fc``,
``hidden_norm``, ``layers.i.self_attn.{q,k,v,o}_proj / q_norm / k_norm``, ``layers.i.{input,post_attention}_layernorm``,
``layers.i.mlp.{gate,up,down}_proj``, ``norm``), with no embedding or lm_head (the engines share the target's, as the
drafter does); the config differs per engine:

    vllm         ``method: dflash`` (``vllm/model_executor/models/qwen3_dflash.py``): a Qwen3-style draft config with
                 ``block_size``, ``num_target_layers`` and ``dflash_config`` (``target_layer_ids``: 0-based target
                 layers whose outputs it captures, i.e. our hidden-state index - 1; ``mask_token_id``); its loader
                 prefixes ``model.`` and stacks q/k/v and gate/up itself. A sliding window is written as
                 ``sliding_attention`` layers with ``dflash_config.causal: false``.
    sglang       ``--speculative-algorithm DFLASH`` (``python/sglang/srt/models/dflash.py``, ``DFlashDraftModel``;
                 ``speculative/dflash_utils.py``, ``parse_dflash_draft_config``): the same config; its
                 ``load_weights`` packs q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``, accepts names with
                 or without ``model.`` and skips any other name without a word. It runs ``sliding_attention`` layers
                 as causal decoder attention, so a drafter trained with a (non-causal) sliding window is refused.
    speculators  vllm-project/speculators 0.9.0 (``speculators/models/dflash``: ``DFlashSpeculatorConfig``,
                 ``DFlashDraftModel``): the Qwen3 config nested as ``transformer_layer_config``, ``block_size``,
                 ``aux_hidden_state_layer_ids`` (speculators' converter: the z-lab ids + 1, i.e. our hidden-state
                 indices), ``mask_token_id``, ``draft_vocab_size`` (the full vocabulary: no t2d / d2t, no lm_head)
                 and the ``speculators_config`` block naming the verifier; vLLM auto-detects it. A sliding window is
                 refused: vLLM's conversion of this format writes no ``dflash_config.causal``.

Each engine is one ``DFlashEngine`` row in ``ENGINES`` (its config writer, serve command, tensor check, the keys it
reads the layers and mask token from, what it refuses); the adapter looks the row up once and never branches on the
engine. ``check`` transcribes what each loader builds from the config: every tensor, its shape, and the config fields
it reads; ``load`` rebuilds the drafter from the engine-facing files the way that loader reads them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from distill.atomic import save_tensors
from heads.base import TargetDims
from heads.dflash.model import DFlashDrafter
from serve.adapter import read_weights, serve_name, target_dtype, target_facts, vocab_problem
from serve.eagle import SCALED_EMBEDDING_FAMILIES
from serve.model_card import model_card

WEIGHTS = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
# SGLang's DFlashDraftModel.load_weights: (its packed parameter, the checkpoint's name, shard)
SGLANG_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                  ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


def _vllm_serve(target: str, export_dir: str, num_tokens: int) -> str:
    spec = {"method": "dflash", "model": export_dir, "num_speculative_tokens": num_tokens}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def _sglang_serve(target: str, export_dir: str, num_tokens: int) -> str:
    # SGLang's unit is the verify window: the anchor plus the drafts (its DFLASH block size)
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {export_dir} --speculative-num-draft-tokens {num_tokens + 1}")


def _speculators_serve(target: str, export_dir: str, num_tokens: int) -> str:
    # vLLM reads the verifier and the method from the speculators config itself
    return f"vllm serve {export_dir}   # or, explicitly:\n" + _vllm_serve(target, export_dir, num_tokens)


def qwen3_config(drafter: DFlashDrafter, max_positions: int | None) -> dict[str, Any]:
    """The Qwen3-style draft transformer every engine builds (no DFlash keys)."""
    D, V = drafter.dims.hidden_size, drafter.dims.vocab_size
    attn = drafter.layers[0].self_attn
    theta = attn.theta
    return {"model_type": "qwen3", "hidden_size": D, "vocab_size": V,
            "intermediate_size": drafter.layers[0].mlp.gate_proj.out_features,
            "num_hidden_layers": len(drafter.layers), "num_attention_heads": attn.h, "num_key_value_heads": attn.g,
            "head_dim": attn.hd, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
            "rms_norm_eps": drafter.norm.eps, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "max_position_embeddings": max_positions or 4096}


def engine_config(drafter: DFlashDrafter, dtype: str, max_positions: int | None) -> dict[str, Any]:
    """vLLM's and SGLang's config.json (the z-lab layout)."""
    L = drafter.dims.num_layers
    window = {}
    if drafter.sliding_window is not None:
        # vLLM takes a sliding-window DFlash layer as causal unless dflash_config.causal says otherwise
        window = {"layer_types": ["sliding_attention"] * len(drafter.layers), "sliding_window": drafter.sliding_window,
                  "use_sliding_window": True}
    return {**window, "architectures": [ARCHITECTURE], **qwen3_config(drafter, max_positions), "torch_dtype": dtype,
            "block_size": drafter.block_size, "num_target_layers": L,
            "dflash_config": {"target_layer_ids": [i - 1 for i in drafter.teacher_layers],
                              "mask_token_id": drafter.mask_token_id,
                              **({"causal": False} if window else {})}}


def speculators_config(drafter: DFlashDrafter, dtype: str, facts: dict, verifier: str) -> dict[str, Any]:
    """speculators' ``DFlashSpeculatorConfig`` fields (full vocabulary, the anchor not sampled)."""
    return {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "dflash",
            "transformer_layer_config": qwen3_config(drafter, facts.get("max_positions")),
            "draft_vocab_size": drafter.dims.vocab_size, "target_hidden_size": drafter.dims.hidden_size,
            "block_size": drafter.block_size, "aux_hidden_state_layer_ids": list(drafter.teacher_layers),
            "mask_token_id": drafter.mask_token_id, "sliding_window_non_causal": False,
            "sample_from_anchor": False, "torch_dtype": dtype,
            "speculators_config": {
                "algorithm": "dflash", "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier,
                             "architectures": [facts.get("architecture") or "LlamaForCausalLM"]},
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.block_size - 1}]}}


def as_zlab(config: dict) -> dict:
    """The z-lab view of any DFlash export's config (speculators' nests the transformer and names the layers by
    hidden-state index)."""
    if "transformer_layer_config" not in config:
        return config
    view = dict(config["transformer_layer_config"])
    view.update(block_size=config.get("block_size"),
                dflash_config={"target_layer_ids": [i - 1 for i in config.get("aux_hidden_state_layer_ids") or []],
                               "mask_token_id": config.get("mask_token_id")})
    return view


def engine_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a DFlash draft builds from ``config`` (names as in the checkpoint, unpacked), with its shape."""
    config = as_zlab(config)
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


def sglang_params(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters SGLang's DFlashDraftModel owns (packed), with their shapes."""
    shapes = engine_shapes(config)
    D, H, G = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = config.get("head_dim") or D // H, config["intermediate_size"]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            del shapes[p + f"self_attn.{name}.weight"]
        del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
        shapes[p + "self_attn.qkv_proj.weight"] = ((H + 2 * G) * hd, D)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * inter, D)
    return shapes


def load_like_sglang(state: dict[str, torch.Tensor], config: dict) -> tuple[dict[str, torch.Tensor], list[str]]:
    """SGLang's ``load_weights`` applied to the exported tensors: (its parameters, problems). A problem is a tensor
    it would skip without a word, a parameter it would leave unset, or a shape it would reject."""
    owned = sglang_params(config)

    def resolve(name: str) -> str | None:  # it accepts a name with or without the ``model.`` prefix
        bare = name.removeprefix("model.")
        return bare if bare in owned else None

    params, shards, problems = {}, {}, []
    for name, tensor in state.items():
        for packed, weight, shard in SGLANG_STACKED:
            if f".{weight}." not in name:
                continue
            target = resolve(name.replace(weight, packed))
            if target is not None:
                shards.setdefault(target, {})[shard] = tensor
                break
        else:
            target = resolve(name)
            if target is None:
                problems.append(f"tensor {name!r} matches no parameter of SGLang's DFlash draft: its loader skips it "
                                f"silently")
                continue
            params[target] = tensor
    for target, parts in shards.items():
        order = ("q", "k", "v") if "qkv_proj" in target else (0, 1)
        if set(parts) != set(order):
            problems.append(f"{target} is packed from {sorted(map(str, parts))}, missing "
                            f"{sorted(map(str, set(order) - set(parts)))}")
            continue
        params[target] = torch.cat([parts[s] for s in order])
    problems += [f"parameter {k!r} is never set by the export" for k in sorted(set(owned) - set(params))]
    problems += [f"tensor for {k!r} has shape {tuple(params[k].shape)}, SGLang builds {owned[k]}"
                 for k in sorted(set(owned) & set(params)) if tuple(params[k].shape) != owned[k]]
    return params, problems


def unpack_sglang(params: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Our (z-lab) names back from SGLang's packed parameters."""
    D, H, G = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or D // H
    out = {}
    for name, tensor in params.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = tensor.split([H * hd, G * hd, G * hd])
            out.update({name.replace("qkv_proj", "q_proj"): q, name.replace("qkv_proj", "k_proj"): k,
                        name.replace("qkv_proj", "v_proj"): v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            out.update({name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up})
        else:
            out[name] = tensor
    return out


def _dotted(config: dict, key: str) -> Any:
    """``config``'s value at a dotted key (``dflash_config.mask_token_id``), None where absent."""
    for part in key.split("."):
        config = (config or {}).get(part)
    return config


def _layer_problems(row: DFlashEngine, config: dict, target: dict) -> list[str]:
    """The DFlash fields every engine reads: target layers, mask token, block size, attention types."""
    view = as_zlab(config)
    problems = []
    dflash = view["dflash_config"]
    ids = dflash.get("target_layer_ids")
    shown = _dotted(config, row.layer_ids_key)
    if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        problems.append(f"{row.layer_ids_key}={shown!r} must name target layers 1..L-1 (speculators: hidden-state "
                        f"indices; vLLM / SGLang: 0-based layers 0..L-2)")
    elif target.get("num_layers") and max(ids) >= target["num_layers"] - 1:
        problems.append(f"{row.layer_ids_key}={shown} reaches the target's last layer or beyond")
    elif row.checks_num_target_layers and not (isinstance(view.get("num_target_layers"), int)
                                               and max(ids) < view["num_target_layers"]):
        problems.append(f"num_target_layers={view.get('num_target_layers')!r}: SGLang refuses target_layer_ids {ids} "
                        f"outside 0..num_target_layers-1")
    mask = dflash.get("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < view["vocab_size"]:
        problems.append(f"{row.mask_key}={mask!r} is not a token id of the vocabulary")
    if not isinstance(view.get("block_size"), int) or view["block_size"] < 2:
        problems.append(f"block_size={view.get('block_size')!r} must be an integer >= 2")
    problems += _window_problems(row, view)
    if row.silu_only and view.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={view.get('hidden_act')!r}: SGLang's DFlash MLP supports silu only")
    if view.get("attention_bias"):
        problems.append("attention_bias=true: the export carries no attention biases")
    return problems


def _window_problems(row: DFlashEngine, view: dict) -> list[str]:
    """Sliding-window layers: written as vLLM reads them (non-causal), or refused where the engine runs them
    causally."""
    types = view.get("layer_types")
    if types is None:
        return []
    if row.window_refused:
        return ([f"layer_types={types}: {row.window_refused}"]
                if any(t != "full_attention" for t in types) else [])
    problems = []
    if types != ["sliding_attention"] * view["num_hidden_layers"]:
        problems.append(f"layer_types={types}: specdraft's DFlash layers are all full or all sliding_attention")
    if not isinstance(view.get("sliding_window"), int):
        problems.append("sliding_attention layers need an integer sliding_window (vLLM refuses to start)")
    if view["dflash_config"].get("causal") is not False:
        problems.append("dflash_config.causal must be false: vLLM runs sliding_attention DFlash layers "
                        "causally otherwise, and the block was trained non-causal")
    return problems


def _speculators_problems(config: dict) -> list[str]:
    """What speculators' DFlashSpeculatorConfig and vLLM's speculators-format detection read."""
    problems = []
    if config.get("speculators_model_type") != "dflash":
        problems.append(f"speculators_model_type={config.get('speculators_model_type')!r}, speculators' DFlash "
                        f"config registers 'dflash'")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return problems + ["transformer_layer_config must be a dict (vLLM refuses the config otherwise)"]
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    if not isinstance(methods[0].get("speculative_tokens"), int):
        problems.append("speculators_config.proposal_methods[0].speculative_tokens is missing")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing (vLLM reads the target from it)")
    if config.get("draft_vocab_size") != layer.get("vocab_size"):
        problems.append(f"draft_vocab_size={config.get('draft_vocab_size')} differs from the vocabulary "
                        f"{layer.get('vocab_size')}: speculators would then expect t2d / d2t and its own lm_head")
    if config.get("sample_from_anchor"):
        problems.append("sample_from_anchor=true: the drafter predicts from the mask slots only (block_size - 1 "
                        "drafts)")
    return problems


def _unpacked_problems(label: str, engine: str) -> Callable[[dict, dict], list[str]]:
    """A loader that takes the checkpoint's names as they are: every tensor present, none extra, shapes equal."""
    def problems(state: dict[str, torch.Tensor], view: dict) -> list[str]:
        want = engine_shapes(view)
        return ([f"tensor {k!r} is missing" for k in sorted(set(want) - set(state))]
                + [f"tensor {k!r} is not part of {label}" for k in sorted(set(state) - set(want))]
                + [f"tensor {k!r} has shape {tuple(state[k].shape)}, {engine} builds {want[k]}"
                   for k in sorted(set(want) & set(state)) if tuple(state[k].shape) != want[k]])
    return problems


def _through_sglang(state: dict[str, torch.Tensor], config: dict, path: Path) -> dict[str, torch.Tensor]:
    """The tensors through SGLang's own renames and packing, then back to ours."""
    params, problems = load_like_sglang(state, config)
    if problems:
        raise ValueError(f"{path} does not load in SGLang: " + "; ".join(problems))
    return unpack_sglang(params, config)


@dataclass(frozen=True)
class DFlashEngine:
    """One engine's DFlash loader: the config it reads, how it takes the tensors, and what it cannot run."""

    architecture: str  # config.json ``architectures``
    config: Callable[[DFlashDrafter, str, dict, str], dict]  # (drafter, dtype, target facts, verifier) -> config
    serve: Callable[[str, str, int], str]  # (target, export dir, num tokens) -> command
    tensor_problems: Callable[[dict, dict], list[str]]  # (tensors, z-lab config) -> what its loader rejects
    layer_ids_key: str = "dflash_config.target_layer_ids"  # where it reads the target layers (dotted)
    mask_key: str = "dflash_config.mask_token_id"
    config_problems: Callable[[dict], list[str]] = lambda config: []  # format checks before the z-lab view
    through: Callable[[dict, dict, Path], dict] = lambda state, config, path: state  # its loader's renames, and back
    window_refused: str | None = None  # why a (non-causal) sliding window cannot run there
    checks_num_target_layers: bool = False  # refuses layer ids outside 0..num_target_layers-1
    silu_only: bool = False  # its MLP has silu only
    whole_block: bool = False  # verifies the whole trained block (else the drafter's depth)


ENGINES = {
    "vllm": DFlashEngine(
        architecture=ARCHITECTURE, serve=_vllm_serve,
        config=lambda drafter, dtype, facts, verifier: engine_config(drafter, dtype, facts.get("max_positions")),
        tensor_problems=_unpacked_problems("vLLM's DFlash draft", "vllm")),
    "sglang": DFlashEngine(
        architecture=ARCHITECTURE, serve=_sglang_serve,
        config=lambda drafter, dtype, facts, verifier: engine_config(drafter, dtype, facts.get("max_positions")),
        tensor_problems=lambda state, view: load_like_sglang(state, view)[1], through=_through_sglang,
        window_refused="SGLang builds a sliding_attention DFlash layer as causal decoder attention "
                       "(AttentionType.DECODER), while the block was trained non-causal",
        checks_num_target_layers=True, silu_only=True, whole_block=True),
    "speculators": DFlashEngine(
        architecture=SPECULATORS_ARCHITECTURE, serve=_speculators_serve, config=speculators_config,
        tensor_problems=_unpacked_problems("speculators' DFlashDraftModel", "speculators"),
        layer_ids_key="aux_hidden_state_layer_ids", mask_key="mask_token_id", config_problems=_speculators_problems,
        window_refused="vLLM's conversion of a speculators DFlash config writes dflash_config without causal: false, "
                       "so it runs sliding_attention layers causally, while the block was trained non-causal"),
}


class DFlashAdapter:
    kinds = ("dflash",)
    needs_training = True
    refused = {("hf", "dflash"): "DFlash has no Hugging Face reference model class; export with format=vllm, "
                                 "sglang or speculators"}
    engines = ENGINES  # one row per engine

    def supports(self, engine: str, kind: str) -> bool:
        return engine in self.engines

    def write(self, out: Path, drafter, engine: str, config: dict, output_dir: Path) -> None:
        row = self.engines[engine]
        bad = [i for i in drafter.teacher_layers if not 1 <= i < drafter.dims.num_layers]
        if bad:
            raise ValueError(f"drafter.layers={list(drafter.teacher_layers)}: {engine} captures the outputs of decoder "
                             f"layers 1..{drafter.dims.num_layers - 1} (hidden-state indices), not {bad} (0: the "
                             f"embeddings, {drafter.dims.num_layers}: the final normed output); retrain with layers "
                             f"in that range to serve this drafter")
        if drafter.sliding_window is not None and row.window_refused:
            raise ValueError(f"drafter.sliding_window={drafter.sliding_window}: {row.window_refused}; export it "
                             f"with format=vllm (dflash_config.causal: false), or retrain with sliding_window=null")
        dtype = target_dtype(config)
        facts = target_facts(config)
        model_type = facts.get("model_type")
        if model_type and any(name in model_type for name in SCALED_EMBEDDING_FAMILIES):
            raise ValueError(f"{engine}'s DFlash draft embeds tokens with the raw embedding table and puts no soft-cap "
                             f"on the logits, while a {model_type!r} target's forward scales its embeddings by "
                             f"sqrt(hidden_size): the drafter was trained on the target's own read-outs, so the engine "
                             f"would feed it other inputs. Evaluate it with `python -m eval` instead")
        # d2t (drafter.draft_vocab_size) only narrows specdraft's own decoding; the engine drafts over every id
        state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items() if k != "d2t"}
        save_tensors(state, out / WEIGHTS, metadata={"format": "pt"})
        cfg = row.config(drafter, str(dtype).removeprefix("torch."), facts, serve_name(config))
        (out / "config.json").write_text(json.dumps(cfg, indent=2))

    def sidecar(self, drafter) -> dict[str, Any]:
        return {}

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        row = self.engines[engine]
        problems = row.config_problems(config)
        if problems:
            return problems
        need = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size", "block_size", "dflash_config")
        view = {**as_zlab(config), "architectures": config.get("architectures")}
        problems = [f"config.json lacks {key}" for key in need if view.get(key) is None]
        if problems:
            return problems
        if config["architectures"] != [row.architecture]:
            problems.append(f"architectures={config['architectures']}, {engine}'s DFlash loader expects "
                            f"{[row.architecture]}")
        problems += _layer_problems(row, config, target)
        problems += vocab_problem(view["vocab_size"], target)
        if problems:
            return problems
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return [f"{path} has no *.safetensors weights"]
        return row.tensor_problems({k: v for f in files for k, v in read_weights(f).items()}, view)

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims):
        config = as_zlab(json.loads((path / "config.json").read_text()))
        dflash = config["dflash_config"]
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 1e6))
        drafter = DFlashDrafter(dims, block_size=config["block_size"], num_layers=config["num_hidden_layers"],
                                layers=[i + 1 for i in dflash["target_layer_ids"]],
                                num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
                                intermediate_size=config["intermediate_size"], rope_theta=theta,
                                rms_norm_eps=config["rms_norm_eps"], mask_token_id=dflash["mask_token_id"],
                                sliding_window=config.get("sliding_window")
                                if "sliding_attention" in (config.get("layer_types") or []) else None)
        state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in read_weights(f).items()}
        state = self.engines[engine].through(state, config, path)
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
        return drafter

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return self.engines[engine].serve(target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        block = drafter.get("block_size") or 16
        # SGLang verifies the whole block it was trained on; vLLM may draft fewer than block_size - 1
        tokens = block - 1 if self.engines[engine].whole_block else drafter.get("depth") or block - 1
        line = self.serve_command(engine, kind, serve_target, str(output_dir), tokens)
        return model_card(engine, kind, config, report, line, [])
