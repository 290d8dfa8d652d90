"""Typed schema for the Hydra config, and one ``validate(cfg)`` for the checks that span fields.

Each group's dataclass lives with the code that reads it (``TargetConfig`` in ``distill.teacher``, with
``ToyTargetConfig`` from ``distill.toy``; ``DataConfig`` in ``distill.data``; ``TrainerConfig`` in ``train.engine``; ``LoggerConfig`` in ``train.logger``;
``DecoderConfig`` in ``inference.decoder``; ``CacheConfig`` and ``RegenerateConfig`` beside their CLIs in
``distill.cache`` and ``distill.regenerate``); this module assembles them into
``Config``, registered in Hydra's ConfigStore as ``base_config``. ``conf/config.yaml`` lists it first in its
defaults, so a misspelt key (``trainer.lrr=1e-3``) fails at start-up instead of being ignored. ``drafter`` and
``loss`` are free-form mappings because each plugs in by ``_target_``; ``validate`` checks their keys against the
signature of the class or function they name.

Each entry point turns the composed config into these typed objects once (``load_config``: ``OmegaConf.to_object``,
then ``validate``) and passes them down: code below reads ``cfg.trainer.lr``, never a string key.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import importlib
import inspect
import math
import os
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError
from omegaconf.nodes import FloatNode, IntegerNode

from distill import losses
from distill.cache import CacheConfig
from distill.data import DATA_MODES, DataConfig, ON_POLICY_MODES
from distill.prompts import context_prompt_tokens
from distill.regenerate import RegenerateConfig
from distill.fused_kernels import check_kernel
from heads.train_attention import check_attention
from distill.teacher import TargetConfig
from inference.decoder import ACCEPTANCE_RULES, DecoderConfig
from inference.runner import CUDA_GRAPHS, compile_setting
from inference.policy import POLICIES, check_batch_sizes
from inference.tree import parse_tree
from train.compile import check_compile
from train.engine import ENGINES, TARGET_SHARDING, TrainerConfig
from train.selection import SELECTIONS
from train.logger import LoggerConfig


@dataclass
class EvalConfig:
    enabled: bool = True  # python -m train: evaluate the trained drafter (false: train and save only)
    prompts: Optional[str] = None  # a jsonl file (question.jsonl "turns", "prompt" or "text"); null: held-out stdlib
    num_prompts: int = 20
    prompt_tokens: int = 128
    max_new_tokens: int = 96
    num_draft: int = 4  # γ: draft tokens proposed per target forward
    baselines: List[str] = field(default_factory=lambda: ["lookup"])  # untrained drafters shown beside the one tested
    warmup_prompts: int = 1  # decoded first and not timed (one-off allocation costs)
    # dtype drafters propose in: auto (bf16 where the device computes it natively) | float32 | bfloat16. Proposals
    # only: verification stays in target.dtype, so the output is unchanged.
    drafter_dtype: str = "auto"
    # python -m eval drafter_path=...: measure against a target whose weights differ from the one the drafter was
    # trained for (its digest is stored with the drafter); otherwise that is an error.
    allow_other_target: bool = False
    hf_baselines: bool = True  # also time HF generate() and, for a draft model, HF assisted generation
    plots: bool = True  # PNG figures beside report.json
    # τ and speedup per context length, e.g. [64,128,256] (tokens): each bucket decodes the same held-out passages cut
    # to length - max_new_tokens - γ tokens, so decoding runs up to that position (eval.context_lengths); null: off
    context_lengths: Optional[List[int]] = None
    # python -m eval: where the drafter is also served, its acceptance reported beside this decoder's on the same
    # prompts (report.json "served"): specdraft (this decoder only) | vllm (the drafter's format=vllm export loaded
    # in vLLM, which must be installed: make vllm-check; docs/export.md)
    engine: str = "specdraft"
    # eval.engine=vllm: a format=vllm export of the evaluated drafter to serve; null: export it to a temporary dir
    export: Optional[str] = None


EVAL_ENGINES = ("specdraft", "vllm")  # eval.engine


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: Dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    loss: Dict[str, Any] = field(default_factory=dict)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    seed: int = 0  # torch seed of the drafter's initial weights and of the data order
    drafter_path: Optional[str] = None  # python -m eval: the saved drafter directory to evaluate


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)


def load_config(cfg: DictConfig) -> Config:
    """The composed Hydra config as typed objects (``Config``), checked once (``validate``): what an entry point
    passes down."""
    _refuse_unknown_keys(cfg, Config)
    config = OmegaConf.to_object(cfg)
    _expand_user_paths(config)
    validate(config)
    return config


# Every path setting, read or written: ``~`` expanded once, here, so that no reader or writer meets a literal ``~``
# (a writer would create a directory named ``~`` in the working directory).
PATH_KEYS = ("data.path", "data.regenerated", "data.teacher_cache", "regenerate.out", "cache.dir", "target.cache_dir",
             "eval.prompts", "eval.export", "drafter_path")


def _expand_user_paths(config: Config) -> None:
    for key in PATH_KEYS:
        *parents, name = key.split(".")
        node = functools.reduce(getattr, parents, config)
        value = getattr(node, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(node, name, os.path.expanduser(value))
    if config.target.source == "hf" and config.target.name.startswith("~"):  # a local directory, not a hub id
        config.target.name = os.path.expanduser(config.target.name)


def _refuse_unknown_keys(node: DictConfig, schema: type, prefix: str = "") -> None:
    """A key the typed schema does not have, added with ``+key=value`` (which Hydra lets past the schema), is a
    misspelling like any other: refused, never stored and ignored. ``drafter`` and ``loss`` are open mappings whose
    keys ``validate`` checks against the class or function they name."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        name = f"{prefix}{key}"
        if key not in fields:
            raise ValueError(f"unknown key {name} (from +{name}=... on the command line or a config file); valid keys"
                             f"{' under ' + prefix[:-1] if prefix else ''}: {sorted(fields)}")
        sub = OmegaConf.get_type(node, key) if isinstance(node[key], DictConfig) else None
        if sub is not None and dataclasses.is_dataclass(sub):
            _refuse_unknown_keys(node[key], sub, f"{name}.")


def _resolve_target(path: str, key: str):
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"{key}._target_={path!r} cannot be imported ({e}); check the spelling in conf/{key}/") from e


def _check_keys(node: Mapping, key: str, runtime: tuple[str, ...] = ()) -> None:
    """Keys of a ``_target_`` node must be parameters of what it names (runtime ones are passed in code)."""
    if "_target_" not in node:
        raise ValueError(f"{key} has no _target_; pick a preset, e.g. {key}=medusa")
    params = inspect.signature(_resolve_target(node["_target_"], key)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [name for name in params if name not in runtime and name not in ("self", "student", "teacher", "mask")]
    for name in node:
        if not str(name).startswith("_") and name not in params:
            raise ValueError(f"unknown key {key}.{name}; valid keys for {node['_target_']}: {sorted(valid)}")


def typed_values(node: Mapping, key: str) -> dict:
    """``node`` with each value converted to the type its ``_target_`` declares for it, as a typed schema key converts
    it (``drafter.fc_norm=no`` is False, ``drafter.num_heads='8'`` is 8), so the stored config holds the typed
    value; a value that does not convert (``bool("no")`` would be True) is refused naming the key and the type.
    Parameters a class takes through ``**kwargs`` are typed by its base classes' ``__init__``."""
    target = _resolve_target(node["_target_"], key)
    hints: dict[str, Any] = {}
    for owner in (target.__mro__ if inspect.isclass(target) else (target,)):
        init = owner.__init__ if inspect.isclass(owner) else owner
        try:
            params = inspect.signature(init, eval_str=True).parameters
        except (NameError, TypeError, ValueError):  # an annotation that does not evaluate: left unchecked
            continue
        for name, param in params.items():
            hints.setdefault(name, param.annotation)
    out = dict(node)
    for name, value in node.items():
        if not str(name).startswith("_") and name in hints:
            out[name] = _typed(value, hints[name], f"{key}.{name}")
    return out


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _typed(value: Any, annotation: Any, name: str) -> Any:
    """``value`` as ``annotation`` (bool, int, float, str, a list or mapping of them, a union, optional); an annotation
    this does not know (a class, ``Any``) takes the value as it is."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        exact = [a for a in options if _is_exactly(value, a)]
        if len(options) == 1 or exact:  # the value's kind is known: its own message says what is wrong inside it
            return _typed(value, (exact or options)[0], name)
        for option in options:
            try:
                return _typed(value, option, name)
            except ValueError:
                continue
        raise ValueError(f"{name}={value!r} is not a {_type_name(annotation)}; set {name} to one")
    if annotation is type(None):
        if value is None:
            return None
        raise ValueError(f"{name}={value!r} is not null")
    if annotation is bool:
        text = str(value).strip().lower() if isinstance(value, (str, int)) else None
        if isinstance(value, bool) or text in _TRUE + _FALSE:
            return value if isinstance(value, bool) else text in _TRUE
        raise ValueError(f"{name}={value!r} is not a boolean; set {name}=true or {name}=false")
    if annotation in (int, float):
        if isinstance(value, annotation) and not isinstance(value, bool):
            return value
        try:
            return (IntegerNode if annotation is int else FloatNode)(value)._value()
        except ValidationError:
            raise ValueError(f"{name}={value!r} is not {'an integer' if annotation is int else 'a number'}; set "
                             f"{name} to one") from None
    if annotation is str:
        if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return str(value)
        raise ValueError(f"{name}={value!r} is not a string; set {name} to one (quote it)")
    if (origin or annotation) in (list, tuple, Sequence, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}={value!r} is not a list; set {name}=[...]")
        return [_typed(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if (origin or annotation) in (dict, Mapping, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise ValueError(f"{name}={value!r} is not a mapping; set {name}={{key: value, ...}}")
        return {k: _typed(v, args[1], f"{name}.{k}") for k, v in value.items()} if len(args) == 2 else dict(value)
    return value


def _is_exactly(value: Any, annotation: Any) -> bool:
    """Whether ``value`` already is of ``annotation``'s kind, so a union keeps it rather than converting it."""
    kind = typing.get_origin(annotation) or annotation
    if kind is type(None):
        return value is None
    if kind in (int, float):
        return isinstance(value, kind) and not isinstance(value, bool)
    if kind in (list, tuple, Sequence, collections.abc.Sequence):
        return isinstance(value, (list, tuple))
    if kind in (dict, Mapping, collections.abc.Mapping):
        return isinstance(value, Mapping)
    return isinstance(kind, type) and isinstance(value, kind)


def _type_name(annotation: Any) -> str:
    return " or ".join("null" if a is type(None) else getattr(a, "__name__", str(a))
                       for a in typing.get_args(annotation))


def validate(cfg: Config) -> None:
    """Cross-field checks, once, before anything is built."""
    t = cfg.trainer
    if t.engine not in ENGINES:
        raise ValueError(f"trainer.engine={t.engine!r} is not available; valid: {sorted(ENGINES)}")
    for name in ("steps", "micro_batch_size", "grad_accum", "log_every", "ckpt_every"):
        if getattr(t, name) < 1:
            raise ValueError(f"trainer.{name} must be >= 1, got {getattr(t, name)}")
    _check_schedule(t)
    if t.bf16 and t.fp16:
        raise ValueError("trainer.bf16=true and trainer.fp16=true exclude each other; set one of them to false")
    if t.zero_stage not in (1, 2, 3):
        raise ValueError(f"trainer.zero_stage={t.zero_stage}; valid: 1, 2, 3")
    if t.global_batch_size is not None and t.global_batch_size < 1:
        raise ValueError(f"trainer.global_batch_size must be >= 1 or null, got {t.global_batch_size}")
    if t.peak_tflops is not None and not t.peak_tflops > 0:
        raise ValueError(f"trainer.peak_tflops must be > 0 (one device's dense bf16 TFLOP/s, for perf/mfu) or null "
                         f"(looked up from the GPU's name), got {t.peak_tflops}")

    if cfg.target.shard not in TARGET_SHARDING:
        raise ValueError(f"target.shard={cfg.target.shard!r}; valid: {list(TARGET_SHARDING)}")
    check_compile(t.compile, t.engine, t.zero_stage)
    if t.resume not in ("auto", "never"):
        raise ValueError(f"trainer.resume={t.resume!r}; valid: 'auto', 'never'")
    if cfg.logger.name not in ("none", "wandb"):
        raise ValueError(f"logger.name={cfg.logger.name!r}; valid: 'none', 'wandb'")
    if cfg.eval.num_draft < 1:
        raise ValueError(f"eval.num_draft must be >= 1, got {cfg.eval.num_draft}")
    if cfg.eval.engine not in EVAL_ENGINES:
        raise ValueError(f"eval.engine={cfg.eval.engine!r}; valid: {list(EVAL_ENGINES)} (vllm also serves the drafter "
                         f"in vLLM and reports its acceptance beside this decoder's)")
    # python -m eval drafter_path=... evaluates against the drafter's saved target, not cfg.target: its positions
    # are checked once it is loaded (eval.context_lengths), naming that target's, never the default's.
    _check_context_lengths(cfg.eval, cfg.target if not cfg.drafter_path else None)
    cfg.decoder.sampling()  # temperature / top_p / top_k ranges
    if cfg.decoder.acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"decoder.acceptance={cfg.decoder.acceptance!r}; valid: {list(ACCEPTANCE_RULES)} (typical is lossy)")
    if cfg.decoder.cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"decoder.cuda_graphs={cfg.decoder.cuda_graphs!r}; valid: {list(CUDA_GRAPHS)} (auto: on for "
                         f"a CUDA target)")
    compile_setting(cfg.decoder.compile)  # auto / on / off
    parse_tree(cfg.decoder.tree)
    _check_batched(cfg.decoder)
    if cfg.drafter:
        _check_keys(cfg.drafter, "drafter", runtime=("dims",))
        cfg.drafter = typed_values(cfg.drafter, "drafter")
    if cfg.loss:
        _check_keys(cfg.loss, "loss")
    _check_data_mode(cfg.data, cfg.trainer)
    if cfg.data.mode == "regenerate" and cfg.regenerate.shard != "none":
        raise ValueError(f"data.mode=regenerate decodes on the training job's ranks with the target as training loads "
                         f"it; regenerate.shard={cfg.regenerate.shard} is for a separate regeneration job: run "
                         f"`torchrun -m distill.regenerate regenerate.shard={cfg.regenerate.shard} "
                         f"regenerate.out=<file.jsonl>` first, then train with data.mode=regenerated "
                         f"data.regenerated=<file.jsonl>")
    if cfg.data.mode == "regenerate" and cfg.target.shard != "replicate":
        raise ValueError(f"data.mode=regenerate decodes a different share of the prompts on each rank, which a target "
                         f"split over the ranks (target.shard={cfg.target.shard}) cannot do; regenerate first with "
                         f"`torchrun -m distill.regenerate regenerate.out=<file.jsonl>` where the target fits, then "
                         f"train with data.mode=regenerated data.regenerated=<file.jsonl>")
    _check_loss_values(cfg.loss)
    if cfg.target.source == "toy" and cfg.data.max_length > cfg.target.toy.max_seq_len:
        raise ValueError(
            f"data.max_length={cfg.data.max_length} exceeds the toy target's context "
            f"target.toy.max_seq_len={cfg.target.toy.max_seq_len}; lower data.max_length"
        )


def _check_context_lengths(ev: EvalConfig, target: TargetConfig | None) -> None:
    """``eval.context_lengths`` as far as the config tells (the target's positions and BOS are checked again once it
    is loaded: ``eval.context_lengths``); ``target`` None: the target evaluated is not ``cfg.target``."""
    if not ev.context_lengths:
        return
    if ev.prompts:
        raise ValueError(f"eval.context_lengths builds its prompts from held-out text, but eval.prompts={ev.prompts} "
                         f"names a prompt file; set eval.prompts=null, or eval.context_lengths=null")
    context_prompt_tokens(ev.context_lengths, ev.max_new_tokens, ev.num_draft,
                          target.toy.max_seq_len if target is not None and target.source == "toy" else 0)


def _check_schedule(t: TrainerConfig) -> None:
    """Learning-rate schedule and optimizer values a run could not train with, refused before anything is built
    (a negative rate would otherwise surface as a raw torch error, or train uphill)."""
    for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip"):
        if not math.isfinite(getattr(t, name)):
            raise ValueError(f"trainer.{name}={getattr(t, name)} is not a finite number")
    if not t.lr > 0:
        raise ValueError(f"trainer.lr={t.lr} must be > 0 (the peak learning rate, e.g. 3e-3)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ValueError(f"trainer.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1] (the cosine floor as a fraction of "
                         f"trainer.lr; a negative one would make the learning rate negative)")
    if t.warmup_steps < 0:
        raise ValueError(f"trainer.warmup_steps={t.warmup_steps} must be >= 0")
    if t.weight_decay < 0:
        raise ValueError(f"trainer.weight_decay={t.weight_decay} must be >= 0")
    if t.grad_clip < 0:
        raise ValueError(f"trainer.grad_clip={t.grad_clip} must be >= 0 (0: no clipping)")
    if t.loss_chunk_elements is not None and t.loss_chunk_elements < 1:
        raise ValueError(f"trainer.loss_chunk_elements={t.loss_chunk_elements} must be >= 1 (rows x vocabulary per "
                         f"loss chunk) or null (per device: 2^25 on a CPU, 2^28 on a GPU)")
    check_kernel(t.fused_kernel)
    check_attention(t.attention)
    if t.select not in SELECTIONS:
        raise ValueError(f"trainer.select={t.select!r}; valid: {list(SELECTIONS)}")
    if t.eval_every < 0 or t.eval_rows < 1:
        raise ValueError(f"trainer.eval_every={t.eval_every} must be >= 0 (0: no held-out evaluation) and "
                         f"trainer.eval_rows={t.eval_rows} >= 1")
    if t.select == "best_tau" and t.eval_every == 0:
        raise ValueError("trainer.select=best_tau needs the held-out evaluation: set trainer.eval_every >= 1 (e.g. "
                         "200), or trainer.select=last")
    if t.keep_last < 1:
        raise ValueError(f"trainer.keep_last={t.keep_last} must be >= 1 (the newest checkpoint is what a resume needs)")


def _check_data_mode(data: DataConfig, trainer: TrainerConfig) -> None:
    if data.mode not in DATA_MODES:
        raise ValueError(f"data.mode={data.mode!r} is not a data mode; valid: {list(DATA_MODES)}")
    if data.mode == "regenerated" and not data.regenerated:
        raise ValueError("data.mode=regenerated needs data.regenerated=<file.jsonl>, written by "
                         "`python -m distill.regenerate regenerate.out=<file.jsonl>`")
    if data.mode == "regenerate" and data.teacher_cache:
        raise ValueError(f"data.mode=regenerate trains on the target's new answers; data.teacher_cache="
                         f"{data.teacher_cache} holds the fixed rows' signals. Set data.teacher_cache=null")
    if data.mode == "fixed" and data.regenerated:
        raise ValueError(f"data.regenerated={data.regenerated} is set but data.mode=fixed ignores it; set "
                         f"data.mode=regenerated (or mixed), or data.regenerated=null")
    if data.mode in ON_POLICY_MODES:
        if trainer.engine == "fsdp" or (trainer.engine == "deepspeed" and trainer.zero_stage == 3):
            raise ValueError(f"data.mode={data.mode} samples from the draft outside its forward, which a sharded drafter "
                             f"(trainer.engine={trainer.engine}) cannot do; use trainer=ddp, zero1 or zero2")
        if data.teacher_cache:
            raise ValueError(f"data.mode={data.mode} scores the draft's own samples with the live target; it cannot "
                             f"use data.teacher_cache={data.teacher_cache} (set data.teacher_cache=null)")
        if not data.packing:
            raise ValueError(f"data.mode={data.mode} continues each row's first data.on_policy_prompt_tokens tokens; it "
                             f"needs packed rows (data.packing=true)")
        if not 1 <= data.on_policy_prompt_tokens < data.max_length:
            raise ValueError(f"data.on_policy_prompt_tokens={data.on_policy_prompt_tokens} must lie in "
                             f"[1, data.max_length={data.max_length}) so the draft writes at least one token")
        if data.on_policy_temperature < 0:
            raise ValueError(f"data.on_policy_temperature={data.on_policy_temperature} must be >= 0 (0: argmax)")
    if not 0 <= data.on_policy_fraction <= 1:
        raise ValueError(f"data.on_policy_fraction={data.on_policy_fraction} must lie in [0, 1]")


def _check_loss_values(loss: Mapping) -> None:
    """The loss presets' numeric arguments, before anything is built (the functions check again when called).
    ``loss`` is the keyword arguments of the function its ``_target_`` names, so it is read by parameter name."""
    if not loss:
        return
    if "temperature" in loss and not loss["temperature"] > 0:
        raise ValueError(f"loss.temperature={loss['temperature']} must be > 0")
    if "beta" in loss and not 0 <= loss["beta"] <= 1:
        raise ValueError(f"loss.beta={loss['beta']} must lie in [0, 1] (generalised JSD: 0 and 1 are the two KL "
                         f"limits, 0.5 the symmetric JSD)")
    if "k" in loss and not loss["k"] >= 1:
        raise ValueError(f"loss.k={loss['k']} must be >= 1 (teacher top-k tokens kept)")
    if "_target_" in loss:  # a menu loss's other arguments (lk's variant and eta, acceptance_weighted's base), checked
        # by the function that takes them; None for a callable outside the menu
        func = _resolve_target(loss["_target_"], "loss")
        losses.row_divergence(functools.partial(func, **{k: v for k, v in loss.items() if not str(k).startswith("_")}))


def _check_batched(decoder: DecoderConfig) -> None:
    if decoder.policy not in POLICIES:
        raise ValueError(f"decoder.policy={decoder.policy!r} is not a policy; valid: {list(POLICIES)}")
    if decoder.batch_sizes is None:
        if decoder.policy != "always":
            raise ValueError(f"decoder.policy={decoder.policy} applies to batched decoding; set decoder.batch_sizes, "
                             f"e.g. decoder.batch_sizes=[1,2,4,8,16,32]")
        return
    check_batch_sizes(decoder.batch_sizes)
    if decoder.acceptance != "exact":
        raise ValueError(f"decoder.acceptance={decoder.acceptance} with decoder.batch_sizes: batched decoding is exact "
                         f"(lossless) only; set decoder.acceptance=exact or decoder.batch_sizes=null")


def to_container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
