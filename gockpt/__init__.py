"""gockpt: gradient-assisted multi-step overlapped checkpointing."""
