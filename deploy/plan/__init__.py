"""``pdserve plan``: the capacity planner's command (plan, calibrate, validate, spread) over the simulation
twin in ``deploy/planner/``; calibration and validation run a real cluster through ``deploy.launch``."""
