"""``decoder.compile``: the batch-1 step functions compiled (torch.compile, fullgraph=True, dynamic=False) decode
token-identically to the eager loop (greedy, a static tree and a chain, two prompt lengths). Slow: compiling with
inductor takes about a minute on CPU."""

import pytest
import torch

from inference.decoder import Decoder, DecoderConfig
from tests.test_decoder_transfers import make


@pytest.mark.slow
def test_compiled_decoder_is_token_identical(tiny_teacher):
    eager, compiled = Decoder(tiny_teacher), Decoder(tiny_teacher, DecoderConfig(compile=True))
    assert compiled.steps.compile and not eager.steps.compile  # it really runs the compiled steps
    gen = torch.Generator().manual_seed(0)
    for kind in ("medusa_tree", "medusa_chain"):
        drafter = make(kind, tiny_teacher)
        for length in (9, 23):
            prompt = torch.randint(0, 128, (1, length), generator=gen)
            ref = eager.speculative_eager(drafter, prompt, 20, num_draft=3)
            out = compiled.speculative(drafter, prompt, 20, num_draft=3)
            assert out.new_tokens == ref.new_tokens == eager.plain_eager(prompt, 20).new_tokens
            assert out.stats.counts == ref.stats.counts
    assert compiled.plain(prompt, 20).new_tokens == ref.new_tokens
