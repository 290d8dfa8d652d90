"""DSpark: DFlash's block drafter plus a Markov head and a confidence head. ``model`` trains and holds it, ``draft``
drafts (the capture-safe static step)."""

from heads.dspark.model import DSparkDrafter

__all__ = ["DSparkDrafter"]
