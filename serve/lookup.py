"""Prompt lookup has no weights to export: every engine drafts n-grams itself, so every engine is a refusal."""

from __future__ import annotations


class LookupAdapter:
    kinds = ("lookup",)
    needs_training = False
    refused = {("*", "lookup"): "prompt lookup has no weights: vLLM serves it with --speculative-config "
                                "'{\"method\": \"ngram\", ...}' and SGLang with --speculative-algorithm NGRAM"}

    def supports(self, engine: str, kind: str) -> bool:
        return False
