"""A standalone draft LM: a small causal LM that shares the target's tokenizer drafts a chain, one token per forward.

Which token each output predicts: like the target, the draft model's logits at position t predict token t+1.
Drafting feeds its own guesses back in, so draft token k is its guess for the k-th token after the committed ones.

Shape legend:  B batch, T sequence, V vocabulary (the target's), n committed tokens, k = max_depth.
    tokens [1, n] -> draft model (its own KV cache, kept between proposals) -> chain tokens [k], probs_NV [k, V] | None

Decoding: the cache holds the ids of the previous proposal's context and all its drafts but the last (the last draft
is never fed). A new proposal crops the cache back to the longest prefix it shares with ``tokens``, feeds the rest in
one forward, then drafts one token per forward: argmax when greedy (probabilities None), else a draw from the
draft logits warped by ``inference.sampling.warp`` exactly as the target's (those rows are the chain's ``probs_NV``).

Training target: the draft model's logits at t are distilled toward the teacher's logits at t (both predict token
t+1), wherever token t+1 is a real, loss-bearing token (``distill.data``'s ``loss_mask`` marks predicted tokens).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict
from typing import Any, Mapping

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from distill.teacher import DTYPES, TeacherOutput
from distill.toy import ToyTargetConfig, load_or_build_toy_target
from heads.base import DraftOutput, DraftTerm, Drafter, TargetDims
from inference.sampling import GREEDY, SamplingConfig, sample, warp
from inference.tree import DraftTree

SOURCES = ("toy", "hf")


class DraftModel(Drafter):
    """A Hugging Face causal LM as the drafter.

    Where the model comes from, first match wins: ``model`` (a ready ``PreTrainedModel``, runtime only, never in
    yaml); ``model_config`` (a saved draft model's HF config: the architecture is rebuilt with fresh weights, which
    ``load_drafter`` then overwrites, so loading never rebuilds the toy or downloads anything); ``source="toy"``
    (a small Llama built from the stdlib like the toy target and cached the same way); ``source="hf"`` (``name``:
    a hub id or a local directory).
    """

    name = "draft_model"  # how reports label it; the HF model's name is ``model_name``
    teacher_layers = ()

    def __init__(self, dims: TargetDims | Mapping[str, int], source: str = "toy", name: str | None = None,
                 revision: str | None = None, toy: dict | None = None, dtype: str = "float32",
                 trust_remote_code: bool = False, model_config: dict | None = None, model=None):
        super().__init__(dims)
        if dtype not in DTYPES:
            raise ValueError(f"drafter.dtype={dtype!r} is not supported; valid: {sorted(DTYPES)}")
        self.source, self.model_name, self.revision = source, name, revision
        self.toy, self.dtype_name, self.trust_remote_code = dict(toy or {}), dtype, trust_remote_code
        tokenizer = None
        if model is None and model_config is not None:
            model = _from_config(model_config).to(DTYPES[dtype])
        elif model is None:
            model, tokenizer = self._load(source)
        # A submodule, so state_dict(), save_drafter and load_drafter carry its weights.
        self.model = model
        self.tokenizer = tokenizer
        # What saved_config() records to rebuild the architecture; in its JSON form (to_dict keeps int keys in
        # id2label), so a saved node compares equal to a fresh one when a training run resumes.
        self.model_config = json.loads(model.config.to_json_string(use_diff=False))
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Tied embeddings are one tensor under two names; safetensors refuses to save shared tensors, so the
        # alias is left out of state_dict() and restored from its source on load (as HF's save_pretrained does).
        self.register_state_dict_post_hook(_drop_tied_aliases)
        self.register_load_state_dict_pre_hook(_restore_tied_aliases)
        self.reset()

    @property
    def needs_training(self) -> bool:
        """A draft LM is pretrained: useful as it is, and distillation only improves it."""
        return False

    def _load(self, source: str):
        """(model, tokenizer) from ``source``; the tokenizer is kept so bind_target can compare it with the target's."""
        if source == "toy":
            defaults = asdict(ToyTargetConfig())
            unknown = sorted(set(self.toy) - set(defaults))
            if unknown:
                raise ValueError(f"drafter.toy has unknown keys {unknown}; valid: {sorted(defaults)}")
            model, tokenizer = load_or_build_toy_target({**defaults, **self.toy}, cache_dir=None)
        elif source == "hf":
            if not self.model_name:
                raise ValueError("drafter.source=hf needs drafter.name: a hub id or a local directory with the draft model")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            kw = {"revision": self.revision, "trust_remote_code": self.trust_remote_code}
            tokenizer = AutoTokenizer.from_pretrained(self.model_name, **kw)
            model = AutoModelForCausalLM.from_pretrained(self.model_name, dtype=DTYPES[self.dtype_name], **kw)
        else:
            raise ValueError(
                f"drafter.source={source!r} is not known; valid: {list(SOURCES)} ('toy': a small model built from "
                f"the stdlib like the toy target, 'hf': drafter.name is a hub id or local path)"
            )
        return model.to(DTYPES[self.dtype_name]).eval(), tokenizer

    def saved_config(self, drafter_cfg: Mapping[str, Any] | None = None) -> dict:
        """The drafter node to save: ``drafter_cfg`` (or this drafter's own arguments) plus ``model_config``, so that
        ``load_drafter`` rebuilds the architecture without the runtime-only ``model`` or a toy build / download."""
        node = dict(drafter_cfg) if drafter_cfg is not None else {
            "_target_": f"{type(self).__module__}.{type(self).__qualname__}", "source": self.source,
            "name": self.model_name, "revision": self.revision, "toy": dict(self.toy), "dtype": self.dtype_name,
            "trust_remote_code": self.trust_remote_code,
        }
        node.pop("model", None)
        node["model_config"] = self.model_config
        return node

    def bind_target(self, teacher, initialize: bool) -> None:
        """Refuse a draft model whose vocabulary differs from the target's: its token ids would mean other text.
        Nothing to initialise: the draft model brings its own (pretrained) weights."""
        what = f"draft model {self.model_name or type(self.model).__name__!r}"
        sizes = {
            "output embedding rows": self.model.get_output_embeddings().weight.shape[0],
            "config.vocab_size": getattr(self.model.config.get_text_config(), "vocab_size", None),
            "drafter dims.vocab_size": self.dims.vocab_size,
        }
        for label, size in sizes.items():
            if size is not None and size != teacher.vocab_size:
                raise ValueError(
                    f"{what} has {label}={size}, but the target {teacher.name!r} has vocab_size={teacher.vocab_size}; "
                    f"a draft model must share the target's tokenizer — pick one from the target's model family"
                )
        mine, theirs = self.tokenizer, getattr(teacher, "tokenizer", None)
        if mine is not None and theirs is not None and mine.get_vocab() != theirs.get_vocab():
            raise ValueError(
                f"{what}'s tokenizer ({len(mine.get_vocab())} tokens) differs from the target {teacher.name!r}'s "
                f"({len(theirs.get_vocab())} tokens); a draft model must share the target's tokenizer"
            )

    # --- training ------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput) -> DraftOutput:
        valid_BT = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        logits_BTV = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        # Position t predicts token t + 1: it is trained where that token is a real, loss-bearing one.
        mask_BT = valid_BT[:, 1:]
        student_NV = logits_BTV[:, :-1][mask_BT]
        teacher_NV = teacher_out.logits_BTV[:, :-1][mask_BT]
        return DraftOutput(terms=[DraftTerm(student_NV, teacher_NV)], num_valid=mask_BT.sum())

    # --- decoding ------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self, seed: int = 0) -> None:
        self._seed = seed  # the draft sampler's, per sequence (see Drafter.reset)
        self._cache: DynamicCache | None = None
        self._cached_ids: Tensor | None = None  # [m]: the ids whose keys/values the cache holds, in order
        self._floor = 0  # cache length before the last proposal's first forward (see _sync_cache)
        self._generator: torch.Generator | None = None

    @torch.no_grad()
    def propose(self, tokens: Tensor, max_depth: int, sampling: SamplingConfig = GREEDY) -> DraftTree:
        if max_depth < 1:
            return DraftTree.empty(tokens.device)
        seq = tokens[0].to(self.device)
        self._check_positions(seq.shape[0], max_depth)
        logits_V = self._sync_cache(seq)
        drafts, rows = [], []
        for k in range(max_depth):
            if k:  # the previous draft goes in; the last draft never does
                logits_V = self._step(drafts[-1].view(1, 1))
            if sampling.greedy:
                drafts.append(logits_V.argmax(-1))
            else:
                probs_1V = warp(logits_V[None], sampling)
                drafts.append(sample(probs_1V, self._sampler())[0])
                rows.append(probs_1V[0])
        draft_ids = torch.stack(drafts)
        self._cached_ids = torch.cat([seq, draft_ids[:-1]])
        probs_NV = torch.stack(rows).to(tokens.device) if rows else None
        return DraftTree.chain(draft_ids.to(tokens.device), probs_NV)

    def _sync_cache(self, seq: Tensor) -> Tensor:
        """Make the cache hold exactly ``seq`` and return the logits after its last token ([V])."""
        keep = 0
        if self._cache is not None:
            cached = self._cached_ids
            n = min(cached.shape[0], seq.shape[0] - 1)  # the last token is always re-fed: we need its logits
            differs = (cached[:n] != seq[:n]).nonzero()
            keep = int(differs[0]) if differs.numel() else n
            # Sliding-window layers keep only what was fed since the previous crop (activate_past_recording), so
            # they can roll back no further than the previous proposal's start; further back, start over.
            sliding = any(getattr(layer, "is_sliding", False) for layer in self._cache.layers)
            if sliding and keep < self._floor:
                self._cache, keep = None, 0
            else:
                self._cache.crop(-(cached.shape[0] - keep))  # v5: a negative count of tokens to remove
        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
            self._cache.activate_past_recording()  # let sliding-window layers roll back rejected drafts
        self._floor = keep
        return self._step(seq[keep:].view(1, -1))

    def _step(self, ids_1m: Tensor) -> Tensor:
        kw = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(input_ids=ids_1m, past_key_values=self._cache, use_cache=True, **kw)
        return out.logits[0, -1]

    def _sampler(self) -> torch.Generator:
        if self._generator is None or self._generator.device != self.device:
            self._generator = torch.Generator(device=self.device).manual_seed(self._seed)
        return self._generator

    def _check_positions(self, num_tokens: int, max_depth: int) -> None:
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        needed = num_tokens + max_depth - 1  # context + every draft but the last goes through the draft model
        if limit and needed > limit:
            raise ValueError(
                f"draft model {self.model_name or type(self.model).__name__!r} has max_position_embeddings={limit}, but "
                f"drafting {max_depth} tokens after {num_tokens} needs {needed} positions; shorten the prompt "
                f"(eval.prompt_tokens), lower eval.max_new_tokens or eval.num_draft, or use a draft model with a longer context"
            )


# What fixes the toy BPE tokenizer: a toy draft model must share these with the toy target.
TOY_TOKENIZER_KEYS = ("vocab_size", "max_seq_len", "corpus_max_bytes", "seed")


def toy_draft_node(draft_node: Mapping[str, Any], target_toy: Mapping[str, Any], **sizes) -> dict:
    """A ``drafter=draft_model`` node for a toy target: its ``toy`` build takes ``sizes`` (hidden_size, steps, ...)
    and the target's tokenizer-defining keys, so the two tokenizers are identical (``bind_target`` checks it)."""
    node = dict(draft_node)
    node["toy"] = {**dict(node.get("toy") or {}), **sizes, **{k: target_toy[k] for k in TOY_TOKENIZER_KEYS}}
    return node


def _from_config(model_config: Mapping[str, Any]) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if "model_type" not in model_config:
        raise ValueError("drafter.model_config has no model_type; it must be a saved `model.config.to_dict()`")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**model_config)).eval()


def _tied_aliases(module: nn.Module) -> dict[str, str]:
    """Parameter name -> the first name of the same tensor, for every later name of a shared (tied) parameter."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _drop_tied_aliases(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for alias in _tied_aliases(module):
        state_dict.pop(prefix + alias, None)


def _restore_tied_aliases(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    for alias, source in _tied_aliases(module).items():
        if prefix + source in state_dict and prefix + alias not in state_dict:
            state_dict[prefix + alias] = state_dict[prefix + source]
