"""Training: balanced execution of the model, the per-worker loop, the Ray Train wiring."""
