"""The numerics check: a distributed cell's numbers against the single-process reference."""

from __future__ import annotations

import numpy as np


#: Tolerances for comparing with the single-process reference. Sharded reductions sum in
#: another order (partial sums all-reduced), so float32 results differ in the last bits and
#: the difference grows a little with every optimizer step.
TOLERANCES = {"float32": {"rtol": 1e-4, "atol": 1e-5}}


def compare(name: str, got, want, dtype: str = "float32") -> str | None:
    """None if ``got`` matches ``want`` within the dtype's tolerance, else what differs."""
    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, reference {want.shape}"
    tol = TOLERANCES[dtype]
    if np.allclose(got, want, **tol):
        return None
    worst = np.abs(got - want).max()
    return f"{name}: max abs difference {worst:.3g} from the reference (rtol {tol['rtol']}, atol {tol['atol']})"


def numerics_problems(values: list[dict], reference: dict) -> list[str]:
    """Every rank against the single-process reference, and the ranks against each other."""
    problems = []
    for rank, value in enumerate(values):
        where = f"rank {rank}: "
        for key in ("step_losses", "epoch_loss", "evaluate", "predict"):
            problem = compare(key, value[key], reference[key])
            if problem:
                problems.append(where + problem)
        for path, weight in reference["weights"].items():
            if path not in value["weights"]:
                problems.append(f"{where}weight {path} missing")
                continue
            problem = compare(f"weight {path}", value["weights"][path], weight)
            if problem:
                problems.append(where + problem)
    first = values[0]
    for rank, value in enumerate(values[1:], start=1):
        for path, weight in first["weights"].items():
            if not np.array_equal(value["weights"].get(path), weight):
                problems.append(f"ranks 0 and {rank} disagree on weight {path}")
    return problems
