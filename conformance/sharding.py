"""The sharding check: every variable the layout shards is a DTensor with the intended placements.

Asserting the layout that was asked for matters because LayoutMap keys are regexes matched
with re.fullmatch: a key that matches nothing leaves the kernel a plain replicated
Parameter, and training still "works". Only this check notices.
"""

from __future__ import annotations

import re

from conformance.rank_fit import LAYOUTS


def intended(layout: str, path: str, shape: tuple, nproc: int) -> tuple[list[str], tuple] | None:
    """(placements, local shape) the variable at ``path`` should have on a (1, nproc) mesh, or
    None when the layout leaves it alone (a plain tensor is then fine)."""
    for key, axes in LAYOUTS[layout].items():
        if re.fullmatch(key, path):
            placements, local = ["R", "R"], list(shape)
            for dim, axis in enumerate(axes):
                if axis == "model":
                    placements[1] = f"S({dim})"
                    local[dim] = shape[dim] // nproc
            return placements, tuple(local)
    return None


def sharding_problems(layout: str, variables: list[dict], nproc: int) -> list[str]:
    """What differs from the intended layout, one line per variable (empty: all as asked)."""
    problems = []
    for var in variables:
        want = intended(layout, var["path"], tuple(var["shape"]), nproc)
        if want is None:
            continue
        placements, local_shape = want
        if not var["dtensor"]:
            problems.append(f"{var['path']}: a plain {var['type']}, expected a DTensor {placements}")
        elif var["placements"] != placements or tuple(var["local_shape"]) != local_shape:
            problems.append(
                f"{var['path']}: DTensor {var['placements']} local {tuple(var['local_shape'])}, "
                f"expected {placements} local {local_shape}"
            )
    return problems
