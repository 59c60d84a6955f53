"""Stable LatentMoE pieces: router with correction bias, expert compute."""

from openk3.ops.moe.reference import experts_reference, route

__all__ = ["route", "experts_reference"]
