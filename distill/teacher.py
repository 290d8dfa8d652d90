"""The frozen target model, seen as a teacher: logits plus the hidden states a drafter asks for.

Hidden-state index convention (the one every drafter config uses; engines differ by one here, so it is stated
once): index ``i`` is Hugging Face's ``output_hidden_states[i]`` — 0 is the embedding output, ``i`` in 1..L is the
output of decoder layer ``i`` (1-based), and ``L`` (= ``num_layers``) is the last layer's output *after* the final
norm, i.e. exactly what the lm_head reads. ``-1`` is accepted as an alias for ``L``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional, Sequence

import torch
from omegaconf import OmegaConf
from torch import Tensor, nn

from distill.causal import causal_attention
from distill.teacher_output import TeacherOutput
from distill.toy import ToyTargetConfig, load_or_build_toy_target, toy_cache_path
from inference.masks import AttentionLayout

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TargetConfig:
    """``target``: which frozen model to distill from."""

    source: str = "toy"  # toy (built here from the stdlib) | hf (hub name or local path)
    name: str = "specdraft/toy-stdlib"
    revision: Optional[str] = None
    dtype: str = "float32"
    trust_remote_code: bool = False
    cache_dir: Optional[str] = None  # toy targets: default $SPECDRAFT_CACHE or ~/.cache/specdraft
    # Multi-rank training: replicate (a full copy per rank) | fsdp | zero3 (decoder layers sharded over the ranks,
    # for targets that do not fit one device; train.engine.shard_target)
    shard: str = "replicate"
    # source=hf: a model_type outside TESTED_FAMILIES is refused at start-up unless this is true (then it runs on
    # trust: the decoder's checks still refuse what it cannot verify exactly)
    allow_untested_family: bool = False
    toy: ToyTargetConfig = field(default_factory=ToyTargetConfig)


# The model families (transformers ``model_type``) whose tiny random-weight targets CI trains every drafter kind on
# and decodes losslessly, at batch 1 and batched, chain and tree (tests/test_families.py; docs/families.md).
TESTED_FAMILIES = ("gemma2", "gemma3_text", "gpt_neox", "llama", "mistral", "mixtral", "olmo2", "phi3", "qwen2",
                   "qwen3", "qwen3_moe")


def check_family(config, allow_untested: bool = False) -> None:
    """Refuse, before any weight is loaded, a target whose family CI does not cover, or whose attention layers the
    verification masks cannot express (``inference.masks``)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in TESTED_FAMILIES and not allow_untested:
        hint = " (Gemma-3 4B+ checkpoints are multimodal: their text model is gemma3_text)" if model_type == "gemma3" else ""
        raise ValueError(
            f"target model_type={model_type!r} is not among the families tested in CI: {list(TESTED_FAMILIES)}{hint}; "
            f"set target.allow_untested_family=true to try it anyway")
    AttentionLayout.of(config)


class TargetEmbedding(nn.Module):
    """What the target's first decoder layer sees for token ids (hidden-state index 0): its input-embedding module's
    output times the factor its forward applies after it, if any (``scale``, measured by ``Teacher.readout``; 1 in
    transformers 5, whose Gemma embedding modules apply their own sqrt(D)). Frozen, never owned by a drafter."""

    def __init__(self, embed_tokens: nn.Module, scale: float):
        super().__init__()
        self.embed_tokens, self.scale = embed_tokens, scale

    @property
    def weight(self) -> Tensor:
        return self.embed_tokens.weight

    def forward(self, ids: Tensor) -> Tensor:
        out = self.embed_tokens(ids)
        return out if self.scale == 1.0 else out * self.scale


class TargetLogits(nn.Module):
    """The logits the target outputs for a final (normed) hidden state: its lm_head, then what its forward does
    after it: final logit soft-capping ``cap * tanh(x / cap)`` (Gemma-2), from the config field the forward reads,
    checked against the forward itself by ``Teacher.readout``. ``finish`` applies the second part alone, to a
    drafter's own vocabulary projection. Frozen, never owned by a drafter."""

    def __init__(self, lm_head: nn.Module, softcap: float | None):
        super().__init__()
        self.lm_head, self.softcap = lm_head, softcap

    @property
    def weight(self) -> Tensor:
        return self.lm_head.weight

    def finish(self, raw: Tensor) -> Tensor:
        return raw if self.softcap is None else torch.tanh(raw / self.softcap) * self.softcap

    def forward(self, hidden: Tensor) -> Tensor:
        return self.finish(self.lm_head(hidden))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as it was before any peft adapter was injected into it (Medusa-2 trains a LoRA inside the
    target, yet the teacher must keep answering as the original). Free when peft was never imported or the model has
    no active adapter. peft's toggle also flips the adapters' ``requires_grad``: those flags are put back as found."""
    if "peft" not in sys.modules:  # no adapter can exist
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    active = [m for m in model.modules() if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    flags = [(p, p.requires_grad) for m in active for name in m.adapter_layer_names
             for p in getattr(m, name).parameters()]
    for m in active:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in active:
            m.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


class Teacher:
    """Wraps a causal LM: eval mode, no grad, parameters frozen, never handed to an optimizer. Its answers are the
    original target's even while LoRA adapters sit in ``model`` (see ``adapters_disabled``); once a drafter has merged
    an adapter into the weights (Medusa-2 decoding), ``merged_adapter`` says which and the teacher *is* the merged
    target from then on."""

    def __init__(self, model: nn.Module, tokenizer, name: str = "", revision: str | None = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.revision = revision
        config = model.config
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.num_layers: int = config.num_hidden_layers
        self.max_positions: int = getattr(config, "max_position_embeddings", 0) or 0
        self.merged_adapter: str | None = None  # set by a drafter that merged its LoRA into ``model``'s weights
        self._projection_ok: bool | None = None  # projected signals: see ``_readout_matches``

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def input_embedding(self) -> TargetEmbedding:
        """Token ids -> hidden-state index 0, as the target's own forward computes it (see ``readout``)."""
        return self.readout[0]

    @property
    def output_logits(self) -> TargetLogits:
        """Final hidden state (index -1) -> the target's logits, as its own forward computes them (see ``readout``)."""
        return self.readout[1]

    @functools.cached_property
    def readout(self) -> tuple[TargetEmbedding, TargetLogits]:
        """The target's embedding and logit read-outs, checked against one forward of the target itself.

        Drafters feed embeddings to their own layers (EAGLE) and turn features into logits through the target's
        lm_head (EAGLE-1), so they must see what the target's forward does around those modules: an embedding scale
        (Gemma: sqrt(D)), final logit soft-capping (Gemma-2). The forward is run once with a pre-hook that hands the
        lm_head a large probe state (random weights give logits too small for a cap to show) and with
        ``output_hidden_states``; a target whose forward does something else (learned absolute positions added to
        the embeddings, a logit scale) is refused here, naming what differs, rather than trained wrongly."""
        embed, head = self.embed_tokens, self.lm_head
        ids = torch.arange(min(8, self.vocab_size), device=self.device)[None]
        probe: dict[str, Tensor] = {}

        def swap(module, args):
            h = args[0]
            unit = torch.randn(h.shape, generator=torch.Generator().manual_seed(0)).to(h)
            raw = torch.nn.functional.linear(unit.float(), module.weight.float())
            probe["h"] = unit * (100.0 / raw.abs().max().clamp_min(1e-6)).to(h.dtype)  # logits up to +-100
            return (probe["h"],)

        handle = head.register_forward_pre_hook(swap)
        try:
            with torch.no_grad(), adapters_disabled(self.model):
                out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
                e0, h0 = embed(ids).float(), out.hidden_states[0].float()
        finally:
            handle.remove()
        scale = float((h0 * e0).sum() / (e0 * e0).sum().clamp_min(1e-12))
        if not torch.allclose(e0 * scale, h0, rtol=1e-2, atol=1e-4 * float(h0.abs().max())):
            raise ValueError(
                f"target {self.name!r}: hidden_states[0] is not a scaled output of its input embedding module "
                f"({type(embed).__name__}); its forward adds something (e.g. learned absolute positions) that a drafter "
                f"feeding token embeddings (EAGLE) cannot reproduce; use drafter=medusa or drafter=draft_model")
        softcap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        logits = TargetLogits(head, softcap)
        with torch.no_grad():
            want, got = out.logits.float(), logits(probe["h"]).float()
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2):
            raise ValueError(
                f"target {self.name!r}: its forward's logits are not lm_head(final hidden state)"
                f"{f' soft-capped at {softcap}' if softcap else ''} (max difference {float((got - want).abs().max()):.3g} "
                f"on a probe state); drafters that read logits through the target's lm_head (eagle1) cannot be trained "
                f"for it; use drafter=medusa or drafter=draft_model")
        return TargetEmbedding(embed, 1.0 if abs(scale - 1.0) < 1e-3 else scale), logits

    @property
    def final_norm(self) -> nn.Module | None:
        """The norm between the last decoder layer and the lm_head (hidden-state index -1 is its output), found by
        the attribute names HF decoders use; None when this architecture names it otherwise."""
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        for name in ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f"):
            module = getattr(decoder, name, None)
            if isinstance(module, nn.Module) and getattr(module, "weight", None) is not None:
                return module
        return None

    @functools.cached_property
    def final_norm_gain(self) -> Tensor | None:
        """The final norm's effective per-channel gain ``g``, read through the module itself: an RMS norm computes
        ``g * x / rms(x)``, with ``g = weight`` in Llama but ``1 + weight`` in Gemma, so copying ``weight`` would start
        a drafter's norm near zero on Gemma. None without a final norm, or when it is not of that form (GPT-NeoX's
        LayerNorm subtracts the mean and adds a bias)."""
        norm = self.final_norm
        if norm is None:
            return None
        weight = norm.weight
        x = 100 * torch.randn(4, self.hidden_size, generator=torch.Generator().manual_seed(0))  # rms >> any eps
        with torch.no_grad():
            out = norm(x.to(weight.device, weight.dtype)).float().cpu()
        x = x.to(weight.dtype).float()
        gains = out / (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)))
        if not torch.allclose(gains, gains[:1].expand_as(gains), rtol=2e-2, atol=1e-3):
            return None
        return gains.mean(0).to(weight.device)

    def resolve_layer(self, index: int) -> int:
        """Map a configured hidden-state index to HF's ``hidden_states`` index (see the module docstring)."""
        resolved = self.num_layers if index == -1 else index
        if not 0 <= resolved <= self.num_layers:
            raise ValueError(
                f"hidden-state index {index} is out of range for a target with {self.num_layers} layers; "
                f"valid: 0..{self.num_layers} (or -1 for the final, normed output)"
            )
        return resolved

    def identity(self) -> dict:
        """What a saved drafter records about the target it was trained for (checked again at load time)."""
        return {
            "name": self.name,
            "revision": self.revision,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
        }

    def signals(self, batch: Mapping[str, Tensor], layers: Sequence[int] = (), dense: bool = True) -> TeacherOutput:
        """What the training loop asks for: the teacher's outputs for a collated batch. Online: one forward here;
        ``distill.cache.OfflineTeacher`` answers the same call from precomputed shards. ``dense=False`` asks for
        the projected form (see ``__call__``). Training rows are right-padded or packed (``distill.data``'s
        ``TokenBlockDataset`` refuses others), so the forward runs causal with no mask (``right_padded``)."""
        return self(batch["input_ids"], batch["attention_mask"], layers, dense=dense, right_padded=True)

    @torch.no_grad()
    def weights_digest(self) -> str:
        """A short hash of a strided sample of the output and input embeddings: tells apart two targets that share a
        name and sizes but not weights (e.g. toy targets built with other settings), without hashing gigabytes."""
        import hashlib

        h = hashlib.sha256()
        for module in (self.lm_head, self.embed_tokens):
            w = module.weight.detach()
            if hasattr(w, "full_tensor"):  # a tensor-parallel DTensor: every rank gathers the same whole weight
                w = w.full_tensor()
            w = w.reshape(-1)
            sample = w[:: max(1, w.numel() // 65_536)].float().cpu().contiguous()
            h.update(sample.numpy().tobytes())
        return h.hexdigest()[:16]

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, layers: Sequence[int] = (),
                 dense: bool = True, right_padded: bool = False) -> TeacherOutput:
        """Under ``torch.inference_mode``: no autograd bookkeeping, and the HF hidden states not asked for are freed
        on return. The logits stay an inference tensor (losses only read them, never differentiate through them);
        the requested hidden states are cloned out of it, since drafters feed them into layers that save their
        inputs for backward. Medusa-2's gradient through the adapted target runs the model itself, not this.

        ``dense=False``: the projected form, where the target's forward can skip its logits (``logits_to_keep``):
        the final hidden state and ``output_logits`` instead of [B, T, V] logits, which the loss then projects a
        chunk of rows at a time (a drafter whose loss reads each teacher row once, or a vocabulary slice of it).

        ``right_padded``: the caller vouches that every row's padding (``attention_mask`` 0) is at its end. The mask
        is then not handed to the model: a real token never sees a later position under causal attention, so every
        real position's outputs are unchanged, while HF builds no [B, 1, T, T] mask and reads no padding flag back to
        the host (its SDPA path checks ``mask.all()`` to skip the mask; without one it reads the position ids back
        to look for packed sequences, which ``distill.causal`` avoids where attention is plainly causal). Padded
        positions then attend to padding as well; nothing reads them. Sliding-window layers still get their window
        mask from the model itself."""
        project = not dense and self._can_project
        attention_mask = None if right_padded else attention_mask
        readout = self.output_logits if project else None  # (its one-off probe forward runs outside inference mode)
        causal = causal_attention(self.model) if right_padded else contextlib.nullcontext()
        with adapters_disabled(self.model), torch.inference_mode(), causal:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                output_hidden_states=bool(layers) or project,
                use_cache=False,
                **({"logits_to_keep": 1} if project else {}),
            )
            picked = {i: out.hidden_states[self.resolve_layer(i)] for i in layers}
            final, logits = (out.hidden_states[self.num_layers] if project else None), out.logits
            del out
            if project and not self._readout_matches(final, logits):
                return self(input_ids, attention_mask, layers, dense=True)  # (mask already dropped if right-padded)
        hidden = {i: h.clone() for i, h in picked.items()}
        if project:
            return TeacherOutput(logits_BTV=None, hidden=hidden, final_BTD=final, readout=readout,
                                 vocab_size=self.vocab_size)
        return TeacherOutput(logits_BTV=logits, hidden=hidden)

    @functools.cached_property
    def _can_project(self) -> bool:
        """Whether the forward can skip its logits and ``readout`` accepts the target (one it refuses still trains
        drafters that need no read-out, e.g. a draft model: with dense logits)."""
        if "logits_to_keep" not in inspect.signature(self.model.forward).parameters:
            return False
        try:
            self.readout
        except ValueError:
            return False
        return True

    def _readout_matches(self, final_BTD: Tensor, logits_B1V: Tensor) -> bool:
        """Whether the forward's last-position logits are ``output_logits`` of hidden-state index -1, checked on the
        first projected batch (the same single row, so equal to rounding); where they are not, the teacher answers
        with dense logits from then on."""
        if self._projection_ok is None:
            want, got = logits_B1V[:, -1].float(), self.output_logits(final_BTD[:, -1]).float()
            self._projection_ok = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()) + 1e-6))
            if not self._projection_ok:
                log.warning("target %r: its logits are not output_logits(hidden_states[-1]) (max difference %.3g); "
                            "the teacher keeps dense [B, T, V] logits", self.name, float((got - want).abs().max()))
        return self._projection_ok


def target_config(node: Mapping) -> TargetConfig:
    """A ``target`` mapping read from a file (a saved drafter's ``target_config``) as the typed ``TargetConfig``:
    missing keys take their defaults, an unknown key is an error naming it."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TargetConfig), dict(node)))


# How one generation job places a target too large for one device (regenerate.shard): none (the whole target on
# this process's device) | tensor (transformers' tensor parallelism over every rank of the launch, tp_plan "auto")
# | device_map (one process, its layers spread over every visible GPU by accelerate's device_map="auto").
PLACEMENTS = ("none", "tensor", "device_map")


def placement_kwargs(placement: str) -> dict:
    """What ``from_pretrained`` receives for ``placement`` (``PLACEMENTS``) besides the name, revision and dtype."""
    if placement not in PLACEMENTS:
        raise ValueError(f"regenerate.shard={placement!r}; valid: {list(PLACEMENTS)}")
    if placement == "tensor":
        from transformers import DistributedConfig

        # The model's own plan (base_model_tp_plan), over WORLD_SIZE ranks of the process group already joined.
        return {"distributed_config": DistributedConfig(tp_plan="auto")}
    if placement == "device_map":
        return {"device_map": "auto"}
    return {}


def load_teacher(target_cfg: TargetConfig, device: str | torch.device = "cpu", placement: str = "none") -> Teacher:
    """Build the frozen target named by ``cfg.target``: the embedded toy model or a hub checkpoint. ``placement``
    (``PLACEMENTS``) other than none loads it split by transformers, which then owns where each weight lives:
    ``device`` is ignored."""
    source = target_cfg.source
    dtype_name = target_cfg.dtype
    if dtype_name not in DTYPES:
        raise ValueError(f"target.dtype={dtype_name!r} is not supported; valid: {sorted(DTYPES)}")
    split = placement_kwargs(placement)
    if source == "toy":
        model, tokenizer = load_or_build_toy_target(asdict(target_cfg.toy), cache_dir=target_cfg.cache_dir)
        if split:  # loaded again from its cache dir, a Hugging Face checkpoint, this time split
            from transformers import AutoModelForCausalLM

            path = toy_cache_path(asdict(target_cfg.toy), target_cfg.cache_dir)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype_name], **split).eval()
    elif source == "hf":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from transformers import AutoConfig

        name, revision = target_cfg.name, target_cfg.revision
        trust = target_cfg.trust_remote_code
        try:
            hub_config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust)
        except OSError as e:  # not on disk and no network (or no such repo): transformers' message names neither key
            raise FileNotFoundError(
                f"target.name={name} (revision {revision}) cannot be loaded: it is neither a local directory nor in "
                f"the Hugging Face cache, and the hub cannot be reached or has no such model ({str(e).splitlines()[0]}). "
                f"Download it where there is network (`huggingface-cli download {name}`) into the HF_HOME this job "
                f"reads, or set target.name to a local directory") from e
        check_family(hub_config, target_cfg.allow_untested_family)
        log.info("loading target %s (revision %s, %s)", name, revision, dtype_name)
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_pretrained(
            name, revision=revision, dtype=DTYPES[dtype_name], trust_remote_code=trust, **split
        )
    else:
        raise ValueError(f"target.source={source!r} is not known; valid: 'toy' (embedded stdlib model) or 'hf' (hub name or local path)")
    if not split:
        model = model.to(device=device, dtype=DTYPES[dtype_name])
    return Teacher(model, tokenizer, name=target_cfg.name, revision=target_cfg.revision)
