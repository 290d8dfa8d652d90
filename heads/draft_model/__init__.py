"""A small standalone draft LM: ``model`` builds, distils and holds it, ``config`` derives its Hugging Face config
from the target's, ``draft`` is the capture-safe static draft step (a sliding-window draft model drafts through
its eager ``propose``)."""

from heads.draft_model.model import DraftModel

__all__ = ["DraftModel"]
