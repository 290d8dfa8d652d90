"""The decode step's budget of host<->device transfers and syncs: at most ``BUDGET`` per verification
forward, for every drafter kind, chain and tree, greedy and sampled, counted by ``inference.transfers``.

Per step = (count over a long decode - count over a short one) / (steps of the long - steps of the short), on the
same prompt: the prefill and the per-sequence set-up cancel out."""

from dataclasses import asdict

import pytest
import torch

from heads.base import TargetDims, build_drafter
from heads.draft_model.model import DraftModel
from heads.eagle.model import EagleDrafter
from inference.decoder import Decoder, DecoderConfig
from inference.sampling import SamplingConfig
from inference.transfers import TransferCounter
from tests.conftest import make_tiny_llama

BUDGET = 4
DIMS = TargetDims(hidden_size=32, vocab_size=128, num_layers=2)


def test_counter_sees_every_kind_of_transfer():
    x = torch.arange(6)
    with TransferCounter() as c:
        int(x[0]), x.tolist(), torch.tensor([1, 2]), x.nonzero(), bool(x.any()), x.sum() + 1
    assert dict(c.counts) == {"item": 2, "tolist": 1, "from_python": 1, "sync_shape": 1}
    assert torch.Tensor.tolist is not type(c).__dict__.get("tolist")  # restored on exit
    with TransferCounter() as c:
        (x * 2).cumsum(0).topk(2), torch.arange(3), x[torch.tensor(1)] if False else x[1:]
    assert c.total == 0


def test_a_device_tensors_tolist_is_one_read_back():
    # On a GPU, tolist copies the tensor to the host through the dispatcher (aten._to_copy) before reading it: that
    # is the read-back already counted as ``tolist``, not a second transfer. A meta tensor takes the same path (and
    # then fails, having no data), which is how a CPU-only machine sees it.
    x = torch.arange(4, device="meta")
    with TransferCounter() as c:
        with pytest.raises(NotImplementedError):
            x.tolist()
    assert dict(c.counts) == {"tolist": 1}
    with TransferCounter() as c:  # a copy outside tolist still counts
        with pytest.raises(NotImplementedError):
            x.to("cpu")
    assert dict(c.counts) == {"copy": 1}


def make(kind: str, teacher):
    torch.manual_seed(0)
    if kind.startswith("medusa"):
        drafter = build_drafter({"_target_": "heads.medusa.MedusaHeads", "num_heads": 3}, teacher)
        drafter.bind_target(teacher, initialize=True)
        drafter.set_tree("default" if kind == "medusa_tree" else None)
    elif kind.startswith("eagle"):
        variant, tree = kind.split("_")
        kw = {"draft_vocab_size": 96} if variant == "eagle3" else {}
        drafter = EagleDrafter(DIMS, variant=variant, tree=tree, top_k=3, total_tokens=8, **kw)
        drafter.bind_target(teacher, initialize=True)
    elif kind == "draft_model":
        drafter = DraftModel(DIMS, model=make_tiny_llama(seed=1))
        drafter.bind_target(teacher, initialize=False)
    else:
        drafter = build_drafter({"_target_": "heads.lookup.PromptLookup"}, teacher)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return drafter.eval()


KINDS = ["medusa_chain", "medusa_tree", "eagle1_chain", "eagle1_dynamic", "eagle3_chain", "eagle3_dynamic",
         "draft_model", "lookup"]


def per_step(decoder: Decoder, drafter, prompt, short: int = 8, long: int = 40) -> tuple[float, dict]:
    decoder.speculative(drafter, prompt, long, num_draft=4)  # one-off set-up (a static tree's index) happens here
    counts, steps = [], []
    for n in (short, long):
        decoder.reseed(0)
        with TransferCounter() as c:
            gen = decoder.speculative(drafter, prompt, n, num_draft=4)
        counts.append(c.counts)
        steps.append(sum(gen.nodes_per_forward.values()))
    assert steps[1] > steps[0] + 3, f"the long decode needs more steps to measure a step ({steps})"
    kinds = {k: (counts[1][k] - counts[0][k]) / (steps[1] - steps[0]) for k in TransferCounter.KINDS}
    return sum(kinds.values()), kinds


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8)], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("kind", KINDS)
def test_transfers_per_decode_step_within_budget(tiny_teacher, kind, sampling):
    drafter = make(kind, tiny_teacher)
    prompt = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    prompt = torch.cat([prompt, prompt[:, :8], prompt[:, :8]], 1)  # something for lookup to find
    total, kinds = per_step(Decoder(tiny_teacher, DecoderConfig(**asdict(sampling), seed=1)), drafter, prompt)
    print(f"TRANSFERS {kind} {sampling.describe()}: {total:.2f} per step {kinds}")
    assert total <= BUDGET, f"{kind}: {total:.2f} transfers per decode step > {BUDGET}: {kinds}"


@pytest.mark.parametrize("kind", ["medusa_tree", "eagle1_dynamic", "eagle3_chain", "draft_model", "lookup"])
def test_batched_transfers_per_step_do_not_grow_with_the_drafter(tiny_teacher, kind):
    """Batch 3: one read-back of every row's verdict, plus the step's own bookkeeping (positions, kept columns);
    drafting adds nothing (lookup, which searches on the host, gets the committed tokens handed over there)."""
    from inference.batch_decoder import BucketDecoder

    drafter = make(kind, tiny_teacher)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (9, 14, 20)]
    prompts = [torch.cat([p, p[:6]]) for p in prompts]
    decoder = BucketDecoder(tiny_teacher, seed=1)
    decoder.speculative(drafter, prompts, 30, num_draft=4)
    counts, steps = [], []
    for n in (6, 30):
        with TransferCounter() as c:
            out = decoder.speculative(drafter, prompts, n, num_draft=4)
        counts.append(c.total)
        steps.append(out.steps)
    per_step = (counts[1] - counts[0]) / (steps[1] - steps[0])
    print(f"BATCHED TRANSFERS {kind}: {per_step:.2f} per step")
    assert per_step <= BUDGET, per_step
