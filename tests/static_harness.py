"""A stand-in for the decoder in static-draft tests: it plays a greedy continuation of a tiny target back into
``inference.static_draft.CommittedBuffers`` step by step, a varying number of tokens accepted each time, and runs the
eager ``propose`` on the same context for comparison; plus recorders for what a compiled step must keep fixed."""

from __future__ import annotations

import collections

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from inference.decoder import Decoder
from inference.static_draft import CommittedBuffers, new_committed


class Replay:
    """One greedy continuation of ``teacher`` from a random prompt of ``prompt_len`` tokens, with the target's hidden
    states at every position (computed once), fed to a static draft as the decoder would."""

    def __init__(self, teacher, layers: tuple[int, ...], prompt_len: int, new_tokens: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, teacher.vocab_size, (1, prompt_len), generator=gen)
        cont = Decoder(teacher).plain(prompt, new_tokens).new_tokens
        self.seq = torch.cat([prompt[0], torch.tensor(cont)])
        out = teacher(self.seq[None], layers=layers)
        self.hidden = {i: h[0] for i, h in out.hidden.items()}
        self.prompt_len, self.gen = prompt_len, gen
        self.position = prompt_len  # the pending token's position

    def hidden_at(self, start: int, end: int) -> dict[int, Tensor]:
        return {i: h[start:end] for i, h in self.hidden.items()}

    def prefill(self, static) -> None:
        P = self.prompt_len
        self.position = P
        static.prefill(self.seq[:P], self.hidden_at(0, P), self.seq[P])

    def commit(self, committed: CommittedBuffers, count: int) -> None:
        """What a verification that accepted ``count - 1`` draft tokens writes; padding rows get random values."""
        p, M = self.position, committed.ids_M.shape[0]
        if p + count >= self.seq.shape[0]:
            raise ValueError(f"the replayed continuation ends at {self.seq.shape[0]} tokens; make it longer")
        committed.ids_M.copy_(torch.randint(0, 100, (M,), generator=self.gen))
        committed.ids_M[:count] = self.seq[p: p + count]
        for i, h in committed.hidden_M.items():
            h.copy_(torch.randn(h.shape, generator=self.gen))
            h[:count] = self.hidden[i][p: p + count]
        committed.count.fill_(count)
        committed.position.fill_(p)
        committed.pending.fill_(int(self.seq[p + count]))
        self.position = p + count

    def context(self) -> Tensor:
        """[1, n]: the committed tokens and the pending one (what the eager ``propose`` continues)."""
        return self.seq[: self.position + 1][None]


def play_steps(teacher, drafter, static, committed, prompt_len: int, steps: int, step_fn, check=None, shape=None):
    """Prefill ``static``, then ``steps`` draft steps after varying accepted lengths, the eager ``drafter`` fed the
    same hidden states: ``shape(step, position)`` on the host before each step (the decoder's ``use_shape``), then
    ``step_fn()``, then ``check(step, context)``."""
    M = committed.ids_M.shape[0]
    replay = Replay(teacher, tuple(drafter.teacher_layers), prompt_len, new_tokens=M * steps + 2, seed=prompt_len)
    replay.prefill(static)
    drafter.reset()
    drafter.observe({i: h[None] for i, h in replay.hidden_at(0, prompt_len).items()})
    for step, count in enumerate(counts(steps, M, seed=prompt_len)):
        if step:
            start = replay.position
            replay.commit(committed, count)
            drafter.observe({i: h[None] for i, h in replay.hidden_at(start, start + count).items()})
        if shape is not None:
            shape(step, replay.position)
        step_fn()
        if check is not None:
            check(step, replay.context())


def one_graph_over_plays(teacher, drafter, static, committed, prompt_lens, steps: int, check) -> None:
    """``static.draft`` compiled (dynamo only, fullgraph) and played over each prompt length (``play_steps``, with
    ``check(step, context)`` after each step), recompiles refused after the first step: one graph, no graph break."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step_fn = torch.compile(static.draft, fullgraph=True, dynamic=False, backend="eager")

    def checked(step, context):
        if step == 1:
            torch.compiler.set_stance("fail_on_recompile")
        check(step, context)

    try:
        for prompt_len in prompt_lens:
            play_steps(teacher, drafter, static, committed, prompt_len, steps, step_fn, checked)
    finally:
        torch.compiler.set_stance("default")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])


def committed_for(drafter, rows: int, dtype=torch.float32) -> CommittedBuffers:
    return new_committed(rows, tuple(drafter.teacher_layers), drafter.dims.hidden_size, "cpu", dtype)


def counts(steps: int, rows: int, seed: int = 0) -> list[int]:
    """A varying accepted length per step (1 .. rows committed rows), every value used."""
    gen = torch.Generator().manual_seed(seed)
    out = [1 + i % rows for i in range(rows)] + torch.randint(1, rows + 1, (steps,), generator=gen).tolist()
    return out[:steps]


class Recorder(TorchDispatchMode):
    """Every aten op a step runs: the op count, the storages it reads or writes that it did not create (the state a
    CUDA graph records by address), with their shape and stride, and each attention call's (query, key) shapes."""

    IGNORED = ("detach", "lift_fresh", "_local_scalar_dense", "_unsafe_view")  # as opcount scripts count

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.by_op: collections.Counter = collections.Counter()
        self.made: set[int] = set()
        self.external: dict[int, tuple] = {}
        self.attention: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
        for t in flat:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.made and t.untyped_storage().nbytes():
                self.external.setdefault(ptr, (t.untyped_storage().nbytes(), t.dtype))
        if "scaled_dot_product" in name:
            self.attention.add((tuple(args[0].shape), tuple(args[1].shape)))
        if not (func.is_view or name in self.IGNORED):
            self.ops += 1
            self.by_op[name] += 1
        out = func(*args, **kwargs)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.external:
                    self.made.add(ptr)
        return out


def tensors_of(obj, prefix: str = "state", depth: int = 5) -> dict[str, Tensor]:
    """Every tensor a static draft holds in its attributes (and in their attributes, lists and dicts: a cache's
    layers), by name; modules (the weights) are not walked."""
    if isinstance(obj, Tensor):
        return {prefix: obj}
    if depth == 0 or isinstance(obj, torch.nn.Module):
        return {}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        return {}
    out = {}
    for key, value in items:
        if key in ("drafter", "owner", "_owner", "model"):
            continue
        out |= tensors_of(value, f"{prefix}.{key}", depth - 1)
    return out


def layout(tensors: dict[str, Tensor]) -> dict[str, tuple]:
    """Address, shape and stride of each tensor: what must not change across a decode."""
    return {k: (t.data_ptr(), tuple(t.shape), t.stride()) for k, t in tensors.items()}
