"""Training heads of our own (issue 21): self-instruct data, and later hidden-state caches and training."""
