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


def row_layout_params(cells, family: str, row_axis: str) -> list:
    """``pytest.param`` per ``(row, compile, layout)`` cell of a family whose rows are one axis
    (``row_axis``: a metric, an API): id ``ROW-LAYOUT``, or ``ROW-COMPILE-LAYOUT`` when not
    ``nojit``; the ``cell`` mark (row, column ``LAYOUT/COMPILE``, the axes) and the mesh marks."""
    params = []
    for row, compile_mode, layout in cells:
        cell_id = "-".join([row, layout] if compile_mode == "nojit" else [row, compile_mode, layout])
        marks = [pytest.mark.cell(family=family, row=row, column=f"{layout}/{compile_mode}",
                                  **{row_axis: row}, compile=compile_mode, layout=layout), *mesh_marks(layout)]
        params.append(pytest.param((row, compile_mode, layout), id=cell_id, marks=marks))
    return params
