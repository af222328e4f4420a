"""One module per training objective, each ending in its spec."""
