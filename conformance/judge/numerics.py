"""The numerics check: a distributed cell's numbers against the single-process reference.

Each rank feeds only its local part of every global batch (``rank_train.batch_part``), while the
reference trains on the global batch. What each quantity is compared with follows from that:

- final weights: the model trained on the global batch, so every rank holds the reference's
  weights, and the ranks hold exactly the same ones;
- step losses, epoch loss, evaluate: a build may report the global value (the nightly all-reduces
  its metrics over the batch axis) or the rank's local one (a DDP loop that does not reduce its
  metrics); see ``reported_problems``;
- predict: Keras returns, per process, the rows that process fed (torch ``_gather_non_batch_axes``:
  gathered along every mesh axis but the batch axis), or all rows where a build gathers the batch
  too; which one is decided by the shape, and compared with the reference's same rows.
"""

from __future__ import annotations

import numpy as np

#: Tolerances for comparing with the single-process reference. Sharded reductions sum in
#: another order (partial sums all-reduced), so float32 results differ in the last bits and
#: the difference grows a little with every optimizer step.
#: Keyed by the cell's dtype policy (``cell_data.POLICIES``). Under a mixed policy the layers
#: compute in 16 bits: a sum in another order rounds to a neighbouring 16-bit value, a relative 2**-8
#: (bfloat16) or 2**-11 (float16) apart, and the float32 weights carry the difference on. rtol: two
#: units in the last place of an output near 1; atol: 1.5 to 2 times the largest need measured at
#: that rtol over the --full tier's mixed cells (``scripts/tolerance_need.py``; docs/measurements.md,
#: "Mixed precision"), below a lost update (a weight one optimizer step away, and the predictions with it).
TOLERANCES = {"float32": {"rtol": 1e-4, "atol": 1e-5},
              "mixed_bfloat16": {"rtol": 2 ** -6, "atol": 2 ** -6},
              "mixed_float16": {"rtol": 2 ** -9, "atol": 2 ** -8}}

#: Values a rank reports as metrics: global (all-reduced) or the mean over its local batch.
REPORTED = ("step_losses", "epoch_loss", "evaluate")


def compare(name: str, got, want, dtype: str = "float32", tol: dict | None = None) -> str | None:
    """None if ``got`` matches ``want`` within the dtype's tolerance (or ``tol``), else what differs."""
    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, reference {want.shape}"
    tol = tol or TOLERANCES[dtype]
    if np.allclose(got, want, **tol):
        return None
    worst = np.abs(got - want).max()
    return f"{name}: max abs difference {worst:.3g} from the reference (rtol {tol['rtol']}, atol {tol['atol']})"


def batch_groups(values: list[dict]) -> dict[int, list[int]]:
    """Batch-shard index -> the ranks that fed those rows (same ``batch_part`` index)."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value["batch_part"][0], []).append(rank)
    return groups


def reported_problems(key: str, values: list[dict], want, tol: dict | None = None) -> list[str]:
    """A reported metric (losses, evaluate) against the reference's global value.

    Accepted: every rank reports the global value; or every rank reports its local value, ranks
    that fed the same rows agree, and the mean over batch shards equals the global value. The
    second is exact arithmetic, not a loosened tolerance: each shard's local value is a mean over
    an equal number of rows (``rank_train.BATCH`` divides evenly; Keras' loss reduction divides by
    the batch size even with sample weights), and the running mean over steps is linear, so the
    mean over shards of the local means is the global mean. Anything else (a rank reporting a
    value that is neither, shards that do not average to the global) is a problem.
    """
    global_problems = [p for r, v in enumerate(values) if (p := compare(f"rank {r}: {key}", v[key], want, tol=tol))]
    if not global_problems:
        return []
    groups = batch_groups(values)
    problems = []
    for index, ranks in groups.items():
        first = values[ranks[0]][key]
        problems += [f"ranks {ranks[0]} and {r} fed the same rows but report different {key}"
                     for r in ranks[1:] if compare(key, values[r][key], first)]
    shard_mean = np.mean([np.asarray(values[ranks[0]][key], dtype="float64") for ranks in groups.values()], axis=0)
    problem = compare(f"{key} (mean over {len(groups)} batch shard(s))", shard_mean, want, tol=tol)
    if problems or problem:
        return global_problems + problems + ([problem] if problem else [])
    return []


def predict_problems(rank: int, value: dict, want: np.ndarray, tol: dict | None = None) -> list[str]:
    """A rank's predictions against the reference's rows it fed, or all rows if it returned all."""
    got, rows = np.asarray(value["predict"]), np.asarray(value["rows"])
    expected = want if got.shape[:1] == want.shape[:1] else want[rows]
    problem = compare("predict", got, expected, tol=tol)
    return [f"rank {rank}: {problem}"] if problem else []


def weight_problems(rank: int, value: dict, reference: dict, tol: dict | None = None) -> list[str]:
    """A rank's final (global) weights against the reference's."""
    problems = []
    for path, weight in reference["weights"].items():
        if path not in value["weights"]:
            problems.append(f"rank {rank}: weight {path} missing")
            continue
        problem = compare(f"weight {path}", value["weights"][path], weight, tol=tol)
        if problem:
            problems.append(f"rank {rank}: {problem}")
    return problems


def ranks_agree(values: list[dict]) -> list[str]:
    """Every rank holds exactly rank 0's weights (replicas that drifted apart are a bug)."""
    first = values[0]
    return [f"ranks 0 and {rank} disagree on weight {path}"
            for rank, value in enumerate(values[1:], start=1)
            for path, weight in first["weights"].items()
            if not np.array_equal(value["weights"].get(path), weight)]


def numerics_problems(values: list[dict], reference: dict, tol: dict | None = None) -> list[str]:
    """Every rank against the single-process reference, and the ranks against each other.
    ``tol``: another reference's tolerance (the JAX backend's, ``jax_compare.TOLERANCES``)."""
    problems = []
    for key in REPORTED:
        problems += reported_problems(key, values, reference[key], tol)
    for rank, value in enumerate(values):
        problems += predict_problems(rank, value, np.asarray(reference["predict"]), tol)
        problems += weight_problems(rank, value, reference, tol)
    return problems + ranks_agree(values)
