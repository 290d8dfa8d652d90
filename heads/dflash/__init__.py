"""DFlash, the block-parallel drafter: ``layers`` (its attention over target context and block), ``model`` (training
and the drafter's interface), ``draft`` (the capture-safe static draft step, run at every row of
a batch)."""

from heads.dflash.model import DFlashDrafter

__all__ = ["DFlashDrafter"]
