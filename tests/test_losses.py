import functools

import pytest
import torch
import torch.nn.functional as F

from distill.losses import forward_kl


def test_zero_when_student_equals_teacher():
    logits = torch.randn(5, 7, 50)
    loss, n = forward_kl(logits, logits.clone(), torch.ones(5, 7, dtype=torch.bool))
    assert n == 35
    assert loss.abs() < 1e-5


def test_matches_kl_div_and_is_positive():
    torch.manual_seed(0)
    s, t = torch.randn(4, 6, 30), torch.randn(4, 6, 30)
    mask = torch.ones(4, 6, dtype=torch.bool)
    loss, n = forward_kl(s, t, mask)
    p = F.softmax(t, -1)
    direct = (p * (F.log_softmax(t, -1) - F.log_softmax(s, -1))).sum()
    torch.testing.assert_close(loss, direct, rtol=1e-5, atol=1e-5)
    assert loss > 0 and n == 24


def test_temperature_scaling():
    torch.manual_seed(1)
    s, t = torch.randn(3, 20), torch.randn(3, 20)
    mask = torch.ones(3, dtype=torch.bool)
    loss, _ = forward_kl(s, t, mask, temperature=2.0)
    ref = F.kl_div(F.log_softmax(s / 2, -1), F.log_softmax(t / 2, -1), log_target=True, reduction="sum") * 4
    torch.testing.assert_close(loss, ref)
    with pytest.raises(ValueError, match="temperature"):
        forward_kl(s, t, mask, temperature=0.0)


def test_mask_respected():
    torch.manual_seed(2)
    s, t = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :3] = True
    loss, n = forward_kl(s, t, mask)
    ref, _ = forward_kl(s[0, :3], t[0, :3], torch.ones(3, dtype=torch.bool))
    assert n == 3
    torch.testing.assert_close(loss, ref)
    # Changing masked-out logits changes nothing.
    s2 = s.clone()
    s2[1] += 100
    torch.testing.assert_close(forward_kl(s2, t, mask)[0], loss)


def test_bf16_inputs_computed_in_float32():
    torch.manual_seed(3)
    s, t = torch.randn(4, 100), torch.randn(4, 100)
    mask = torch.ones(4, dtype=torch.bool)
    loss16, _ = forward_kl(s.bfloat16(), t.bfloat16(), mask)
    loss32, _ = forward_kl(s.bfloat16().float(), t.bfloat16().float(), mask)
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32)


def test_shape_errors():
    with pytest.raises(ValueError, match="mask shape"):
        forward_kl(torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="differ"):
        forward_kl(torch.randn(2, 4), torch.randn(2, 5), torch.ones(2, dtype=torch.bool))


def test_partial_from_config_matches_direct_call():
    from hydra.utils import instantiate

    fn = instantiate({"_target_": "distill.losses.forward_kl", "_partial_": True, "temperature": 1.0})
    assert isinstance(fn, functools.partial)
    s, t, m = torch.randn(3, 9), torch.randn(3, 9), torch.ones(3, dtype=torch.bool)
    torch.testing.assert_close(fn(s, t, m)[0], forward_kl(s, t, m)[0])


# --- the divergence menu -----------------------------------------------------------------------------------------

from distill.losses import jsd, reverse_kl, topk_forward_kl, total_variation  # noqa: E402

MENU = {
    "fkl": forward_kl,
    "rkl": reverse_kl,
    "jsd": jsd,
    "jsd_0.1": functools.partial(jsd, beta=0.1),
    "tvd": total_variation,
    "topk_fkl": functools.partial(topk_forward_kl, k=5),
}


def _direct(name, s, t, T=1.0):
    """Each divergence from its textbook formula, position by position."""
    p, q = F.softmax(t / T, -1), F.softmax(s / T, -1)
    if name == "fkl":
        return (p * (p.log() - q.log())).sum() * T**2
    if name == "rkl":
        return (q * (q.log() - p.log())).sum() * T**2
    if name.startswith("jsd"):
        beta = 0.1 if name == "jsd_0.1" else 0.5
        m = beta * p + (1 - beta) * q
        return (beta * (p * (p.log() - m.log())).sum() + (1 - beta) * (q * (q.log() - m.log())).sum()) * T**2
    if name == "tvd":
        return 0.5 * (p - q).abs().sum()
    vals, idx = (t / T).topk(5, -1)
    pk = F.softmax(vals, -1)
    return (pk * (pk.log() - q.log().gather(-1, idx))).sum() * T**2


@pytest.mark.parametrize("name", sorted(MENU))
def test_menu_zero_nonnegative_direct_masked_and_tempered(name):
    loss_fn = MENU[name]
    torch.manual_seed(3)
    s, t = torch.randn(4, 6, 30), torch.randn(4, 6, 30)
    full = torch.ones(4, 6, dtype=torch.bool)
    if name != "topk_fkl":  # top-k renormalisation differs from the full softmax even for identical logits
        assert loss_fn(t, t.clone(), full)[0].abs() < 1e-5
    for T in (1.0, 2.0):
        loss, n = loss_fn(s, t, full, temperature=T)
        assert loss >= 0 and n == 24
        torch.testing.assert_close(loss, _direct(name, s, t, T), rtol=1e-4, atol=1e-5)
        unmasked, n_all = loss_fn(s, t, None, temperature=T)  # None: every position (rows already selected)
        assert n_all == 24
        torch.testing.assert_close(unmasked, loss, rtol=1e-6, atol=1e-7)
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) > 0.5
    masked, n = loss_fn(s, t, mask)
    torch.testing.assert_close(masked, _direct(name, s[mask], t[mask]), rtol=1e-4, atol=1e-5)
    assert n == mask.sum()
    s.requires_grad_(True)
    loss_fn(s, t, mask)[0].backward()
    assert s.grad[~mask].abs().max() == 0 and s.grad[mask].abs().max() > 0  # gradients only where the mask is


def test_menu_bad_arguments():
    s = torch.randn(2, 5)
    with pytest.raises(ValueError, match="loss.beta must lie in \\[0, 1\\], got 1.5"):
        jsd(s, s, torch.ones(2, dtype=torch.bool), beta=1.5)
    with pytest.raises(ValueError, match="loss.k must be >= 1"):
        topk_forward_kl(s, s, torch.ones(2, dtype=torch.bool), k=0)
