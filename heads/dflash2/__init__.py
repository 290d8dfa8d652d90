"""DFlash2: DFlash's block drafter with dynamic block convolutions and a low-rank path selector. ``conv`` holds the
convolutions and the draft layer they wrap, ``model`` trains and holds the drafter (the selector included), ``draft``
walks the selector over the block's candidates (the capture-safe step)."""

from heads.dflash2.model import DFlash2Drafter

__all__ = ["DFlash2Drafter"]
