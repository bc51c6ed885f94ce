"""The secret a disaggregated deployment shares: every prefill and decode server reads the same
file (``--disaggregation-secret-file``), from which the side channels' CURVE keys and the bootstrap
registration token derive. On one machine the default file is made on first use."""

from __future__ import annotations

import os
import time

SECRET_BYTES = 32


def ensure_secret(path: str) -> None:
    """Make the deployment's secret at ``path`` (mode 0600) unless it exists."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(SECRET_BYTES))


def read_secret(path: str, wait_s: float = 5.0) -> bytes:
    """The secret at ``path`` (another server may be writing it this very moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        with open(path, "rb") as f:
            secret = f.read().strip()
        if len(secret) >= 16 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if len(secret) < 16:
        raise ValueError(f"disaggregation_secret_file {path!r} holds {len(secret)} bytes; at least 16 are needed")
    return secret
