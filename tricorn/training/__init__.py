"""Training: the loop, batch schedule, LR schedule, checkpoints and logging."""
