"""EAGLE's variants and the settings that must agree: EAGLE-1 or EAGLE-3, the tree modes, the default feature
layers, and the EAGLE-3.1 flags with the draft attention window.
"""

from __future__ import annotations


VARIANTS = ("eagle1", "eagle3")
TREE_MODES = ("dynamic", "chain")


def default_feature_layers(variant: str, num_layers: int) -> tuple[int, ...]:
    """EAGLE-1: the final normed output. EAGLE-3: (2, L//2, L-3) as in the EAGLE-3 reference and vLLM / SGLang for
    deep targets (the high layer sits at ~90% of the depth); a shallow target (L < 8, e.g. the toy) gets (1, L//2, L):
    there one layer is a quarter of the model, and L-1 left the highest feature a whole layer short (measured on the
    toy target: top-1 accuracy 0.41 with (1, 2, 3) vs 0.47 with (1, 2, 4) after 160 equal steps)."""
    if variant == "eagle1":
        return (-1,)
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (1, max(1, num_layers // 2), num_layers)


def check_eagle31(variant: str, fc_norm: bool, norm_before_fc: bool, norm_output: bool,
                  sliding_window: int | None) -> None:
    """The EAGLE-3.1 flags and the sliding window: EAGLE-3's (and P-EAGLE's), ``fc_norm`` or ``norm_before_fc``."""
    if fc_norm and norm_before_fc:
        raise ValueError("drafter.fc_norm=true and drafter.norm_before_fc=true: they are two ways to normalise fc's "
                         "input (one RMSNorm per feature layer, or one over their concatenation) and engines refuse "
                         "both at once; set one of them to false")
    on = [k for k, v in (("fc_norm", fc_norm), ("norm_before_fc", norm_before_fc), ("norm_output", norm_output),
                         ("sliding_window", sliding_window is not None)) if v]
    if variant != "eagle3" and on:
        raise ValueError(f"drafter.{on[0]} is an EAGLE-3 setting (EAGLE-3.1's norms, the draft attention window); "
                         f"drafter.variant={variant!r} has no fc over target layers nor own norm: use variant=eagle3 "
                         f"or unset it")
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"drafter.sliding_window={sliding_window!r} must be an integer >= 1 (the context positions a "
                         f"draft query sees) or null for all of them")
