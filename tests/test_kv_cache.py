"""The draft model's batch cache (inference.kv_cache): each row scattered to its own columns, grown zeroed; a
sliding-window target decoded like full forwards (every layer kept whole, the window in the masks); clear
refusals."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, StaticCache

from distill.teacher import Teacher
from inference.decoder import Decoder
from inference.kv_cache import PreallocatedLayer, RaggedCache
from inference.masks import AttentionLayout
from inference.tree import compact_cache
from tests.drafters import noisy_medusa
from tests.test_tree import tiny_model


def test_sliding_window_target_decodes_like_a_full_forward():
    """Mistral with a 6-token window: every layer is kept whole and the masks apply the window (inference.masks), so
    the decoder's output, past the window, equals greedy decoding by full forwards without any cache."""
    torch.manual_seed(4)
    model = MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                             max_position_embeddings=256, sliding_window=6)).eval()
    teacher = Teacher(model, tokenizer=None, name="tiny-mistral")
    assert AttentionLayout.of(model).window == 6
    dec = Decoder(teacher)
    drafter = noisy_medusa(teacher)
    drafter.set_tree("small")
    prompt = torch.randint(0, 128, (1, 14), generator=torch.Generator().manual_seed(5))
    ids = prompt
    with torch.no_grad():
        for _ in range(16):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    want = ids[0, 14:].tolist()
    assert dec.plain(prompt, 16).new_tokens == want
    assert dec.speculative(drafter, prompt, 16, num_draft=3).new_tokens == want


def test_refusals():
    with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
        RaggedCache(0)
    layer = PreallocatedLayer(8)
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    with pytest.raises(ValueError, match="negative count"):
        layer.crop(2)
    # Caches the decoder does not build keep today's refusal for a tree they cannot compact.
    model = tiny_model("llama")
    static = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=static, use_cache=True)
    with pytest.raises(ValueError, match="cannot compact a StaticLayer"):
        compact_cache(static, 3, [1])


def test_ragged_cache_scatters_each_row_to_its_own_columns_and_grows_zeroed():
    """Rows of different lengths: each new entry lands in the column its row asks for (padding in the scratch column
    past every row), the layer returns every row's first ``extent`` columns, and a grown buffer keeps what was written
    and holds zeros (finite) where nothing was: a masked column is weighted by 0, and 0 * NaN would be NaN."""
    cache = RaggedCache(capacity=4)
    kv = lambda B, n, base: (base + torch.arange(B * n, dtype=torch.float32)).view(B, 1, n, 1).expand(B, 2, n, 3)
    k, v = cache.update(kv(2, 3, 0), kv(2, 3, 100), 0)  # append mode: both rows 3 long
    assert k.shape == (2, 2, 3, 3) and cache.get_seq_length() == 3
    # Row 0 gets one entry at column 3 (two padding entries to the scratch column 5); row 1 three at columns 1..3.
    cache.write_at(torch.tensor([[5, 5, 3], [1, 2, 3]]), 5)
    k, v = cache.update(kv(2, 3, 10), kv(2, 3, 110), 0)
    assert k.shape == (2, 2, 5, 3) and cache.get_seq_length() == 5 and cache.layers[0].capacity >= 6
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 12, 0]  # its 3 old entries, its new one, never-written column: 0
    assert k[1, 0, :, 0].tolist() == [3, 13, 14, 15, 0]  # its first old entry kept, then the 3 new ones
    assert v[1, 1, 1:4, 2].tolist() == [113, 114, 115]
    cache.write_at(None)
    cache.set_length(2)  # back to append mode: every row 2 long
    k, _ = cache.update(kv(2, 1, 50), kv(2, 1, 150), 0)
    assert k[:, 0, :, 0].tolist() == [[0, 1, 50], [3, 13, 51]]
