"""The K3 architecture: pure PyTorch, single-device semantics (docs/model.md)."""
