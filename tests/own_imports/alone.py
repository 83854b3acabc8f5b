"""Imports nothing at all: the pool's zygote may import it for the ranks after."""

from __future__ import annotations

import os


def pid() -> int:
    return os.getpid()
