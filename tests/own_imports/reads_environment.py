"""Reads a variable as it is imported: each rank might read another value (``RANK``)."""

from __future__ import annotations

import os

SEEN = os.environ.get("KDC_TEST_OWN_IMPORT")


def pid() -> int:
    return os.getpid()
