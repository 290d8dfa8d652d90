"""P-EAGLE's export adapter: vLLM serves it as EAGLE-3 with parallel drafting, so the export is EAGLE-3's vLLM layout
(``serve.eagle``: the same tensors, names, layer ids and draft vocabulary maps) plus what parallel drafting reads:

    config.json  architectures ["LlamaForCausalLMEagle3"]   EAGLE-3's: vLLM's EAGLEConfig keeps it under method eagle3
                                                              (any other name gets an ``Eagle3`` prefix: a
                                                              ``PeagleLlamaForCausalLM`` becomes the unknown
                                                              ``Eagle3PeagleLlamaForCausalLM``, which vLLM refuses),
                                                              and its registry maps it to Eagle3LlamaForCausalLM
                 pard_token = our mask_token_id               the id its proposer feeds the parallel slots (it reads
                                                              ``pard_token`` or ``ptd_token_id``; newer releases also
                                                              a top-level ``mask_token_id``, written with the same id)
    weights      mask_hidden [1, F*D]                         the placeholder for the target features of the parallel
                                                              slots (pre-fc), loaded beside the EAGLE-3 parameters
                 layers.i.* (i >= 1), num_hidden_layers       stacked plain Llama layers (``drafter.num_layers`` > 1)
                                                              after EAGLE-3's ``midlayer.``, as P-EAGLE checkpoints
                                                              stack them

Read from vLLM's ``vllm/transformers_utils/configs/eagle.py`` (the architecture renaming),
``vllm/model_executor/models/registry.py`` (the Peagle* aliases serve the speculators format only),
``vllm/transformers_utils/configs/speculators/algos.py`` (``update_peagle``: the config keys it sets, ``pard_token``
from ``mask_token_id``), ``vllm/v1/spec_decode/llm_base_proposer.py`` (the parallel-drafting token id) and its tests'
``mask_hidden`` fixture ([1, 3 x hidden]). The serve command names ``method: eagle3`` and ``parallel_drafting: true``
explicitly (vLLM does not infer a P-EAGLE method from a plain checkpoint).

The speculators format (``format=speculators``) is speculators' EAGLE-3 layout (``serve.eagle``'s speculators row:
the Llama config nested in ``transformer_layer_config``, unpacked ``layers.0.`` tensors, a verifier block) with what
its P-EAGLE class reads: ``speculators_model_type: peagle``, ``architectures ["PEagleSpeculator"]``,
``mask_token_id``, ``speculators_config.algorithm: peagle``, ``mask_hidden`` as [1, 1, F*D] and the stacked layers as
plain Llama decoder layers ``layers.i.`` (i >= 1, ``transformer_layer_config.num_hidden_layers``). Read from
vllm-project/speculators 0.9.0 ``src/speculators/models/peagle`` (``PEagleSpeculatorConfig``, ``PEagleDraftModel``:
an ``Eagle3DraftModel`` plus ``mask_hidden``) and ``src/speculators/models/eagle3`` (the first layer, then plain
decoder layers); vLLM serves it through ``update_peagle`` (``pard_token`` from ``mask_token_id``) and
``method: eagle3`` with ``parallel_drafting``. tests/test_peagle.py loads it with speculators' own
``from_pretrained`` when the package is installed.

SGLang and Hugging Face are refused: SGLang's model directory (``python/sglang/srt/models``) has no P-EAGLE or
parallel-drafting EAGLE-3 class to transcribe, and Hugging Face has no P-EAGLE reference class."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file

from distill.atomic import save_tensors
from heads.base import TargetDims
from heads.peagle.model import PEagleDrafter
from serve.adapter import serve_name, target_dtype, target_facts, vocab_problem
from serve.eagle import (check_eagle31, check_target_family, drafter_from_engine, eagle31_settings, engine_config,
                         engine_state, load_like_engine, our_layers, written_layer_ids)
from serve.model_card import model_card

ARCHITECTURE = "LlamaForCausalLMEagle3"  # EAGLE-3's own (module docstring)
MASK_HIDDEN = "mask_hidden"


SPECULATORS_ARCHITECTURE = "PEagleSpeculator"


UPPER = re.compile(r"^layers\.([1-9][0-9]*)\.")  # exported layers after EAGLE-3's (``midlayer.`` / ``layers.0.``)
UPPER_PARAM = re.compile(r"^(model\.)?layers\.([1-9][0-9]*)\.")
# our UpperLayer's tensors -> the names of a Llama decoder layer (vLLM packs q,k,v and gate,up on load)
_UPPER = {"input_layernorm": "input_layernorm", "layer.q_proj": "self_attn.q_proj", "layer.k_proj": "self_attn.k_proj",
          "layer.v_proj": "self_attn.v_proj", "layer.o_proj": "self_attn.o_proj", "layer.gate_proj": "mlp.gate_proj",
          "layer.up_proj": "mlp.up_proj", "layer.down_proj": "mlp.down_proj",
          "layer.post_attention_layernorm": "post_attention_layernorm"}


def upper_state(upper) -> dict[str, torch.Tensor]:
    """A stacked layer's tensors under the Llama decoder layer's names (``layers.i.`` prefix added by the caller)."""
    ours = upper.state_dict()
    return {f"{theirs}.weight": ours[f"{mine}.weight"] for mine, theirs in _UPPER.items()}


def load_upper_layers(state: dict[str, torch.Tensor], config: dict, packed: bool = True
                      ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The engine's loading of the plain layers 1 .. n - 1 after EAGLE-3's: vLLM's (``model.layers.i.``, q/k/v and
    gate/up packed) or, ``packed=False``, speculators' (plain ``layers.i.`` modules): (parameters, problems), every
    exported tensor landing on a parameter of the right shape and every parameter set."""
    config = config.get("transformer_layer_config", config)
    D, h, I = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    kv, hd = config.get("num_key_value_heads") or h, config.get("head_dim") or D // h
    problems, params = [], {}
    top = "model." if packed else ""
    for i in range(1, config.get("num_hidden_layers", 1)):
        p = f"layers.{i}."
        want = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
                "self_attn.o_proj.weight": (D, h * hd), "mlp.down_proj.weight": (D, I)}
        for name, shape in want.items():
            t = state.pop(p + name, None)
            if t is None:
                problems.append(f"tensor {p + name!r} is missing (layer {i} of num_hidden_layers)")
            elif tuple(t.shape) != shape:
                problems.append(f"{p + name} has shape {tuple(t.shape)}, vLLM builds {shape}")
            else:
                params[top + p + name] = t
        if not packed:
            for group, parts in (("self_attn", (("q_proj", h), ("k_proj", kv), ("v_proj", kv))),
                                 ("mlp", (("gate_proj", I), ("up_proj", I)))):
                for part, n in parts:
                    name, shape = f"{p}{group}.{part}.weight", (n * hd if group == "self_attn" else n, D)
                    t = state.pop(name, None)
                    if t is None:
                        problems.append(f"tensor {name!r} is missing (layer {i} of num_hidden_layers)")
                    elif tuple(t.shape) != shape:
                        problems.append(f"{name} has shape {tuple(t.shape)}, speculators builds {shape}")
                    else:
                        params[name] = t
            continue
        for packed_name, parts in (("self_attn.qkv_proj", (("q_proj", h), ("k_proj", kv), ("v_proj", kv))),
                              ("mlp.gate_up_proj", (("gate_proj", I), ("up_proj", I)))):
            group = packed_name.split(".")[0]
            tensors = [state.pop(f"{p}{group}.{part}.weight", None) for part, _ in parts]
            rows = [n * hd if group == "self_attn" else n for _, n in parts]
            if any(t is None for t in tensors):
                missing = [part for (part, _), t in zip(parts, tensors) if t is None]
                problems.append(f"{p}{packed_name}: shards {missing} are missing, the packed parameter would be "
                                f"partly unset")
            elif any(tuple(t.shape) != (r, D) for t, r in zip(tensors, rows)):
                problems.append(f"{p}{packed_name}: shard shapes {[tuple(t.shape) for t in tensors]}, vLLM packs "
                                f"{[(r, D) for r in rows]}")
            else:
                params[f"model.{p}{packed_name}.weight"] = torch.cat(tensors, 0)
    problems += [f"tensor {k!r} matches no parameter of the {'vLLM' if packed else 'speculators'} model "
                 f"(num_hidden_layers={config.get('num_hidden_layers', 1)}): its loader would "
                 f"{'skip it silently' if packed else 'reject it'}" for k in sorted(state)]
    return params, problems


def unpack_upper(params: dict[str, torch.Tensor], i: int, config: dict) -> dict[str, torch.Tensor]:
    """Layer ``i``'s engine parameters back as our UpperLayer's tensors (packed ones split)."""
    config = config.get("transformer_layer_config", config)
    D, h, I = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    kv, hd = config.get("num_key_value_heads") or h, config.get("head_dim") or D // h
    p = f"model.layers.{i}." if f"model.layers.{i}.mlp.down_proj.weight" in params else f"layers.{i}."
    theirs = {name: params[p + name + ".weight"] for name in _UPPER.values() if p + name + ".weight" in params}
    if p + "self_attn.qkv_proj.weight" in params:
        q, k, v = params[p + "self_attn.qkv_proj.weight"].split([h * hd, kv * hd, kv * hd], 0)
        gate, up = params[p + "mlp.gate_up_proj.weight"].split([I, I], 0)
        theirs.update({"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v, "mlp.gate_proj": gate,
                       "mlp.up_proj": up})
    return {f"{mine}.weight": theirs[name] for mine, name in _UPPER.items()}


def _vllm_serve(target: str, export_dir: str, num_tokens: int) -> str:
    spec = {"method": "eagle3", "model": export_dir, "num_speculative_tokens": num_tokens, "parallel_drafting": True}
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def _speculators_serve(target: str, export_dir: str, num_tokens: int) -> str:
    # vLLM reads the verifier and the method (peagle: eagle3 with parallel drafting) from the speculators config
    return f"vllm serve {export_dir}   # or, explicitly:\n" + _vllm_serve(target, export_dir, num_tokens)


def _vllm_config(cfg: dict, drafter: PEagleDrafter) -> None:
    cfg.update(architectures=[ARCHITECTURE], pard_token=drafter.mask_token_id, mask_token_id=drafter.mask_token_id)
    cfg["num_hidden_layers"] = 1 + len(drafter.upper)


def _speculators_config(cfg: dict, drafter: PEagleDrafter) -> None:
    cfg.update(architectures=[SPECULATORS_ARCHITECTURE], speculators_model_type="peagle",
               mask_token_id=drafter.mask_token_id)
    cfg["speculators_config"]["algorithm"] = "peagle"
    cfg["transformer_layer_config"]["num_hidden_layers"] = 1 + len(drafter.upper)


def _speculators_problems(config: dict) -> list[str]:
    problems = [f"{key}={value!r}, speculators' P-EAGLE class is registered as 'peagle'" for key, value in
                (("speculators_model_type", config["speculators_model_type"]),
                 ("speculators_config.algorithm", config["speculators_config"].get("algorithm")))
                if value != "peagle"]
    if not (config["speculators_config"].get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is missing (vLLM reads the target from it)")
    return problems


@dataclass(frozen=True)
class PEagleEngine:
    """What one engine's P-EAGLE class reads on top of its EAGLE-3 layout (``serve.eagle.ENGINES``' row)."""

    architecture: str  # config.json ``architectures``
    token_key: str  # the config key it reads the parallel slots' token id from
    mask_hidden_shape: tuple[int, ...]  # mask_hidden's shape, -1 for F x D
    configure: Callable[[dict, PEagleDrafter], None]  # its keys, set on EAGLE-3's config
    serve: Callable[[str, str, int], str]  # (target, export dir, num tokens) -> command
    need: tuple[str, ...]  # config keys it cannot do without, beyond architectures / draft_vocab_size / token_key
    packed: bool = True  # it packs the stacked layers' q/k/v and gate/up on load (and prefixes ``model.``)
    problems: Callable[[dict], list[str]] = lambda config: []  # format checks of its own


ENGINES = {
    "vllm": PEagleEngine(architecture=ARCHITECTURE, token_key="pard_token", mask_hidden_shape=(1, -1),
                         configure=_vllm_config, serve=_vllm_serve, need=("hidden_size", "vocab_size")),
    "speculators": PEagleEngine(  # speculators' parameter is [1, 1, F*D]
        architecture=SPECULATORS_ARCHITECTURE, token_key="mask_token_id", mask_hidden_shape=(1, 1, -1),
        configure=_speculators_config, serve=_speculators_serve, packed=False, problems=_speculators_problems,
        need=("speculators_model_type", "transformer_layer_config", "speculators_config")),
}


class PEagleAdapter:
    kinds = ("peagle",)
    needs_training = True
    refused = {("sglang", "peagle"): "SGLang has no P-EAGLE (parallel drafting) model class to load it; export "
                                     "with format=vllm or format=speculators (vLLM serves both)",
               ("hf", "peagle"): "P-EAGLE has no Hugging Face reference model class; export with format=vllm or "
                                 "format=speculators"}

    engines = ENGINES  # one row per engine

    def supports(self, engine: str, kind: str) -> bool:
        return engine in self.engines

    def write(self, out: Path, drafter: PEagleDrafter, engine: str, config: dict, output_dir: Path) -> None:
        facts = target_facts(config)
        check_target_family(engine, "eagle3", facts.get("model_type"))
        check_eagle31(engine, drafter)
        dtype = target_dtype(config)
        target = {**config.get("target", {}), **facts, "serve_name": serve_name(config)}
        row = self.engines[engine]
        cfg = engine_config(drafter, engine, target, str(dtype).removeprefix("torch."), drafter.num_depths)
        row.configure(cfg, drafter)
        state = engine_state(drafter, engine, dtype)
        state[MASK_HIDDEN] = drafter.mask_hidden.detach().to(dtype).reshape(row.mask_hidden_shape).contiguous()
        for i, upper in enumerate(drafter.upper, start=1):
            state.update({f"layers.{i}.{name}": t.detach().to(dtype).contiguous()
                          for name, t in upper_state(upper).items()})
        save_tensors(state, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))

    def sidecar(self, drafter) -> dict[str, Any]:
        return {}

    def _engine_state(self, path: Path, engine: str, config: dict
                      ) -> tuple[dict, torch.Tensor | None, torch.Tensor | None, list[str]]:
        """(EAGLE-3 parameters as the engine loads them, d2t's target ids, mask_hidden, problems)."""
        state = load_file(str(path / "model.safetensors"))
        mask_hidden = state.pop(MASK_HIDDEN, None)
        upper = {k: state.pop(k) for k in list(state) if UPPER.match(k)}
        params, vocab, problems = load_like_engine(engine, "eagle3", state, config)
        row = self.engines[engine]
        upper_params, upper_problems = load_upper_layers(upper, config, packed=row.packed)
        params.update(upper_params)
        problems += upper_problems
        width = config.get("transformer_layer_config", config)["hidden_size"] * 3
        want = tuple(width if n == -1 else n for n in row.mask_hidden_shape)
        if mask_hidden is None:
            problems.append(f"tensor {MASK_HIDDEN!r} is missing: {engine}'s P-EAGLE requires it")
        elif tuple(mask_hidden.shape) != want:
            problems.append(f"{MASK_HIDDEN} has shape {tuple(mask_hidden.shape)}; {engine} reads {list(want)} "
                            f"(3 x hidden)")
        return params, vocab, mask_hidden, problems

    def check(self, path: Path, engine: str, kind: str, config: dict, target: dict) -> list[str]:
        if not (path / "model.safetensors").is_file():
            return [f"{path / 'model.safetensors'} is missing"]
        row = self.engines[engine]
        layer_cfg = config.get("transformer_layer_config", config)
        token_key = row.token_key
        need = ("architectures", "draft_vocab_size", token_key) + row.need
        problems = [f"config.json lacks {key}" for key in need if key not in config]
        if problems:
            return problems
        if config["architectures"] != [row.architecture]:
            problems.append(f"config.json architectures={config['architectures']!r}, expected [{row.architecture!r}]")
        problems += row.problems(config)
        token = config[token_key]
        if not isinstance(token, int) or not 0 <= token < layer_cfg["vocab_size"]:
            problems.append(f"{token_key}={token!r} is not a token id of the vocabulary")
        elif config.get("mask_token_id", token) != token:
            problems.append(f"mask_token_id={config['mask_token_id']!r} differs from pard_token={token}")
        ids = written_layer_ids(engine, config)
        if not ids or len(ids) != 3:
            problems.append(f"eagle_aux_hidden_state_layer_ids={ids!r}: vLLM needs the 3 target layers")
        if "norm_before_residual" not in config:
            problems.append("config.json lacks norm_before_residual (the residual convention must be explicit)")
        problems += vocab_problem(layer_cfg["vocab_size"], target)
        _, vocab, _, mapped = self._engine_state(path, engine, config)
        problems += mapped
        if vocab is not None and not (vocab.min() >= 0 and vocab.max() < layer_cfg["vocab_size"]
                                      and vocab.unique().numel() == vocab.numel()):
            problems.append("d2t offsets do not map the draft vocabulary onto distinct target ids")
        return problems

    def load(self, path: Path, engine: str, kind: str, sidecar: dict, dims: TargetDims) -> PEagleDrafter:
        """The drafter rebuilt from what vLLM reads: EAGLE-3's parameters (``serve.eagle.drafter_from_engine``), the
        mask token and ``mask_hidden``; the training-only depth sampling keys come from the sidecar."""
        config = json.loads((path / "config.json").read_text())
        params, vocab, mask_hidden, problems = self._engine_state(path, engine, config)
        if problems:
            raise ValueError(f"{path} does not load into {engine}'s P-EAGLE: " + "; ".join(problems))
        layers = our_layers(engine, "eagle3", config)
        first = {k: v for k, v in params.items() if not UPPER_PARAM.match(k)}
        eagle3 = drafter_from_engine(engine, "eagle3", first, vocab, config, dims, layers, {})
        saved = sidecar["drafter"]
        c = config.get("transformer_layer_config", config)
        token = config[self.engines[engine].token_key]
        drafter = PEagleDrafter(dims, layers=layers, num_heads=c["num_attention_heads"],
                                intermediate_size=c["intermediate_size"], rope_theta=c["rope_theta"],
                                draft_vocab_size=config["draft_vocab_size"], mask_token_id=token,
                                num_depths=saved.get("num_depths", 8), depth=saved.get("depth"),
                                num_layers=c["num_hidden_layers"], **eagle31_settings(config))
        state = {**eagle3.state_dict(), MASK_HIDDEN: mask_hidden.reshape(-1).to(torch.float32)}
        for i in range(1, c["num_hidden_layers"]):
            state.update({f"upper.{i - 1}.{name}": t.to(torch.float32)
                          for name, t in unpack_upper(params, i, config).items()})
        drafter.load_state_dict(state, strict=True)
        return drafter

    def serve_command(self, engine: str, kind: str, target: str, export_dir: str, num_tokens: int,
                      tree: dict | None = None) -> str:
        return self.engines[engine].serve(target, export_dir, num_tokens)

    def card(self, engine: str, kind: str, config: dict, output_dir: Path, report: dict | None,
             serve_target: str) -> str:
        drafter = config.get("drafter", {})
        tokens = drafter.get("depth") or drafter.get("num_depths") or 8
        line = self.serve_command(engine, kind, serve_target, str(output_dir), tokens)
        token = f"`{self.engines[engine].token_key}`"
        notes = [f"P-EAGLE: EAGLE-3's layout plus `mask_hidden` and {token} (the parallel slots' inputs); vLLM "
                 f"drafts {tokens} tokens per forward with parallel drafting. Target layers (specdraft hidden-state "
                 f"indices): {drafter.get('layers')}. The target's embeddings are not in this export: the engine "
                 f"shares the target's own.", ""]
        return model_card(engine, kind, config, report, line, notes)
