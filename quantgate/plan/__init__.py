"""The parallel layout: the planner (pure), its typed inputs and outputs, per-node commands, and a plan built from files."""
