"""Messages that name the right thing, and leftovers nothing cleared: the evaluated target's positions, a digest
sidecar read as ``sha256sum -c`` reads it, a killed save's hidden copy, an export's edited model card."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from heads.saved import WEIGHTS, load_saved_drafter
from tests.test_reliability_cluster import cache, finished  # noqa: F401 (fixtures)
from tests.test_reliability_units import CONF, saved_medusa


def test_context_lengths_are_checked_against_the_evaluated_target(finished, cache, tmp_path):
    """A smoke run's drafter is evaluated against its own target (128 positions), not the default one (256)."""
    from eval.run import run_eval

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"drafter_path={finished / 'drafter'}", f"target.cache_dir={cache}", "trainer.device=cpu",
            "eval.num_prompts=1", "eval.max_new_tokens=8", "eval.context_lengths=[64,300]"])
    with pytest.raises(ValueError, match=r"eval.context_lengths has 300, longer than the target's 128 positions"):
        run_eval(cfg, tmp_path / "eval", overrides=[])


def test_an_upper_case_digest_sidecar_is_accepted(tiny_teacher, tmp_path):
    path = saved_medusa(tiny_teacher, tmp_path / "d")
    recorded = path / f"{WEIGHTS}.sha256"
    digest, name = recorded.read_text().split()
    recorded.write_text(f"{digest.upper()} *{name}\n")  # sha256sum -c accepts both the case and the binary mark
    load_saved_drafter(path)


@pytest.mark.parametrize("text, what", [("", "is empty"), ("\n", "is empty"), ("0123 model.safetensors\n",
                                                                               "holds no sha256 digest")])
def test_an_empty_or_damaged_sidecar_is_named_as_such(tiny_teacher, tmp_path, text, what):
    path = saved_medusa(tiny_teacher, tmp_path / "d")
    (path / f"{WEIGHTS}.sha256").write_text(text)
    with pytest.raises(ValueError, match=rf"^\S+/{WEIGHTS}.sha256 {what}.*the digest sidecar is damaged") as err:
        load_saved_drafter(path)
    assert f"{WEIGHTS} is damaged" not in str(err.value)  # the weights themselves are not accused


def test_a_killed_drafter_save_leaves_nothing_the_next_save_keeps(tiny_teacher, tmp_path):
    """``kill -9`` inside ``drafter/``'s atomic swap leaves its hidden copy (``.drafter.tmp-*``) or the old one being
    swapped out (``.drafter.old-*``); the next save of that drafter removes them, and nothing else."""
    for left in (".drafter.tmp-k2x9q", ".drafter.old-4242"):
        (tmp_path / left).mkdir()
        (tmp_path / left / WEIGHTS).write_bytes(b"\0" * 4096)
    (tmp_path / ".drafter-notes").mkdir()  # not a save's: kept
    saved_medusa(tiny_teacher, tmp_path / "drafter")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".drafter-notes", "drafter"]


def test_export_overwrite_refuses_an_edited_model_card(finished, tmp_path):
    from serve.export import export_drafter

    out = tmp_path / "export"
    export_drafter(finished / "drafter", "vllm", out)
    export_drafter(finished / "drafter", "vllm", out, overwrite=True)  # untouched: replaced
    card = out / "README.md"
    edited = card.read_text() + "\nServed behind our gateway since Monday.\n"
    card.write_text(edited)
    with pytest.raises(FileExistsError, match=r"README.md was edited since the export wrote it; overwrite=true "
                                              r"would drop those edits: move README.md out"):
        export_drafter(finished / "drafter", "vllm", out, overwrite=True)
    assert card.read_text() == edited
    card.unlink()  # moved out: the export is replaced, and writes its own card again
    export_drafter(finished / "drafter", "vllm", out, overwrite=True)
    assert Path(card).is_file()
