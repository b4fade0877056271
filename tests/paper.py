"""The paper's control law as config defaults, for tests about the paper's levers.

The library's defaults are the evidence precision law, the noise batch law and no curvature
(docs/results.md says why); tests of the paper's variance thresholds, memory-driven batch and
curvature LR scaling build their configs with `paper_config`.
"""

from triaccel import TriAccelConfig

PAPER = {"precision_law": "variance", "batch_law": "memory", "curvature": "fisher"}


def paper_config(**kw) -> TriAccelConfig:
    """TriAccelConfig with the paper's laws unless `kw` says otherwise."""
    return TriAccelConfig(**{**PAPER, **kw})
