"""Marks the cell modules' parametrizations share."""

from __future__ import annotations

import pytest

from conformance import axes


def mesh_marks(layout: str) -> list:
    """``mesh(...)`` for a layout whose mesh has a fixed shape (``batchxmodel``'s 2x2 needs
    ``--nproc 4``, and the plugin skips it with the reason otherwise); none for a mesh that
    ``--nproc`` sizes."""
    mesh = axes.LAYOUTS[layout].get("mesh", ("nproc",))
    return [] if "nproc" in mesh else [pytest.mark.mesh(*mesh)]
