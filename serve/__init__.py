"""Serving engines: one export adapter per drafter family (``serve/adapter.py`` is the protocol), the export itself
(``serve/export.py``) and the model card. Above ``heads/``: it reads drafters, nothing below reads it."""
