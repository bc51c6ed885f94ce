"""Microbenchmark cases: mla kernels."""

from __future__ import annotations


def cases() -> list:
    return []
