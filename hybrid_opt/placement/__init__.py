"""Placement and planning: which tier holds each subgroup and moving state between tiers
(placement.py: the optimizer's Placement part), the plan (plan.py), the bytes a plan allocates
(footprint.py), moves (moves.py), the cost model, the "auto" scheduler, calibration and
`hybrid-opt plan` (cost_model.py, scheduler.py, calibrate.py, plan_report.py).

The face imports nothing, so that the cost model and the planner's report load without the
tiers: import each name from its module (`hybrid_opt.placement.placement.Placement`)."""
