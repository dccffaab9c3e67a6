"""The planner: every few seconds, from what the router measures, the role mix of the nodes, the
short-prompt threshold and the pool sizes (docs/placement.md, "The planner"). Pure decisions
(config, signals, model, decide) apart from their running (loop)."""
