"""Training loops: a sequence of checkpoints, one per step (see issue 4)."""
