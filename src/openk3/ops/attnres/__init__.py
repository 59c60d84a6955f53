"""Block Attention Residuals (SPEC.md §3)."""

from openk3.ops.attnres.reference import attnres_read

__all__ = ["attnres_read"]
