"""Training: DeepSpeed engine, LR schedule, checkpoints, signals, logging, the loop."""
