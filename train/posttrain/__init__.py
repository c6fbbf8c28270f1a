"""On-policy post-training: losses of multi-teacher on-policy distillation and RL."""
