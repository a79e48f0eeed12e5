"""Token-level fidelity: how far a candidate's next-token distributions are from the baseline's, teacher-forced
through the served endpoints (KL from top-k logprobs, top-1 agreement, NLL difference; pure core + scoring run)."""
