"""Microbenchmark cases: gemm kernels."""

from __future__ import annotations


def cases() -> list:
    return []
