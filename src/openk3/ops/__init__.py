"""Operator implementations (reference PyTorch code and accelerated paths)."""
