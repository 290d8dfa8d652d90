"""A standalone draft LM: a small causal LM that shares the target's tokenizer drafts a chain, one token per forward.

Which token each output predicts: like the target, the draft model's logits at position t predict token t+1.
Drafting feeds its own guesses back in, so draft token k is its guess for the k-th token after the committed ones.

Shape legend:  B batch, T sequence, V vocabulary (the target's), n committed tokens, k = max_depth.
    tokens [1, n] -> draft model (its own KV cache, kept between proposals) -> chain tokens [k], probs_NV [k, V] | None

Decoding (batch 1 and batch B): the decoder drafts through ``static_draft`` (below). ``propose`` drafts one
sequence eagerly: per-row copies (``heads.base.ForkedRows``) use it for sliding-window draft models, whose
``DynamicCache`` rolls windows back, and the static draft is tested against it. Its cache holds the ids of the
previous proposal's context and all its drafts but the last (the last draft is never fed). A new proposal crops the cache back to the longest prefix it shares with
``tokens``, feeds the rest in one forward, then drafts one token per forward: argmax when greedy (probabilities
None), else a draw from the draft logits warped by ``inference.sampling.warp`` exactly as the target's (those rows
are the chain's ``probs_NV``). The step decoder drafts through ``static_draft`` (``heads.draft_model.draft``: the
catch-up and the chain as one capture-safe step over the draft model's own static cache).

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

from distill.causal import causal_attention
from distill.chunked import TeacherRows, slice_positions
from distill.teacher import DTYPES
from distill.teacher_output import TeacherOutput
from distill.toy import ToyTargetConfig, load_or_build_toy_target
from heads import flops
from heads.base import DraftOutput, DraftTerm, Drafter, TargetDims
from heads.draft_model.config import (draft_config, drop_tied_aliases, init_from_target, model_from_config,
                                      restore_tied_aliases)
from heads.draft_model.draft import DraftModelStaticDraft
from heads.lora import check_lora_spec, check_targets_exist, lora_config
from inference.generation import cache_kwarg
from inference.masks import AttentionLayout
from inference.sampling import GREEDY, SamplingConfig, sample, seeded_generator, warp
from inference.tree import DraftTree

SOURCES = ("config", "toy", "hf")
INITS = ("embeddings", "truncated", "none")


class DraftModel(Drafter):
    """A Hugging Face causal LM as the drafter.

    Where the model comes from, first match wins: ``model`` (a ready ``PreTrainedModel``, runtime only, never in
    yaml); ``model_config`` (a saved draft model's HF config: the architecture is rebuilt with fresh weights, which
    ``load_drafter`` then overwrites, so loading never rebuilds the toy or downloads anything); ``source="config"``
    (the target's own config with ``config_overrides`` — by default one layer at the target's hidden size — built
    when the target is bound, its embeddings, final norm and lm_head copied from the target's per ``init``);
    ``source="toy"`` (a small Llama pretrained on the stdlib like the toy target and cached the same way);
    ``source="hf"`` (``name``: a hub id or a local directory).

    ``lora`` (a ``heads.lora`` spec) wraps the model with ``peft`` LoRA adapters: only they train, the base weights
    stay as loaded. Saved drafters keep the adapters; ``bind_target(initialize=False)`` (loading for decoding) merges
    them into the base weights, so proposing costs what the plain model costs.
    """

    name = "draft_model"  # how reports label it; the HF model's name is ``model_name``
    teacher_layers = ()
    can_sample = True
    drafts_autoregressively = True
    dense_teacher_logits = False  # one term: each teacher row is read once

    def __init__(self, dims: TargetDims | Mapping[str, int], source: str = "config", name: str | None = None,
                 revision: str | None = None, toy: dict | None = None, dtype: str = "float32",
                 trust_remote_code: bool = False, config_overrides: dict | None = None, init: str = "embeddings",
                 lora: dict | None = None, model_config: dict | None = None, model=None):
        super().__init__(dims)
        if dtype not in DTYPES:
            raise ValueError(f"drafter.dtype={dtype!r} is not supported; valid: {sorted(DTYPES)}")
        if source not in SOURCES:
            raise ValueError(
                f"drafter.source={source!r} is not known; valid: {list(SOURCES)} ('config': the target's config with "
                f"drafter.config_overrides, initialised from the target; 'toy': a small model built from the stdlib "
                f"like the toy target; 'hf': drafter.name is a hub id or local path)"
            )
        if init not in INITS:
            raise ValueError(f"drafter.init={init!r} is not known; valid: {list(INITS)} (embeddings: copy the "
                             f"target's embeddings, final norm and lm_head; truncated: also its first layers)")
        unknown = sorted(set(toy or {}) - set(asdict(ToyTargetConfig())))
        if unknown:
            raise ValueError(f"drafter.toy has unknown keys {unknown}; valid: {sorted(asdict(ToyTargetConfig()))}")
        self.source, self.model_name, self.revision = source, name, revision
        self.toy, self.dtype_name, self.trust_remote_code = dict(toy or {}), dtype, trust_remote_code
        self.config_overrides = {"num_hidden_layers": 1, **dict(config_overrides or {})}
        self.init = init
        self.lora = None
        if lora is not None:
            self.lora = check_lora_spec(lora, "drafter.lora")
        self.model = None
        self.tokenizer = None
        if model is None and model_config is not None:
            model = model_from_config(model_config).to(DTYPES[dtype])
        elif model is None and source != "config":  # source=config is built from the target in bind_target
            model, self.tokenizer = self._load(source)
        if model is not None:
            self._attach(model)
        # Tied embeddings are one tensor under two names; safetensors refuses to save shared tensors, so the
        # alias is left out of state_dict() and restored from its source on load (as HF's save_pretrained does).
        self.register_state_dict_post_hook(drop_tied_aliases)
        self.register_load_state_dict_pre_hook(restore_tied_aliases)
        self.reset()

    def _attach(self, model: nn.Module) -> None:
        """Make ``model`` the draft LM: record its config, then wrap it with LoRA adapters if asked."""
        # What saved_config() records to rebuild the architecture; in its JSON form (to_dict keeps int keys in
        # id2label), so a saved node compares equal to a fresh one when a training run resumes.
        self.model_config = json.loads(model.config.to_json_string(use_diff=False))
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        if self.lora is not None:
            from peft import get_peft_model

            check_targets_exist(model, self.lora, "drafter.lora")
            model = get_peft_model(model, lora_config(self.lora, "drafter.lora"))
        self.model = model

    @property
    def needs_training(self) -> bool:
        """A pretrained draft LM is useful as it is (distillation only improves it); one built from the target's
        config has fresh layers."""
        return self.source == "config"

    def merge_lora(self) -> None:
        """Fold the LoRA adapters into the base weights (``peft`` merge_and_unload); a no-op without them."""
        if self.lora is not None and self.model is not None:
            self.model = self.model.merge_and_unload()
            self.lora = None

    def save_adapter(self, path) -> None:
        """The LoRA adapters in PEFT's own format (``adapter_config.json`` + weights): ``PeftModel.from_pretrained``
        loads them onto the base draft model."""
        if self.lora is None:
            raise ValueError("drafter.lora is null: this draft model has no LoRA adapters to save")
        self.model.save_pretrained(str(path))

    def _load(self, source: str):
        """(model, tokenizer) from ``source``; the tokenizer is kept so bind_target can compare it with the target's."""
        if source == "toy":
            model, tokenizer = load_or_build_toy_target({**asdict(ToyTargetConfig()), **self.toy}, cache_dir=None)
        else:
            if not self.model_name:
                raise ValueError("drafter.source=hf needs drafter.name: a hub id or a local directory with the draft model")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            kw = {"revision": self.revision, "trust_remote_code": self.trust_remote_code}
            tokenizer = AutoTokenizer.from_pretrained(self.model_name, **kw)
            model = AutoModelForCausalLM.from_pretrained(self.model_name, dtype=DTYPES[self.dtype_name], **kw)
        return model.to(DTYPES[self.dtype_name]).eval(), tokenizer

    def _build_from_target(self, teacher) -> nn.Module:
        """The target's config with ``config_overrides`` (fresh weights; ``init_from_target`` fills some in)."""
        from transformers import AutoModelForCausalLM

        config = draft_config(teacher.model.config, self.config_overrides)
        return AutoModelForCausalLM.from_config(config).to(DTYPES[self.dtype_name]).eval()

    def saved_config(self, drafter_cfg: Mapping[str, Any] | None = None) -> dict:
        """The drafter node to save: ``drafter_cfg`` (or this drafter's own arguments) plus ``model_config``, so that
        ``load_drafter`` rebuilds the architecture without the runtime-only ``model`` or a toy build / download."""
        if self.model is None:
            raise RuntimeError("drafter.source=config builds the draft model from the target: bind_target first")
        node = dict(drafter_cfg) if drafter_cfg is not None else {
            "_target_": f"{type(self).__module__}.{type(self).__qualname__}", "source": self.source,
            "name": self.model_name, "revision": self.revision, "toy": dict(self.toy), "dtype": self.dtype_name,
            "trust_remote_code": self.trust_remote_code, "config_overrides": dict(self.config_overrides),
            "init": self.init, "lora": self.lora,
        }
        node.pop("model", None)
        node["model_config"] = self.model_config
        node["lora"] = self.lora  # None once merged
        return node

    def bind_target(self, teacher, initialize: bool) -> None:
        """Refuse a draft model whose vocabulary or special tokens differ from the target's: its token ids would mean
        other text. ``source=config`` builds the draft here (and, when ``initialize``, copies the target's tensors);
        a pretrained draft brings its own weights. Loading for decoding (``initialize=False``) merges LoRA."""
        if self.model is None:
            model = self._build_from_target(teacher)
            if initialize:
                init_from_target(model, teacher.model, self.init)
            self._attach(model)
        elif not initialize:
            self.merge_lora()
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
        if mine is not None and theirs is not None:
            if mine.get_vocab() != theirs.get_vocab():
                raise ValueError(
                    f"{what}'s tokenizer ({len(mine.get_vocab())} tokens) differs from the target {teacher.name!r}'s "
                    f"({len(theirs.get_vocab())} tokens); a draft model must share the target's tokenizer"
                )
            for special in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
                a, b = getattr(mine, special, None), getattr(theirs, special, None)
                if a != b:
                    raise ValueError(
                        f"{what}'s tokenizer has {special}={a}, the target {teacher.name!r}'s has {b}; a draft model "
                        f"must share the target's special tokens (set the draft tokenizer's {special.removesuffix('_id')} "
                        f"to the target's, or pick a draft model from the target's family)"
                    )

    # --- training ------------------------------------------------------------------------------------------
    def forward(self, batch: Mapping[str, Tensor], teacher_out: TeacherOutput, loss_fn=None) -> DraftOutput:
        # every position t < T - 1 is a row, weighted by whether it is trained: static shapes, no sync
        weight_N = self.train_mask(batch, 0).reshape(-1).float()
        student_BTD, head = self._features_and_head(batch)
        B, n = student_BTD.shape[0], student_BTD.shape[1] - 1
        teacher = TeacherRows(teacher_out, *slice_positions(B, n, 0, student_BTD.device))
        term = DraftTerm(student_BTD[:, :-1].reshape(B * n, -1), head, teacher, weight_N=weight_N)
        return DraftOutput(terms=[term], num_valid=self.count_valid(batch)).evaluate(loss_fn)

    @property
    def projects_in_chunks(self) -> bool:
        """Whether the loss projects the final states itself (``_features_and_head``): the output embedding is a plain
        Linear with nothing after it and the forward can skip its logits."""
        config = self.model.config.get_text_config()
        return bool(self._logits_to_keep and isinstance(self.model.get_output_embeddings(), nn.Linear)
                    and not getattr(config, "final_logit_softcapping", None)
                    and getattr(config, "logit_scale", 1.0) == 1.0)

    def train_flops(self, target, B: int, T: int):
        return flops.draft_model(self, target, B, T)

    def _features_and_head(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, Any]:
        """([B, T, D] the final normed hidden states, the output embedding): the loss projects them in chunks, so
        the model's [B, T, V] logits are never computed (``logits_to_keep=1``: one position's). A model that does
        more to its logits than its output embedding (soft-capping, a logit scale) or cannot skip them is
        projected whole: ([B, T, V] logits, identity)."""
        out_layer = self.model.get_output_embeddings()
        plain = self.projects_in_chunks
        kwargs = {"logits_to_keep": 1, "output_hidden_states": True} if plain else {}
        # Training rows are right-padded or packed (distill.data): causal attention without a mask is exact at every
        # real position, and HF then builds no [B, 1, T, T] mask (distill.teacher.Teacher.__call__'s right_padded).
        with causal_attention(self.model):  # no mask built, no host read-back (distill.causal)
            out = self.model(input_ids=batch["input_ids"], use_cache=False, **kwargs)
        if plain:
            return out.hidden_states[-1], out_layer
        return out.logits, nn.Identity()

    def compile_regions(self) -> list[tuple[object, str]]:
        """Each decoder layer's attention and MLP modules, not the layer itself: transformers captures hidden states
        with forward hooks on the layers and reads its collector from a ``ContextVar`` there, which dynamo cannot
        trace (a graph break per layer); the hooks run around these regions instead."""
        regions = []
        for module in self.model.modules():
            attention = getattr(module, "self_attn", None) or getattr(module, "attention", None)
            mlp = getattr(module, "mlp", None)
            if isinstance(attention, nn.Module) and isinstance(mlp, nn.Module):
                regions += [(attention, "forward"), (mlp, "forward")]
        return regions

    def train_mask(self, batch: Mapping[str, Tensor], k: int) -> Tensor:
        """[B, T - 1]: position t predicts token t + 1 and is trained where that token is real and loss-bearing (one
        term: the draft model drafts deeper by feeding itself)."""
        if k != 0:
            raise ValueError(f"a draft model trains one next-token term; term {k} does not exist")
        return (batch["loss_mask"].bool() & batch["attention_mask"].bool())[:, 1:]

    @torch.no_grad()
    def sample_continuations(self, prompt_ids_BP: Tensor, num_new: int, temperature: float,
                             generator: torch.Generator) -> Tensor:
        """[B, num_new] tokens drawn from the draft's own distribution at ``temperature`` (0: argmax) after each
        prompt row, with a KV cache; in eval mode (no dropout), restoring the training mode after."""
        was_training = self.model.training
        self.model.eval()
        try:
            cache = DynamicCache(config=self.model.config)
            ids, drawn = prompt_ids_BP, []
            cfg = SamplingConfig(temperature=temperature)
            for _ in range(num_new):
                out = self.model(input_ids=ids, use_cache=True, **{cache_kwarg(self.model): cache})
                logits_BV = out.logits[:, -1].float()
                ids = logits_BV.argmax(-1, keepdim=True) if cfg.greedy else sample(warp(logits_BV, cfg), generator)[:, None]
                drawn.append(ids)
        finally:
            self.model.train(was_training)
        return torch.cat(drawn, dim=1)

    # --- decoding ------------------------------------------------------------------------------------------
    @property
    def assistant_model(self) -> nn.Module:
        return self.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def reset(self, seed: int = 0) -> None:
        self._seed = seed  # the draft sampler's, per sequence (see Drafter.reset)
        self._cache: DynamicCache | None = None
        self._cached_ids: Tensor | None = None  # [m]: the ids whose keys/values the cache holds, in order
        self._floor = 0  # cache length before the last proposal's first forward (see _sync_cache)
        self._generator: torch.Generator | None = None
        self._proposed: tuple[int, int] | None = None  # (context length, drafts) of the last proposal
        self._valid: int | None = None  # cached entries still right after ``accepted`` (None: compare ids)

    def _batchable(self) -> bool:
        try:
            return not AttentionLayout.of(self.model).sliding
        except ValueError:  # layer types the masks do not know (linear attention, ...)
            return False

    def accepted(self, path: list[int], committed: list[int] | None = None) -> None:
        # The cache holds the context and every draft but the last; the accepted ones stay valid.
        if self._proposed is not None:
            context, drafts = self._proposed
            self._valid = context + min(len(path), drafts - 1)
            self._proposed = None

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
        self._proposed, self._valid = (seq.shape[0], max_depth), None
        probs_NV = torch.stack(rows).to(tokens.device) if rows else None
        return DraftTree.chain(draft_ids.to(tokens.device), probs_NV)

    def static_draft(self, committed, capacity: int, sampling: SamplingConfig, generator):
        """The catch-up and a chain of (committed rows - 1) tokens, greedy or sampled, as one capture-safe step over
        the draft model's own static cache (``heads.draft_model.draft``); None (the eager path) for draft models
        with sliding-window or other than full-attention layers."""
        if not self._batchable():
            return None
        return self.reuse_static_draft((id(self.model),), committed, capacity, sampling, generator,
                                       lambda: DraftModelStaticDraft(self, committed, capacity, sampling, generator))

    def _sync_cache(self, seq: Tensor) -> Tensor:
        """Make the cache hold exactly ``seq`` and return the logits after its last token ([V])."""
        keep = 0
        if self._cache is not None:
            cached = self._cached_ids
            n = min(cached.shape[0], seq.shape[0] - 1)  # the last token is always re-fed: we need its logits
            if self._valid is not None:  # told by ``accepted``: no comparison read back from the device
                keep = min(self._valid, n)
            else:
                differs = (cached[:n] != seq[:n]).nonzero()
                keep = int(differs[0]) if differs.numel() else n
            self._valid = self._proposed = None
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
        kw[cache_kwarg(self.model)] = self._cache
        out = self.model(input_ids=ids_1m, use_cache=True, **kw)
        return out.logits[0, -1]

    def _sampler(self) -> torch.Generator:
        self._generator = seeded_generator(self._generator, self._seed, self.device)
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
