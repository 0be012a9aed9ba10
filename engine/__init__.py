"""The hybrid engine: distributed setup, train mode (FSDP2), rollout mode (TP + KV cache), generation, optimizers, csrc op loaders."""
