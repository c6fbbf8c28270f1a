"""The K3 architecture: pure PyTorch, single-device semantics (see README and SPEC)."""
