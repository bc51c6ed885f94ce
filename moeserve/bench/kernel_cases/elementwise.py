"""Microbenchmark cases: elementwise kernels."""

from __future__ import annotations


def cases() -> list:
    return []
