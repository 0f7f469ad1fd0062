"""Placement and planning: which tier holds each subgroup and moving state between tiers
(placement.py: the optimizer's Placement part), the plan (plan.py), the bytes a plan allocates
(footprint.py), moves (moves.py), the cost model, the "auto" scheduler, calibration and
`hybrid-opt plan` (cost_model.py, scheduler.py, calibrate.py, planner.py)."""

from hybrid_opt.placement.placement import (
    Extension,
    Fixed,
    Placement,
    PlacementConfig,
    TierEvents,
    restated,
)

__all__ = ["Extension", "Fixed", "Placement", "PlacementConfig", "TierEvents", "restated"]
