"""DFlash, the block-parallel drafter: ``layers`` (its attention over target context and block), ``model`` (training
and the drafter's interface), ``rows`` (the eager drafting of a batch's rows), ``draft`` (the capture-safe static
draft step)."""

from heads.dflash.model import DFlashDrafter

__all__ = ["DFlashDrafter"]
