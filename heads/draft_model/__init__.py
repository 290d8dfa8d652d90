"""A small standalone draft LM: ``model`` builds, distils and holds it, ``config`` derives its Hugging Face config
from the target's, ``rows`` drafts a batch's rows eagerly, ``draft`` is the capture-safe static draft step."""

from heads.draft_model.model import DraftModel

__all__ = ["DraftModel"]
