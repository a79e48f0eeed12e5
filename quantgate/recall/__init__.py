"""Long-context recall: needle placement and packed haystacks (pure), pacing (pure), scoring (pure), and the grid run
against a server (the paced client and the run folder)."""
