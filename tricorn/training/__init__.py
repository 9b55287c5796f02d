"""Training: the loop, main (build and run), LR schedule, logging, signals, and the memory/activation probes."""
