"""The field's attribution methods, as analyses on the Collector contract (``docs/definitions.md``).

Modules: :mod:`~.rollout` (attention rollout, Abnar and Zuidema 2020: a layer-level score, the share of each
input token in the residual a layer reads).
"""

from __future__ import annotations

from mechgeom.analyses.attribution.rollout import (
    RolloutCollector,
    RolloutResult,
    attention_rollout,
    rollout_step,
)

__all__ = [
    "RolloutCollector",
    "RolloutResult",
    "attention_rollout",
    "rollout_step",
]
