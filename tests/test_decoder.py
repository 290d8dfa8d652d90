import pytest
import torch

from heads.base import Drafter, build_drafter
from tests.host_acceptance import greedy_accept
from inference.decoder import Decoder
from inference.tree import DraftTree
from tests.drafters import noisy_medusa


class OracleDrafter(Drafter):
    """Drafts with the target itself: every draft must be accepted."""

    def __init__(self, teacher):
        super().__init__({"hidden_size": teacher.hidden_size, "vocab_size": teacher.vocab_size, "num_layers": 2})
        self.model = teacher.model

    def propose(self, tokens, max_depth, sampling=None):
        out = self.model.generate(tokens, max_new_tokens=max_depth, do_sample=False, min_new_tokens=max_depth)
        return DraftTree.chain(out[0, tokens.shape[1]:])


def test_greedy_accept_rule():
    a, new = greedy_accept(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 9, 1]))
    assert a == 2 and new.tolist() == [5, 6, 9]
    a, new = greedy_accept(torch.tensor([5, 6]), torch.tensor([5, 6, 8]))
    assert a == 2 and new.tolist() == [5, 6, 8]
    a, new = greedy_accept(torch.tensor([], dtype=torch.long), torch.tensor([3]))
    assert a == 0 and new.tolist() == [3]
    with pytest.raises(ValueError):
        greedy_accept(torch.tensor([1, 2]), torch.tensor([1, 2]))


def test_plain_greedy_matches_hf_generate(tiny_teacher):
    dec = Decoder(tiny_teacher)
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    ours = dec.plain(prompt, 20).new_tokens
    hf = tiny_teacher.model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert ours == hf[0, 12:].tolist()


@pytest.mark.parametrize("kind", ["medusa", "medusa-bf16", "lookup"])
def test_speculative_is_token_identical_to_greedy(tiny_teacher, kind):
    dec = Decoder(tiny_teacher)
    if kind == "lookup":
        drafter = build_drafter({"_target_": "heads.lookup.PromptLookup"}, tiny_teacher)
    else:  # bf16 proposals (eval.drafter_dtype) change what is proposed, never what is output
        drafter = noisy_medusa(tiny_teacher).to(torch.bfloat16 if kind == "medusa-bf16" else torch.float32)
    gen = torch.Generator().manual_seed(1)
    accepted_some = rejected_some = False
    for i in range(50):
        length = 3 + i % 17
        prompt = torch.randint(0, 128, (1, length), generator=gen)
        if kind == "lookup":  # repeat a chunk so n-gram lookup has something to find
            prompt = torch.cat([prompt, prompt[:, : length // 2]], dim=1)
        ref = dec.plain(prompt, 24)
        spec = dec.speculative(drafter, prompt, 24, num_draft=3)
        assert spec.new_tokens == ref.new_tokens, f"prompt {i} diverged"
        hist = spec.stats.accepted_length_histogram()
        accepted_some |= any(hist[1:])
        rejected_some |= any(int(k) > a for k, row in spec.stats.counts.items() for a in row)
    assert accepted_some and rejected_some, "the test needs both accepted and rejected drafts to mean anything"


def test_drafter_equal_to_target_is_fully_accepted(tiny_teacher):
    dec = Decoder(tiny_teacher)
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    gen = dec.speculative(OracleDrafter(tiny_teacher), prompt, 1 + 5 * 6, num_draft=4)  # 6 full steps
    assert gen.stats.tau == 5.0  # γ + 1
    assert gen.stats.alpha == 1.0
    assert gen.new_tokens == dec.plain(prompt, 31).new_tokens


def test_eos_stops_both_decoders_identically(tiny_teacher):
    prompt = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    ref_free = Decoder(tiny_teacher).plain(prompt, 20).new_tokens
    eos = ref_free[5]
    dec = Decoder(tiny_teacher, eos_token_id=eos)
    ref = dec.plain(prompt, 20).new_tokens
    assert ref[-1] == eos and len(ref) <= 6
    assert dec.speculative(noisy_medusa(tiny_teacher), prompt, 20, 3).new_tokens == ref


def test_bad_prompts(tiny_teacher):
    dec = Decoder(tiny_teacher)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.plain(torch.zeros(1, 0, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        dec.speculative(noisy_medusa(tiny_teacher), torch.zeros(1, 250, dtype=torch.long), 10, 3)
