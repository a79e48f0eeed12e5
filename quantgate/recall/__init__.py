"""Long-context recall: needle placement (pure), scoring (pure) and the grid run against a server."""
