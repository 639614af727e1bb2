"""Measurement and planning, above training: the planner, its calibration, the comm meter."""
