"""P-EAGLE, EAGLE-3 drafting a whole chain in one forward: ``model`` trains and holds it, ``draft`` is the
capture-safe static draft step."""

from heads.peagle.model import PEagleDrafter

__all__ = ["PEagleDrafter"]
