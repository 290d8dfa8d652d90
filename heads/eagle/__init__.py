"""EAGLE-1 and EAGLE-3 (with the EAGLE-3.1 flags): ``model`` trains and holds the drafter, ``attention`` the explicit
training-time-test attention, ``draft`` the capture-safe static draft step (the whole tree
or chain in one step, at every row of a batch)."""

from heads.eagle.model import EagleDrafter

__all__ = ["EagleDrafter"]
