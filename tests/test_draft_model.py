"""DraftModel (a standalone draft LM) and the Hugging Face generate baselines, on tiny in-process Llamas only."""

import copy
import functools
import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

from distill.losses import forward_kl
from distill.toy import ToyTargetConfig
from eval.baselines import hf_assisted, hf_generate
from heads.base import TargetDims, build_drafter
from heads.saved import load_drafter, load_saved_drafter, save_drafter
from heads.draft_model.model import DraftModel
from inference.decoder import Decoder, DecoderConfig
from inference.sampling import GREEDY, SamplingConfig
from tests.conftest import make_tiny_llama
from tests.drafters import DIMS, truncated
from train.config import _check_keys

TARGET_CFG = {"source": "toy", "name": "tiny-llama"}
CONF = Path(__file__).resolve().parents[1] / "conf"


tiny_llama = make_tiny_llama  # the ``teacher`` fixture (conftest) is make_tiny_llama(initializer_range=0.2)


def draft(model, teacher=None) -> DraftModel:
    drafter = DraftModel(DIMS, model=model)
    if teacher is not None:
        drafter.bind_target(teacher, initialize=True)
    return drafter.eval()


def random_prompt(gen, max_len=40):
    n = int(torch.randint(1, max_len + 1, (1,), generator=gen))
    return torch.randint(0, 128, (1, n), generator=gen)


def test_greedy_speculative_is_token_identical_to_plain(teacher):
    dec, drafter = Decoder(teacher), draft(truncated(teacher.model), teacher)
    gen = torch.Generator().manual_seed(0)
    accepted = rejected = 0
    for i in range(50):
        prompt, num_draft = random_prompt(gen), 1 + i % 5
        ref = dec.plain(prompt, 24)
        out = dec.speculative(drafter, prompt, 24, num_draft)
        assert out.new_tokens == ref.new_tokens, f"prompt {i} (length {prompt.shape[1]}, num_draft {num_draft})"
        for k, row in out.stats.counts.items():
            accepted += sum(c for a, c in row.items() if a > 0)
            rejected += sum(c for a, c in row.items() if a < k)
    assert accepted and rejected  # both paths of the cache bookkeeping were exercised


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=["greedy", "t1"])
def test_the_target_as_its_own_draft_is_always_fully_accepted(teacher, sampling):
    dec = Decoder(teacher, DecoderConfig(**asdict(sampling), seed=3))
    drafter = draft(teacher.model, teacher)  # q == p: rejection sampling never rejects
    gen = torch.Generator().manual_seed(1)
    num_draft, max_new = 4, 23
    expected, remaining = {}, max_new - 1  # the prefill commits the first token
    while remaining > 0:  # every forward commits its drafts + 1; the last one is shown only what is left
        k = min(num_draft, remaining)
        expected[k] = expected.get(k, 0) + 1
        remaining -= k + 1
    for _ in range(6):
        out = dec.speculative(drafter, random_prompt(gen), max_new, num_draft)
        assert len(out.new_tokens) == max_new
        assert {k: dict(row) for k, row in out.stats.counts.items()} == {k: {k: c} for k, c in expected.items()}
        assert out.stats.counts[num_draft][num_draft] == expected[num_draft]  # each of those: τ = num_draft + 1


def same_proposal(a, b, sampled=False):
    if sampled:  # later draws depend on the sampler's state; the first row depends on the context only
        torch.testing.assert_close(a.probs_NV[0], b.probs_NV[0], atol=1e-5, rtol=1e-5)
    else:
        assert a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.parametrize("case", ["partial", "full", "diverged", "same", "shorter"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, top_k=20)], ids=["greedy", "sampled"])
def test_cache_reuse_matches_a_fresh_draft_model(teacher, case, sampling):
    model = truncated(teacher.model)
    gen = torch.Generator().manual_seed(2)
    first = torch.randint(0, 128, (1, 20), generator=gen)
    kept = draft(model)
    tree = kept.propose(first, 4, sampling)
    drafts = tree.tokens.view(1, -1)
    nxt = torch.tensor([[7]])
    second = {
        "partial": torch.cat([first, drafts[:, :2], nxt], 1),  # two drafts accepted, then the target's own token
        "full": torch.cat([first, drafts, nxt], 1),  # all accepted plus the bonus token
        "diverged": torch.cat([first[:, :5], nxt, first[:, 6:]], 1),  # differs far back in the context
        "same": first,
        "shorter": first[:, :12],
    }[case]
    for _ in range(2):  # and once more from the state the second proposal left
        again = kept.propose(second, 3, sampling)
        same_proposal(again, draft(model).propose(second, 3, sampling), sampled=not sampling.greedy)
        assert kept._cache.get_seq_length() == kept._cached_ids.shape[0] == second.shape[1] + 2
        second = torch.cat([second, again.tokens.view(1, -1)[:, :1], nxt], 1)


def test_sliding_window_draft_model_rolls_back_correctly():
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, sliding_window=8)
    model = MistralForCausalLM(config).eval()
    kept, gen = draft(model), torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (1, 12), generator=gen)
    for step in range(8):
        tree = kept.propose(tokens, 4)
        assert tree.tokens.tolist() == draft(model).propose(tokens, 4).tokens.tolist(), f"step {step}"
        accepted = int(torch.randint(0, 5, (1,), generator=gen))
        tokens = torch.cat([tokens, tree.tokens.view(1, -1)[:, :accepted], torch.tensor([[step]])], 1)
    # A rollback further back than the previous proposal starts over, still correctly.
    assert kept.propose(tokens[:, :10], 2).tokens.tolist() == draft(model).propose(tokens[:, :10], 2).tokens.tolist()



def test_sliding_window_draft_models_decode_a_batch_through_per_row_copies(teacher):
    """A draft model with sliding-window layers has no static draft (its ``DynamicCache`` rolls windows back): a
    batch drafts through per-row copies of its eager ``propose``, every row equal to plain greedy decoding past the
    window; without a window it drafts through its static step."""
    from heads.base import ForkedRows
    from inference.batch_decoder import BucketDecoder

    def mistral(window):
        torch.manual_seed(0)
        config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, sliding_window=window)
        return DraftModel(DIMS, model=MistralForCausalLM(config).eval())

    drafter = mistral(8)
    assert drafter.static_draft(None, 32, GREEDY, None) is None
    assert isinstance(drafter.rows([0, 1]), ForkedRows)
    asked = []
    rows = drafter.rows
    drafter.rows = lambda seeds: asked.append(len(seeds)) or rows(seeds)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 21, 13)]
    refs = [Decoder(teacher).plain(p[None], 16).new_tokens for p in prompts]  # past the window
    out = BucketDecoder(teacher).speculative(drafter, prompts, 16, num_draft=3)
    assert asked == [3]
    assert [g.new_tokens for g in out.generations] == refs
    unwindowed = BucketDecoder(teacher)
    out = unwindowed.speculative(mistral(None), prompts, 16, num_draft=3)
    assert unwindowed._drafts and [g.new_tokens for g in out.generations] == refs

def test_toy_source_merges_overrides_into_the_toy_defaults(tiny_teacher, monkeypatch):
    seen = {}

    def fake_build(cfg, cache_dir):  # the real build takes minutes; only the config it gets matters here
        seen.update(cfg)
        return tiny_llama(num_hidden_layers=1), None

    monkeypatch.setattr("heads.draft_model.model.load_or_build_toy_target", fake_build)
    node = {**OmegaConf.to_container(OmegaConf.load(CONF / "drafter" / "draft_model.yaml")), "source": "toy"}
    drafter = build_drafter(node, tiny_teacher)
    assert isinstance(drafter, DraftModel) and seen == {**asdict(ToyTargetConfig()), **node["toy"]}
    with pytest.raises(ValueError, match=r"drafter.toy has unknown keys \['hiden_size'\]"):
        DraftModel(DIMS, toy={"hiden_size": 64})


def test_hf_source_loads_a_local_directory_with_its_tokenizer(tiny_teacher, tmp_path):
    words = WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), eos_token="t2")
    model = tiny_llama(num_hidden_layers=1)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    drafter = DraftModel(DIMS, source="hf", name=str(tmp_path / "m"))
    torch.testing.assert_close(drafter.model.lm_head.weight, model.lm_head.weight)
    tiny_teacher.tokenizer = tokenizer
    drafter.bind_target(tiny_teacher, initialize=True)  # same vocabulary: accepted
    with pytest.raises(ValueError, match="drafter.source=hf needs drafter.name"):
        DraftModel(DIMS, source="hf")


def test_vocab_mismatch_names_the_tokenizer(tiny_teacher):
    with pytest.raises(ValueError, match="tokenizer") as err:
        draft(make_tiny_llama(vocab_size=64), tiny_teacher)
    assert "64" in str(err.value) and "128" in str(err.value)


def test_tokenizer_vocab_mismatch_is_refused(tiny_teacher):
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    drafter = draft(truncated(tiny_teacher.model))
    tiny_teacher.tokenizer, drafter.tokenizer = Tok({"a": 0, "b": 1}), Tok({"a": 0, "b": 1})
    drafter.bind_target(tiny_teacher, initialize=True)
    drafter.tokenizer = Tok({"a": 1, "b": 0})
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        drafter.bind_target(tiny_teacher, initialize=True)


def test_unknown_source_lists_valid_ones():
    with pytest.raises(ValueError, match=r"drafter.source='gguf'.*\['config', 'toy', 'hf'\]"):
        DraftModel(DIMS, source="gguf")


def test_context_beyond_the_draft_models_positions_is_refused():
    drafter = draft(tiny_llama(num_hidden_layers=1, max_position_embeddings=16))
    drafter.propose(torch.zeros(1, 13, dtype=torch.long), 4)  # 13 + 3 fed positions: fits
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        drafter.propose(torch.zeros(1, 14, dtype=torch.long), 4)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_save_load_round_trip(teacher, tmp_path, tied):
    drafter = draft(truncated(teacher.model, tie_word_embeddings=tied), teacher)
    save_drafter(drafter, tmp_path / "d", drafter.saved_config(), TARGET_CFG, teacher.identity())
    loaded = load_drafter(tmp_path / "d", teacher)
    assert isinstance(loaded, DraftModel) and loaded.state_dict().keys() == drafter.state_dict().keys()
    for name, p in drafter.model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(dict(loaded.model.named_parameters(remove_duplicate=False))[name], p)
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    dec = Decoder(teacher)
    assert dec.speculative(loaded, prompt, 16, 3).stats.counts == dec.speculative(drafter, prompt, 16, 3).stats.counts


def test_saved_config_drops_the_runtime_model_and_keeps_the_yaml_node():
    drafter = draft(tiny_llama(num_hidden_layers=1))
    node = drafter.saved_config({"_target_": "heads.draft_model.DraftModel", "source": "toy", "model": "x"})
    assert "model" not in node and node["source"] == "toy" and node["model_config"]["num_hidden_layers"] == 1
    assert drafter.saved_config(node) == node  # idempotent: safe to apply on every save
    assert json.loads(json.dumps(node)) == node  # what a checkpoint reads back equals what a resumed run computes


def test_yaml_keys_match_the_constructor():
    node = OmegaConf.load(CONF / "drafter" / "draft_model.yaml")
    _check_keys(node, "drafter", runtime=("dims",))
    assert "model" not in node and "model_config" not in node
    target_toy = OmegaConf.load(CONF / "target" / "toy.yaml").toy
    for key in ("vocab_size", "max_seq_len", "corpus_max_bytes"):  # these fix the BPE tokenizer
        assert node.toy[key] == target_toy[key], key


def test_training_forward_aligns_with_the_teacher_and_trains_only_the_draft(tiny_teacher):
    drafter = draft(tiny_llama(seed=1, num_hidden_layers=1), tiny_teacher).train()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.ones(2, 12, dtype=torch.bool)
    loss_mask[:, :8] = False  # tokens 8..11 are learnable: predicted at positions 7..10
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    teacher_out = tiny_teacher(ids, batch["attention_mask"])
    out = drafter(batch, teacher_out)
    term = out.terms[0]  # every position t < 11 of both rows, those of 7..10 weighing 1
    assert len(out.terms) == 1 and int(out.num_valid) == int(term.mask_N.sum()) == 2 * 4
    assert term.mask_N.view(2, 11).nonzero()[:, 1].tolist() == [7, 8, 9, 10] * 2
    torch.testing.assert_close(term.teacher_NV[term.mask_N], teacher_out.logits_BTV[:, 7:11].reshape(8, 128))
    loss, n = out.loss(functools.partial(forward_kl, temperature=1.0))
    (loss / n).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert all(p.grad is None for p in tiny_teacher.model.parameters())


@pytest.mark.parametrize("with_eos", [False, True], ids=["no-eos", "eos"])
def test_hf_baselines_match_plain_greedy(teacher, with_eos):
    gen = torch.Generator().manual_seed(6)
    prompts = [(random_prompt(gen, 24), int(torch.randint(1, 6, (1,), generator=gen))) for _ in range(3)]
    eos = Decoder(teacher).plain(prompts[0][0], 20).new_tokens[6] if with_eos else None  # a token it does emit
    dec = Decoder(teacher, eos_token_id=eos)
    # Hub checkpoints ship such defaults; the baselines must decode by our rule regardless.
    teacher.model.generation_config.update(do_sample=True, top_k=5, repetition_penalty=1.5)
    stopped = False
    for assistant in (truncated(teacher.model), teacher.model):
        for prompt, num_draft in prompts:
            ref = dec.plain(prompt, 20).new_tokens
            stopped |= len(ref) < 20
            plain = hf_generate(teacher, prompt, 20, GREEDY, eos)
            assisted = hf_assisted(teacher, assistant, prompt, 20, num_draft, GREEDY, eos)
            assert plain["new_tokens"] == ref and assisted["new_tokens"] == ref
            assert plain["seconds"] > 0 and assisted["seconds"] > 0
    assert stopped == with_eos
    assert teacher.model.generation_config.repetition_penalty == 1.5  # the swapped-out config came back


def test_hf_assisted_drafts_a_constant_num_draft(teacher, monkeypatch):
    """HF's defaults would stop a draft early (confidence 0.4; a random draft is rarely that sure) or grow it."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    drafted, expected = [], []
    original = AssistedCandidateGenerator.get_candidates

    def spy(self, input_ids, **kwargs):
        ids, logits = original(self, input_ids, **kwargs)
        drafted.append(ids.shape[1] - input_ids.shape[1])
        expected.append(min(3, self.main_model_max_length - input_ids.shape[1] - 1))
        return ids, logits

    monkeypatch.setattr(AssistedCandidateGenerator, "get_candidates", spy)
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(7))
    hf_assisted(teacher, tiny_llama(seed=9, num_hidden_layers=1), prompt, 40, 3, GREEDY, None)
    assert len(drafted) > 5 and drafted == expected and drafted.count(3) >= len(drafted) - 3


def test_hf_generate_samples_reproducibly(teacher):
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(8))
    cfg = SamplingConfig(temperature=1.5, top_p=0.95)
    runs = [hf_generate(teacher, prompt, 16, cfg, None, seed=s)["new_tokens"] for s in (0, 0, 1)]
    assert runs[0] == runs[1] != runs[2]


# --- built from the target's config (DistillSpec-style draft), LoRA, on-policy sampling ---------------------------


def test_config_source_builds_one_layer_at_the_target_width_with_its_embeddings(teacher):
    drafter = build_drafter(OmegaConf.to_container(OmegaConf.load(CONF / "drafter" / "draft_model.yaml")), teacher)
    assert drafter.model is None and drafter.needs_training  # built when the target is bound
    drafter.bind_target(teacher, initialize=True)
    cfg = drafter.model.config
    assert cfg.num_hidden_layers == 1 and cfg.hidden_size == teacher.hidden_size and cfg.vocab_size == 128
    target = teacher.model.state_dict()
    mine = drafter.model.state_dict()
    torch.testing.assert_close(mine["model.embed_tokens.weight"], target["model.embed_tokens.weight"])
    torch.testing.assert_close(mine["model.norm.weight"], target["model.norm.weight"])
    # init=embeddings leaves the layer fresh; init=truncated copies the target's first layer too
    layer = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(mine[layer], target[layer])
    truncated_draft = DraftModel(DIMS, init="truncated")
    truncated_draft.bind_target(teacher, initialize=True)
    torch.testing.assert_close(truncated_draft.model.state_dict()[layer], target[layer])
    with pytest.raises(ValueError, match="drafter.config_overrides.num_layerz"):
        DraftModel(DIMS, config_overrides={"num_layerz": 1}).bind_target(teacher, initialize=True)
    with pytest.raises(ValueError, match=r"drafter.init='copy'.*\['embeddings', 'truncated', 'none'\]"):
        DraftModel(DIMS, init="copy")


def test_config_source_saves_loads_and_decodes_losslessly(teacher, tmp_path):
    drafter = DraftModel(DIMS)
    drafter.bind_target(teacher, initialize=True)
    save_drafter(drafter, tmp_path / "d", drafter.saved_config({"_target_": "heads.draft_model.DraftModel"}),
                 TARGET_CFG, teacher.identity())
    loaded = load_drafter(tmp_path / "d", teacher)
    assert loaded.model.config.num_hidden_layers == 1
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    dec = Decoder(teacher)
    assert dec.speculative(loaded, prompt, 20, 4).new_tokens == dec.plain(prompt, 20).new_tokens


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _nonzero_lora(drafter, seed=0):
    """LoRA B starts at zero (the adapters change nothing); give them weights so save/load/merge are tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_lora_adapters_train_alone_and_save_load_merge(teacher, tmp_path):
    base = truncated(teacher.model)
    drafter = DraftModel(DIMS, model=copy_of(base), lora=LORA)
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # the base weights stay as loaded
    _nonzero_lora(drafter)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    adapted = drafter.model(input_ids=ids).logits
    assert not torch.allclose(adapted, base(input_ids=ids).logits, atol=1e-4)

    save_drafter(drafter, tmp_path / "d", drafter.saved_config({"_target_": "heads.draft_model.DraftModel",
                                                                "source": "toy", "lora": LORA}),
                 TARGET_CFG, teacher.identity())
    loaded, config = load_saved_drafter(tmp_path / "d")
    assert config["drafter"]["lora"]["r"] == 4 and loaded.lora is not None
    torch.testing.assert_close(loaded.model(input_ids=ids).logits, adapted)

    drafter.save_adapter(tmp_path / "adapter")  # PEFT's own format
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(copy_of(base), str(tmp_path / "adapter"))
    torch.testing.assert_close(peft_model(input_ids=ids).logits, adapted)

    bound = load_drafter(tmp_path / "d", teacher)  # loading for decoding merges the adapters
    assert bound.lora is None and not any("lora_" in n for n, _ in bound.model.named_parameters())
    torch.testing.assert_close(bound.model(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)


def copy_of(model):
    return copy.deepcopy(model)


def test_lora_spec_errors_name_the_key():
    with pytest.raises(ValueError, match=r"drafter.lora has unknown keys \['rank'\]"):
        DraftModel(DIMS, model=tiny_llama(num_hidden_layers=1), lora={"rank": 4})
    with pytest.raises(ValueError, match="drafter.lora.r=0"):
        DraftModel(DIMS, model=tiny_llama(num_hidden_layers=1), lora={"r": 0})
    with pytest.raises(ValueError, match=r"drafter.lora.target_modules=\['c_attn'\] matches no layer"):
        DraftModel(DIMS, model=tiny_llama(num_hidden_layers=1), lora={"target_modules": ["c_attn"]})


def test_special_token_mismatch_is_refused(tiny_teacher):
    class Tok:
        def __init__(self, eos):
            self.eos_token_id = eos

        def get_vocab(self):
            return {"a": 0}

    drafter = draft(truncated(tiny_teacher.model))
    tiny_teacher.tokenizer, drafter.tokenizer = Tok(2), Tok(3)
    with pytest.raises(ValueError, match="eos_token_id=3.*has 2"):
        drafter.bind_target(tiny_teacher, initialize=True)


def test_sample_continuations_draws_from_the_draft(teacher):
    drafter = draft(truncated(teacher.model), teacher)
    prompt = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(2))
    drafter.train()
    drawn = drafter.sample_continuations(prompt, 5, 1.0, torch.Generator().manual_seed(9))
    assert drawn.shape == (3, 5) and drafter.model.training  # the training mode is restored
    # The same draws, one token at a time from the draft's full-sequence softmax with the same generator.
    gen, ids = torch.Generator().manual_seed(9), prompt
    with torch.no_grad():
        for k in range(5):
            probs = torch.softmax(drafter.model.eval()(input_ids=ids).logits[:, -1].float(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
    assert torch.equal(ids[:, 7:], drawn)
    greedy = drafter.sample_continuations(prompt, 4, 0.0, torch.Generator())
    assert torch.equal(greedy[:, 0], drafter.model(input_ids=prompt).logits[:, -1].argmax(-1))
