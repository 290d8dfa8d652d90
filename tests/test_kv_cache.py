"""The preallocated target KV cache (inference.kv_cache): equal to DynamicCache through a model's own forward (prefill,
tree verification, compaction, continuation), in place (no reallocation while it fits), growing when it does not, the
decoder's greedy output unchanged with it (chain and tree, a sliding-window target), batch-B column gathers, and clear
refusals."""

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, StaticCache

from distill.teacher import Teacher
from inference.decoder import Decoder
from inference.kv_cache import PreallocatedCache, PreallocatedLayer, RaggedCache
from inference.masks import AttentionLayout
from inference.tree import DraftTree, compact_cache, verify_inputs
from tests.test_decoder import noisy_medusa
from tests.test_tree import ARCHS, TREE, path_to, tiny_model


def _run(model, cache, prompt, tree_path):
    """Prefill, verify TREE, keep ``tree_path``, feed one more token: the logits of each stage."""
    out = []
    with torch.no_grad():
        out.append(model(prompt[:, :-1], past_key_values=cache, use_cache=True).logits[0])
        inputs = verify_inputs(TREE, prompt[0, -1], prompt.shape[1] - 1, torch.float32)
        out.append(model(**inputs, past_key_values=cache, use_cache=True).logits[0])
        compact_cache(cache, TREE.size, tree_path)
        out.append(model(torch.tensor([[42, 7]]), past_key_values=cache, use_cache=True).logits[0])
    return out


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("capacity", [4, 256])  # 4: grows twice during the prefill and once for the tree
def test_preallocated_cache_equals_dynamic_cache(arch, capacity):
    model = tiny_model(arch)
    prompt = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(0))
    path = path_to(TREE, 6)  # not a prefix of the node order: a real in-buffer gather
    dyn, pre = DynamicCache(config=model.config), PreallocatedCache(capacity)
    for a, b in zip(_run(model, dyn, prompt, path), _run(model, pre, prompt, path)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    assert pre.get_seq_length() == dyn.get_seq_length() == prompt.shape[1] + len(path) + 2
    for d, p in zip(dyn.layers, pre.layers):
        assert torch.equal(p.keys, d.keys) and torch.equal(p.values, d.values)


def test_appends_and_compaction_stay_in_the_buffer():
    model = tiny_model("llama")
    cache = PreallocatedCache(64)
    prompt = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True)
        layer = cache.layers[0]
        ptr = layer.keys.data_ptr()
        before = layer.keys.clone()
        inputs = verify_inputs(TREE, torch.tensor(3), prompt.shape[1], torch.float32)
        model(**inputs, past_key_values=cache, use_cache=True)  # pending token + 7 nodes appended in place
        assert layer.keys.data_ptr() == ptr and layer.length == 11 + 1 + TREE.size
        nodes = layer.keys[:, :, 12:].clone()
        compact_cache(cache, TREE.size, [1, 4])  # a root child and its child: not a prefix
    assert layer.keys.data_ptr() == ptr and layer.length == 11 + 1 + 2
    assert torch.equal(layer.keys[:, :, :12, :][:, :, :11], before)
    assert torch.equal(layer.keys[:, :, 12:], nodes[:, :, [1, 4]])
    cache.crop(-2)
    assert cache.get_seq_length() == 12 and layer.keys.shape[2] == 12


def test_decoder_verifies_through_the_preallocated_cache(monkeypatch):
    teacher = Teacher(tiny_model("llama", seed=3), tokenizer=None, name="tiny")
    seen = []
    original = Decoder._forward
    monkeypatch.setattr(Decoder, "_forward", lambda self, inputs, cache, layers: (
        seen.append(type(cache)), original(self, inputs, cache, layers))[1])
    dec = Decoder(teacher)
    chain, tree = noisy_medusa(teacher), noisy_medusa(teacher)
    tree.set_tree("small")
    gen = torch.Generator().manual_seed(2)
    for i in range(6):
        prompt = torch.randint(0, 128, (1, 5 + 3 * i), generator=gen)
        ref = dec.plain_eager(prompt, 20).new_tokens
        hf = teacher.model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, prompt.shape[1]:]
        assert ref == hf.tolist() == dec.plain(prompt, 20).new_tokens  # the step path (static cache) too
        for drafter in (chain, tree):
            assert dec.speculative_eager(drafter, prompt, 20, num_draft=3).new_tokens == ref, f"prompt {i}"
    assert set(seen) == {PreallocatedCache}


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


def test_batch_rows_gather_their_columns_in_place():
    B, h, S, hd = 3, 2, 7, 4
    k = torch.randn(B, h, S, hd)
    layer = PreallocatedLayer(16)
    layer.update(k, -k)
    ptr = layer.keys.data_ptr()
    order = torch.tensor([[0, 2, 5], [1, 3, 6], [4, 5, 6]])
    layer.gather_columns(order)
    want = k.gather(2, order[:, None, :, None].expand(B, h, 3, hd))
    assert layer.keys.data_ptr() == ptr and torch.equal(layer.keys, want) and torch.equal(layer.values, -want)
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys, want[[2, 0]]) and layer.get_seq_length() == 3


def test_refusals():
    with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
        PreallocatedCache(0)
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
