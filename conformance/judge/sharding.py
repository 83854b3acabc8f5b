"""The sharding check: every variable the layout shards is a DTensor with the intended placements.

Asserting the layout that was asked for matters because LayoutMap keys are regexes matched
with re.fullmatch: a key that matches nothing leaves the kernel a plain replicated
Parameter, and training still "works". Only this check notices. Optimizer slots and EMA
copies are held to the layout of the variable they shadow.

Local shapes follow torch's own chunking rule (``Shard._split_tensor``, ``torch.chunk``): a
dimension of n over k shards gives ceil(n / k) rows to each shard in mesh order until n runs out,
so the last shards may be smaller or empty (16 over 3: 6, 6, 4; 5 over 4: 2, 2, 1, 0). An uneven
split is therefore DTensor's, not the build's, and the expected local shape depends on the rank.
"""

from __future__ import annotations

import re

from conformance.cell_data import mesh_axes, mesh_coordinate, mesh_shape, shard_size


def intended(layout: dict, path: str, shape: tuple, nproc: int, rank: int = 0) -> tuple[list[str], tuple] | None:
    """(placements, local shape on ``rank``) the variable at ``path`` should have, or None when
    the layout leaves it alone (then a plain tensor is fine). The local shape is rank 0's unless
    ``rank`` is given: with an uneven split the last ranks hold less (see the module docstring)."""
    mesh = mesh_shape(layout, nproc)
    where = mesh_coordinate(rank, mesh)
    for key, axes in layout.get("map", {}).items():
        if re.fullmatch(key, path):
            placements, local = ["R"] * len(mesh), list(shape)
            for dim, axis in enumerate(axes):
                if axis is not None:
                    mesh_dim = mesh_axes(layout).index(axis)
                    placements[mesh_dim] = f"S({dim})"
                    local[dim] = shard_size(shape[dim], mesh[mesh_dim], where[mesh_dim])
            return placements, tuple(local)
    return None


def laid_out(layout: dict, variables: list[dict], nproc: int) -> list[str]:
    """The paths of ``variables`` (slots: of their variable) that the layout map lays out: what
    ``sharding_problems`` can hold to a layout (none: it cannot fail)."""
    return [var["path"] for var in variables
            if intended(layout, var.get("reference", var["path"]), tuple(var["shape"]), nproc) is not None]


def sharding_problems(layout: dict, variables: list[dict], nproc: int, what: str = "",
                      rank: int | None = None) -> list[str]:
    """What differs from the intended layout, one line per variable (empty: all as asked).

    ``variables`` are ``describe_variable`` dicts from ``rank``; a slot carries ``reference``, the
    path of the model variable whose layout it must share. Without ``rank`` (a caller that does
    not say which rank the variables come from), the local shape of any rank is accepted.
    """
    problems = []
    ranks = range(nproc) if rank is None else [rank]
    for var in variables:
        path = var.get("reference", var["path"])
        wants = [intended(layout, path, tuple(var["shape"]), nproc, r) for r in ranks]
        if wants[0] is None:
            continue
        placements = wants[0][0]
        local_shapes = list(dict.fromkeys(local for _, local in wants))
        name = f"{what}{var['path']}"
        if not var["dtensor"]:
            problems.append(f"{name}: a plain {var['type']}, expected a DTensor {placements}")
        elif var["placements"] != placements or tuple(var["local_shape"]) not in local_shapes:
            expected = " or ".join(str(s) for s in local_shapes)
            problems.append(
                f"{name}: DTensor {var['placements']} local {tuple(var['local_shape'])}, "
                f"expected {placements} local {expected}"
            )
    return problems


def whole_problems(layout: dict, variables: list[dict], nproc: int, what: str = "") -> list[str]:
    """The variables (slots: of their variable) ``layout``'s map names no layout for are whole on this rank:
    a plain tensor, or a DTensor replicated on every mesh axis with the whole shape. Keras replicates a
    variable no key names; one sharded all the same (a default layout of the build's) holds a part of a
    tensor every rank computes with whole, and a map that shards some variables promises the rest."""
    problems = []
    for var in variables:
        path = var.get("reference", var["path"])
        if var.get("factor") is not None or not var["dtensor"]:
            continue
        if intended(layout, path, tuple(var["shape"]), nproc) is not None:
            continue
        if any(p != "R" for p in var["placements"]) or tuple(var["local_shape"]) != tuple(var["shape"]):
            problems.append(f"{what}{var['path']}: DTensor {var['placements']} local {tuple(var['local_shape'])}, "
                            "expected whole (the layout map names no layout for it)")
    return problems
