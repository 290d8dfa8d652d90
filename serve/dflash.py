"""DFlash's export adapter. vLLM (``method: dflash``, the speculators format) and SGLang (``DFLASH``) serve DFlash
drafters, but the layout they read (a Qwen3-style draft config with ``dflash_config``: the 0-based
``target_layer_ids``, ``mask_token_id`` and ``block_size``) has not been transcribed from their loaders into a
checked export yet, so every engine is refused with that reason rather than written unchecked."""

from __future__ import annotations


class DFlashAdapter:
    kinds = ("dflash",)
    needs_training = True
    refused = {("*", "dflash"): "DFlash exports are not written yet: the engines' layout (vLLM method: dflash / "
                                "speculators, SGLang DFLASH) has no loader transcription in specdraft to check an "
                                "export against; evaluate the drafter with python -m eval drafter_path=..."}

    def supports(self, engine: str, kind: str) -> bool:
        return False
