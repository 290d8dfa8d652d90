"""EAGLE-1 and EAGLE-3 (with the EAGLE-3.1 flags): ``model`` trains and holds the drafter, ``attention`` the explicit
training-time-test attention, ``rows`` the eager drafting of a batch's rows and of one context, ``draft`` the
capture-safe static draft step."""

from heads.eagle.model import EagleDrafter

__all__ = ["EagleDrafter"]
