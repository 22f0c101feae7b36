"""The planner: a simulation twin of the cluster (the real scheduler and placement policy, a fitted or
roofline step-cost model instead of forward passes) that answers how many prefill and decode workers a
workload needs for its SLO. ``pdserve plan`` is deploy/plan/cli.py."""
