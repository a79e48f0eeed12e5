"""Adapters around the vLLM serving environment: launcher, environment lookup, server process manager."""
