"""Imports a module of another package (the standard library's ``tabnanny``, which nothing else in a rank
imports): in the zygote it would be imported after the baseline."""

from __future__ import annotations

import os
import tabnanny

assert tabnanny


def pid() -> int:
    return os.getpid()
