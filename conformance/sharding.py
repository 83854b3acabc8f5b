"""The sharding check: every variable the layout shards is a DTensor with the intended placements.

Asserting the layout that was asked for matters because LayoutMap keys are regexes matched
with re.fullmatch: a key that matches nothing leaves the kernel a plain replicated
Parameter, and training still "works". Only this check notices. Optimizer slots and EMA
copies are held to the layout of the variable they shadow.
"""

from __future__ import annotations

import re

MESH_AXES = ("batch", "model")


def mesh_shape(layout: dict, nproc: int) -> tuple[int, ...]:
    """The (batch, model) mesh of a layout; "nproc" stands for the number of ranks."""
    return tuple(nproc if d == "nproc" else d for d in layout.get("mesh", (1, "nproc")))


def intended(layout: dict, path: str, shape: tuple, nproc: int) -> tuple[list[str], tuple] | None:
    """(placements, local shape) the variable at ``path`` should have, or None when the layout
    leaves it alone (then a plain tensor is fine)."""
    mesh = mesh_shape(layout, nproc)
    for key, axes in layout.get("map", {}).items():
        if re.fullmatch(key, path):
            placements, local = ["R"] * len(mesh), list(shape)
            for dim, axis in enumerate(axes):
                if axis is not None:
                    mesh_dim = MESH_AXES.index(axis)
                    placements[mesh_dim] = f"S({dim})"
                    local[dim] = shape[dim] // mesh[mesh_dim]
            return placements, tuple(local)
    return None


def sharding_problems(layout: dict, variables: list[dict], nproc: int, what: str = "") -> list[str]:
    """What differs from the intended layout, one line per variable (empty: all as asked).

    ``variables`` are ``describe_variable`` dicts; a slot carries ``reference``, the path of the
    model variable whose layout it must share.
    """
    problems = []
    for var in variables:
        path = var.get("reference", var["path"])
        want = intended(layout, path, tuple(var["shape"]), nproc)
        if want is None:
            continue
        placements, local_shape = want
        name = f"{what}{var['path']}"
        if not var["dtensor"]:
            problems.append(f"{name}: a plain {var['type']}, expected a DTensor {placements}")
        elif var["placements"] != placements or tuple(var["local_shape"]) != local_shape:
            problems.append(
                f"{name}: DTensor {var['placements']} local {tuple(var['local_shape'])}, "
                f"expected {placements} local {local_shape}"
            )
    return problems
