"""The distributed engine, owned by this one module so the training loop never branches on it.

An engine knows the process's rank and device, wraps the drafter for its kind of data parallelism, runs backward,
the clip + optimizer step and the cross-rank sums, and reads / writes the state a checkpoint holds. Engines:

- ``single``: one process, one device.
- ``ddp``: DistributedDataParallel; every rank holds the drafter and the optimizer state.
- ``fsdp``: FSDP2 ``fully_shard``; parameters, gradients and optimizer state sharded over the ranks.
- ``deepspeed``: ZeRO stage 1, 2 or 3 (``trainer.zero_stage``); the DeepSpeed JSON is generated from the trainer
  config (``deepspeed_config``) and ``trainer.deepspeed`` overrides any of it.

Loss scaling contract: the loop hands ``backward`` a loss already divided by the step's all-ranks count of valid
tokens. Every data-parallel engine averages gradients over ranks, so ``backward`` multiplies by the world size:
the reduced gradient is then the per-token mean over the whole global batch, however unevenly tokens fall.

The frozen target is never wrapped: it is replicated on every rank, or its decoder layers are sharded for
inference (``shard_target``, ``target.shard``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from distill.precision import native_bf16

log = logging.getLogger(__name__)


@dataclass
class TrainerConfig:
    """``trainer``: the presets in conf/trainer/ (single, ddp, fsdp, zero1, zero2, zero3) set ``engine``
    (``train.engine``) and its options; everything else is shared."""

    engine: str = "single"  # single | ddp | fsdp | deepspeed
    device: str = "auto"  # auto (cuda:LOCAL_RANK if there is a GPU) | cpu | cuda
    steps: int = 600
    micro_batch_size: int = 8  # rows per forward on each rank
    grad_accum: int = 1
    # Rows per optimizer step over all ranks; when set, grad_accum = global_batch_size / (micro_batch_size x ranks),
    # so one config trains on the same batches on any number of ranks.
    global_batch_size: Optional[int] = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bf16: bool = True  # autocast where the device computes bf16 natively (elsewhere: float32, with a warning)
    fp16: bool = False  # fp16 autocast with dynamic loss scaling (GPUs without bf16); excludes bf16
    zero_stage: int = 2  # engine=deepspeed: ZeRO stage 1, 2 or 3
    deepspeed: Dict[str, Any] = field(default_factory=dict)  # merged over the generated DeepSpeed JSON
    log_every: int = 20
    ckpt_every: int = 200
    keep_last: int = 2
    resume: str = "auto"  # auto: continue from <run dir>/checkpoints/latest if present | never
    # What <run dir>/drafter/ is written from (train.selection): best_tau = the evaluated weights with the best
    # held-out simulated τ | last = the last step's. The held-out evaluation runs every eval_every steps and at the
    # last step, on eval_rows rows of data.max_length tokens, under either choice (eval_every=0: never; select must
    # then be last).
    select: str = "best_tau"
    eval_every: int = 200
    eval_rows: int = 16
    num_threads: Optional[int] = None
    # Rows x vocabulary per chunk of the chunked loss (distill.chunked). null: per device (distill.chunked.
    # default_chunk_elements): on a CPU 2^25 = 261 rows at V 128k, 128 MB per float32 [rows, V] buffer (~3 per
    # chunk); on a GPU 2^28 (2,092 rows, 1 GB buffers). Larger: fewer passes over the vocabulary head's weight
    # (faster: on a CPU 2^27 trains EAGLE-1 at V 128k ~10% faster), more memory. Same loss and gradients up to
    # summation order.
    loss_chunk_elements: Optional[int] = None
    # liger-kernel's fused linear JSD (Triton) for the loss terms it computes exactly (distill.fused_kernels):
    # none = always the chunked PyTorch path | auto = liger where it applies (CUDA, liger installed, forward/reverse
    # KL or JSD, a projected teacher over the student's vocabulary, heads without bias or soft-capping), else the
    # chunked path | liger = require it (a clear error where it cannot apply). Verified only under the Triton
    # interpreter on CPU so far; install with pip install -e '.[gpu]'.
    fused_kernel: str = "none"
    # torch.compile for the training step (train.compile): auto = on for CUDA | on | off. Regional: each drafter
    # layer (EAGLE's TTT step, DFlash's layers, ...) and each loss chunk's divergence arithmetic, the rest eager.
    # Refused under DeepSpeed ZeRO-3 (trainer=zero3), whose partitioned parameters a compiled region cannot gather.
    compile: str = "auto"
    compile_backend: Optional[str] = None  # torch.compile backend; null = inductor (aot_eager: tracing only, checks)
    # Dense bf16 TFLOP/s of one device, for perf/mfu (train.flops); null: looked up from the GPU's name (a table of
    # common GPUs), none on a CPU. Set it for an unlisted accelerator or another precision's peak.
    peak_tflops: Optional[float] = None
    # The drafters' structured training attention (heads.train_attention): auto = flex attention on CUDA, the tiled
    # SDPA kernel elsewhere | flex (CUDA only to train) | tiled | dense = one SDPA call under the whole [Q, KV] mask
    # (the reference; memory grows with the square of the sequence).
    attention: str = "auto"


MakeOptimizer = Callable[[list[dict]], torch.optim.Optimizer]
# DeepSpeed keys the trainer config owns: overriding them would desynchronise the loop's accumulation from DeepSpeed's.
DEEPSPEED_OWNED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
TARGET_SHARDING = ("replicate", "fsdp", "zero3")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name!r} but CUDA is not available here; use trainer.device=cpu or auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"trainer.device={name!r}; valid: auto, cpu, cuda, cuda:N")
    if name == "cuda":  # one GPU per rank: torchrun's LOCAL_RANK picks it
        return torch.device(f"cuda:{local_rank}")
    return torch.device(name)


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun / the deepspeed launcher / Slurm scripts export them."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def init_process_group(device: torch.device) -> None:
    """Join the job's process group once (NCCL on GPUs, gloo on CPU); a no-op for one process."""
    if dist.is_initialized() or world_from_env()[1] == 1:
        return
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set; launch with torchrun, the deepspeed launcher "
                           "or scripts/train.sh, which set the rendezvous")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))


class SingleEngine:
    """One process, one device: the reference the data-parallel engines must reproduce."""

    name = "single"

    def __init__(self, trainer_cfg: TrainerConfig):
        self.rank, self.world_size, self.local_rank = world_from_env()
        if self.name == "single" and self.world_size > 1:
            raise ValueError(f"trainer=single but the launcher started WORLD_SIZE={self.world_size} processes, which "
                             f"would each train and write the same run; use trainer=ddp (or fsdp, zero1/2/3)")
        self.is_main = self.rank == 0
        self.device = resolve_device(trainer_cfg.device, self.local_rank)
        if self.world_size > 1:
            init_process_group(self.device)
        self.amp_dtype = torch.bfloat16 if trainer_cfg.bf16 else torch.float16 if trainer_cfg.fp16 else None
        self.emulated_bf16 = self.amp_dtype is torch.bfloat16 and not native_bf16(self.device)
        if self.emulated_bf16:
            log.warning("trainer.bf16=true, but this %s does not compute bf16 natively (emulated, it is many times "
                        "slower): training in float32; set trainer.bf16=false to say so", self.device.type)
        # fp16 gradients underflow without a loss scale; bf16 keeps fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(self.device.type) if self.amp_dtype is torch.float16 else None
        self.model: nn.Module | None = None
        self.module: nn.Module | None = None  # the unwrapped drafter
        self._sync = True

    # --- set-up ------------------------------------------------------------------------------------------------
    def setup(self, drafter: nn.Module, make_optimizer: MakeOptimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """(the module to call forward on, the optimizer over the drafter's trainable parameters only)."""
        self.module = drafter.to(self.device)
        self.model = self._wrap(self.module)
        return self.model, make_optimizer(_trainable_groups(self.module))

    def _wrap(self, drafter: nn.Module) -> nn.Module:
        return drafter

    # --- one step ----------------------------------------------------------------------------------------------
    def autocast(self):
        """Mixed-precision autocast where the device supports it; a no-op in fp32."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        if self.emulated_bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    @contextlib.contextmanager
    def micro_step(self, sync: bool):
        """Around one micro-batch's forward: autocast, and ``sync=False`` skips the gradient all-reduce of
        micro-batches that only accumulate (the last one of the step reduces the sum)."""
        self._sync = sync
        with self._no_sync(sync), self.autocast():
            yield

    def _no_sync(self, sync: bool):
        return contextlib.nullcontext()

    def backward(self, loss: Tensor) -> None:
        """``loss``: this micro-batch's loss sum divided by the step's all-ranks valid-token count."""
        loss = loss * self.world_size  # undo the ranks' gradient averaging (module docstring)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, grad_clip: float) -> Tensor:
        """Clip and step; returns the pre-clip global gradient norm."""
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP: the norm is already global
            norm = norm.full_tensor()
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm

    # --- collectives -------------------------------------------------------------------------------------------
    def all_reduce_sum(self, value: Tensor) -> Tensor:
        if self.world_size > 1:
            value = value.clone()
            dist.all_reduce(value)
        return value

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # --- checkpoint state ---------------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, Tensor]:
        """The drafter's full state dict on the main rank (collective: every rank must call it)."""
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The optimizer's full state on the main rank (collective); None where each rank saves its own shard."""
        return optimizer.state_dict()

    def load_state(self, optimizer: torch.optim.Optimizer, model_state: Mapping[str, Tensor],
                   optimizer_state: Mapping | None, path) -> None:
        self.module.load_state_dict(model_state, strict=True)
        optimizer.load_state_dict(optimizer_state)

    def save_shards(self, path) -> None:
        """Per-rank state written into the checkpoint directory ``path`` by every rank (DeepSpeed's partitions)."""

    def extra_state(self) -> dict:
        return {"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_extra_state(self, state: Mapping) -> None:
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])

    def close(self) -> None:
        """Leave the process group, once every rank is done with it. The wrapper goes first: a DDP reducer freed
        after the group is destroyed joins gloo threads whose peers are gone, and hangs."""
        self.model = None
        gc.collect()
        if dist.is_initialized() and (self.world_size > 1 or self.name == "fsdp"):
            dist.barrier()
            dist.destroy_process_group()


class DDPEngine(SingleEngine):
    name = "ddp"

    def _wrap(self, drafter: nn.Module) -> nn.Module:
        if self.world_size == 1:
            return drafter
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            drafter, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            # Medusa-2's LoRA gets no gradient in its heads-only stage.
            find_unused_parameters=getattr(drafter, "may_skip_parameters", False),
        )

    def _no_sync(self, sync: bool):
        return contextlib.nullcontext() if sync or self.world_size == 1 else self.model.no_sync()


class FSDPEngine(SingleEngine):
    """FSDP2: every ``nn.ModuleList`` element of the drafter (its blocks) is its own shard group, the rest one root
    group; parameters become DTensors sharded over the ranks, so the optimizer state is sharded too."""

    name = "fsdp"

    def __init__(self, trainer_cfg: TrainerConfig):
        super().__init__(trainer_cfg)
        # One rank under torchrun (the launcher set a rendezvous): FSDP2 still needs its process group and mesh.
        if self.world_size == 1 and "MASTER_ADDR" in os.environ and not dist.is_initialized():
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")

    def _wrap(self, drafter: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        _refuse_target_sharing(drafter, "trainer=fsdp")
        mesh = _mesh(self.device, self.world_size)
        for module in list(drafter.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    if any(p.requires_grad for p in block.parameters()):
                        fully_shard(block, mesh=mesh)
        fully_shard(drafter, mesh=mesh)
        return drafter

    def _no_sync(self, sync: bool):
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def model_state_dict(self) -> dict[str, Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state(self, optimizer, model_state, optimizer_state, path) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        # Every rank read the same full files; each keeps its own shard of them.
        options = StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(self.module, dict(model_state), options=options)
        set_optimizer_state_dict(self.module, optimizer, dict(optimizer_state), options=options)


class DeepSpeedEngine(SingleEngine):
    """DeepSpeed ZeRO 1/2/3. DeepSpeed owns mixed precision (its bf16 / fp16 sections, fp16 with dynamic loss
    scaling), clipping (``gradient_clipping``) and the partitioned optimizer; the loop drives it with the same
    calls as every other engine."""

    name = "deepspeed"

    def __init__(self, trainer_cfg: TrainerConfig):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DeepSpeed wants a process group even for one process
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        for key, value in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK"), ("0", "1", "0")):
            os.environ.setdefault(key, value)
        super().__init__(trainer_cfg)
        import deepspeed

        from train.extensions import check_build_locks, deepspeed_jit_ops

        check_build_locks(deepspeed_jit_ops())  # a killed build's lock makes init_distributed wait forever
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.scaler = None  # DeepSpeed scales fp16 losses itself
        self.config = deepspeed_config(trainer_cfg, self.world_size)

    def setup(self, drafter, make_optimizer):
        import deepspeed

        _refuse_target_sharing(drafter, f"trainer=zero{self.config['zero_optimization']['stage']}")
        self.module = drafter.to(self.device)
        optimizer = make_optimizer(_trainable_groups(drafter))
        self.model, optimizer, _, _ = deepspeed.initialize(model=drafter, optimizer=optimizer, config=self.config)
        self.module = self.model.module
        return self.model, optimizer

    def _no_sync(self, sync: bool):
        self.model.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss: Tensor) -> None:
        # The loss is already a per-token mean over the step: DeepSpeed must not divide it by the accumulation count.
        self.model.backward(loss * self.world_size, scale_wrt_gas=False)
        if not self._sync:
            self.model.step()  # only advances DeepSpeed's micro-step counter off the accumulation boundary

    def step(self, optimizer, grad_clip: float) -> Tensor:
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return torch.as_tensor(norm if norm is not None else float("nan"), dtype=torch.float32)

    def model_state_dict(self) -> dict[str, Tensor]:
        if self.config["zero_optimization"]["stage"] == 3:
            state = self.model._zero3_consolidated_16bit_state_dict()  # gathers on rank 0 (collective)
            if self.is_main and not state:
                raise RuntimeError("DeepSpeed ZeRO-3 returned no consolidated weights for the drafter; set "
                                   "+trainer.deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save=true")
            return {k: v.detach().cpu() for k, v in (state or {}).items()}
        return super().model_state_dict()

    def optimizer_state_dict(self, optimizer):
        return None  # partitioned: every rank writes its own (save_shards)

    def save_shards(self, path) -> None:
        self.model.save_checkpoint(str(path), tag="deepspeed", save_latest=False)

    def load_state(self, optimizer, model_state, optimizer_state, path) -> None:
        # DeepSpeed's own files restore the partitioned fp32 master weights, optimizer state and loss scaler.
        loaded, _ = self.model.load_checkpoint(str(path), tag="deepspeed", load_module_strict=True,
                                               load_optimizer_states=True, load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"checkpoint {path} has no DeepSpeed state (deepspeed/); it was not written by a "
                               f"trainer=zero* run; resume it with the engine that wrote it, or trainer.resume=never")


def deepspeed_config(trainer_cfg: TrainerConfig, world_size: int) -> dict:
    """The DeepSpeed JSON for this run: batch sizes, precision and clipping from ``trainer``, then
    ``trainer.deepspeed`` merged over it (any DeepSpeed key, e.g. ``zero_optimization.offload_optimizer``)."""
    t = trainer_cfg
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": {"stage": int(t.zero_stage), "contiguous_gradients": True, "overlap_comm": False},
        "bf16": {"enabled": bool(t.bf16)},
        "fp16": {"enabled": bool(t.fp16), "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,  # the loop's AdamW with its lr_scale groups
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    overrides = dict(t.deepspeed or {})
    for key in DEEPSPEED_OWNED:
        if key in overrides:
            raise ValueError(f"trainer.deepspeed.{key} is set from trainer.micro_batch_size / grad_accum / "
                             f"global_batch_size; set those instead")
    return _merge(config, overrides)


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


def _trainable_groups(drafter: nn.Module) -> list[dict]:
    """The drafter's own parameter groups (``Drafter.param_groups``: its trainable parameters only, so the frozen
    target never reaches an optimizer), empty groups dropped."""
    return [g for g in drafter.param_groups() if g["params"]]


def _refuse_target_sharing(drafter: nn.Module, what: str) -> None:
    if getattr(drafter, "shares_target_modules", False):
        raise ValueError(f"{what} shards the drafter's parameters, but drafter {drafter.name!r} trains modules that "
                         f"live inside the target (its LoRA); use trainer=ddp or trainer=zero1/zero2")


def _mesh(device: torch.device, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    if world_size == 1 and not dist.is_initialized():
        raise ValueError("trainer=fsdp needs a process group; launch with torchrun (one process works: "
                         "torchrun --nproc_per_node 1 -m train trainer=fsdp), or use trainer=single")
    return init_device_mesh(device.type, (world_size,))


def shard_target(teacher, mode: str, engine) -> None:
    """Place the frozen target: ``replicate`` (a full copy per rank), or shard its decoder layers over the ranks for
    targets too big for one device, ``fsdp`` (FSDP2, gathered layer by layer in each forward) or ``zero3``
    (DeepSpeed ZeRO-3 partitioning). Embeddings, final norm and lm_head stay whole on every rank: drafters read
    them directly (EAGLE's frozen lm_head), and they are a small part of a large model. Every rank must run the
    same teacher forwards (the loop does; evaluation after a sharded run is left to ``python -m eval``)."""
    if mode not in TARGET_SHARDING:
        raise ValueError(f"target.shard={mode!r}; valid: {list(TARGET_SHARDING)}")
    if mode == "replicate":
        return
    layers = getattr(teacher.model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"target.shard={mode} needs a decoder with a `layers` ModuleList; {type(teacher.model).__name__} "
                         f"has none; use target.shard=replicate")
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh(engine.device, engine.world_size)
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    else:
        import deepspeed

        # ZeRO-3 hooks every submodule of what it wraps, so the decoder calling layers[i] gathers layer i's weights.
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "bf16": {"enabled": next(teacher.model.parameters()).dtype == torch.bfloat16}}
        teacher.zero3_engine = deepspeed.initialize(model=layers, config=config)[0]  # held: its hooks live with it
    log.info("target decoder layers sharded over %d ranks (%s)", engine.world_size, mode)


def resolve_batch(trainer_cfg: TrainerConfig, world_size: int) -> TrainerConfig:
    """The trainer config with ``grad_accum`` derived from ``global_batch_size`` (rows per optimizer step over all
    ranks) when that is set, so one config trains on the same global batch on any number of ranks."""
    t = trainer_cfg
    total = t.global_batch_size
    if total is None:
        return t
    per_pass = t.micro_batch_size * world_size
    if total % per_pass:
        raise ValueError(
            f"trainer.global_batch_size={total} is not a multiple of trainer.micro_batch_size={t.micro_batch_size} "
            f"x world size {world_size} = {per_pass}; pick a global batch divisible by {per_pass}, or a micro-batch "
            f"size / number of ranks that divides {total}")
    return dataclasses.replace(t, grad_accum=total // per_pass)


ENGINES = {"single": SingleEngine, "ddp": DDPEngine, "fsdp": FSDPEngine, "deepspeed": DeepSpeedEngine}


def build_engine(trainer_cfg: TrainerConfig):
    name = trainer_cfg.engine
    if name not in ENGINES:
        raise ValueError(f"trainer.engine={name!r} is not available; valid: {sorted(ENGINES)}")
    return ENGINES[name](trainer_cfg)
