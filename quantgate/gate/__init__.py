"""The promotion gate: the policy (data), the evidence collected from a run folder, and the checks (pure)."""
