"""Medusa heads: ``model`` (Medusa-1: heads over the frozen target's last hidden state) and ``medusa2`` (Medusa-2: the
heads plus LoRA on the target, trained together)."""

from heads.medusa.medusa2 import Medusa2
from heads.medusa.model import MedusaHeads

__all__ = ["MedusaHeads", "Medusa2"]
