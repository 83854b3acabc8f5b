"""The numerics check: a distributed cell's numbers against the single-process reference.

Each rank feeds only its local part of every global batch (``cell_data.batch_part``), while the
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

#: The update-scale check (``scale_problems``): the median, over every element of every weight, of
#: the rank's update (final weight minus initial) over the reference's must be 1 within this, per dtype
#: policy. An update factor that is off (a learning rate 1 % wrong, an update lost or applied twice)
#: moves every element's ratio alike, while 16-bit rounding moves each element its own way and the
#: median does not follow it: so the ratio sees a 1 % error that the element-wise tolerance, sized for
#: one element's rounding, lets through under a mixed policy. A median, not a least-squares factor:
#: Adam's update of an element whose gradient is near 0 is about +-lr whatever the gradient's size, so
#: rounding can flip its sign, a whole update of that element, and a least-squares factor is pulled
#: towards 0 by every flip (1.6 % on a correct build, measured); the median ignores them while they
#: are a minority. Sized from the largest ``|ratio - 1|`` measured on correct builds
#: (``scripts/update_scale.py``; docs/measurements.md, "The update-scale check").
SCALE_TOLERANCE = {"float32": 1e-3, "mixed_bfloat16": 4e-3, "mixed_float16": 4e-3}

#: At most this many differing values listed in one message (the first ones are the cause).
SHOWN = 8

#: Values a rank reports as metrics: global (all-reduced) or the mean over its local batch.
REPORTED = ("step_losses", "epoch_loss", "evaluate")


#: Under a mixed policy, the fraction of a weight's (or the predictions') elements that may lie beyond
#: the element-wise tolerance, each within ``OUTLIER_BOUND`` times it. Adam's update of an element
#: whose gradient is near 0 is about +-lr whatever the gradient's size, and 16-bit rounding can turn
#: its sign: a whole step on that element, and on the predictions that read it (measured with
#: ``--conformance-seed 2``: ``mixed_bfloat16-adam-arrays-nojit-rowshard``, 3 of 212 weight elements
#: 1.8 times the tolerance, one of them in a 16-element bias, 9 of 384 predictions; docs/measurements.md,
#: "The update-scale check"). At least one element per tensor is allowed, so a small bias is not held
#: to a fraction it cannot have.
#: What a mixed cell is there to catch acts on whole tensors (a cast, a loss scale, a lost write, an
#: update factor: ``scale_problems`` and the rest of each tensor); a bug of a few elements shows in
#: the cell's float32 twin, which allows none.
OUTLIERS = {"float32": 0.0, "mixed_bfloat16": 0.05, "mixed_float16": 0.05}
OUTLIER_BOUND = 4


def compare(name: str, got, want, dtype: str = "float32", tol: dict | None = None,
            outliers: float = 0.0) -> str | None:
    """None if ``got`` matches ``want`` within the dtype's tolerance (or ``tol``), but for at most the
    fraction ``outliers`` of their elements (at least one, where ``outliers`` allows any), each finite
    and within ``OUTLIER_BOUND`` times the tolerance; else what differs. A whole tensor off (a lost
    write, a cast, a scale) is off in every element, so more than one in any tensor of two or more."""
    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, reference {want.shape}"
    tol = tol or TOLERANCES[dtype]
    far = ~np.isclose(got, want, **tol)
    if not far.any():
        return None
    difference, allowed = np.abs(got - want), tol["atol"] + tol["rtol"] * np.abs(want)
    # At least one element per tensor where any are allowed: a 16-element bias has no 5 % of itself.
    allowed_count = max(1, int(outliers * far.size)) if outliers else 0
    if (far.sum() <= allowed_count and np.isfinite(got).all()
            and (difference[far] <= OUTLIER_BOUND * allowed[far]).all()):
        return None
    return (f"{name}: max abs difference {difference.max():.3g} from the reference (rtol {tol['rtol']}, "
            f"atol {tol['atol']}; {int(far.sum())} of {far.size} element(s) beyond it"
            + (f", {allowed_count} allowed within {OUTLIER_BOUND}x" if outliers else "") + ")")


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
    an equal number of rows (``cell_data.BATCH`` divides evenly; Keras' loss reduction divides by
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


def predict_problems(rank: int, value: dict, want: np.ndarray, tol: dict | None = None,
                     outliers: float = 0.0) -> list[str]:
    """A rank's predictions against the reference's rows it fed, or all rows if it returned all."""
    got, rows = np.asarray(value["predict"]), np.asarray(value["rows"])
    expected = want if got.shape[:1] == want.shape[:1] else want[rows]
    problem = compare("predict", got, expected, tol=tol, outliers=outliers)
    return [f"rank {rank}: {problem}"] if problem else []


def weight_problems(rank: int, value: dict, reference: dict, tol: dict | None = None,
                    outliers: float = 0.0) -> list[str]:
    """A rank's final (global) weights against the reference's."""
    problems = []
    for path, weight in reference["weights"].items():
        if path not in value["weights"]:
            problems.append(f"rank {rank}: weight {path} missing")
            continue
        problem = compare(f"weight {path}", value["weights"][path], weight, tol=tol, outliers=outliers)
        if problem:
            problems.append(f"rank {rank}: {problem}")
    return problems


def update_scale(value: dict, reference: dict) -> float | None:
    """The median over every weight element of ``got / want``, the rank's and the reference's updates
    (final weights minus the initial ones each started from: the reference's own where it reports
    them, else the rank's), where the reference's element moved. None where no element moved or a
    weight is missing or misshapen (``weight_problems`` says so)."""
    got, want = [], []
    starts = reference.get("initial_weights", value["initial_weights"])
    for path, weight in reference["weights"].items():
        start = starts.get(path)
        mine, own_start = value["weights"].get(path), value["initial_weights"].get(path)
        if start is None or mine is None or own_start is None:
            return None
        g = np.asarray(mine, dtype="float64") - np.asarray(own_start, dtype="float64")
        w = np.asarray(weight, dtype="float64") - np.asarray(start, dtype="float64")
        if g.shape != w.shape:
            return None
        got.append(g.ravel())
        want.append(w.ravel())
    if not want:
        return None
    got, want = np.concatenate(got), np.concatenate(want)
    moved = (want != 0) & np.isfinite(want) & np.isfinite(got)
    return float(np.median(got[moved] / want[moved])) if moved.any() else None


def scale_problems(rank: int, value: dict, reference: dict, policy: str) -> list[str]:
    """The rank's update is the reference's scaled by 1 within ``SCALE_TOLERANCE[policy]``."""
    if "initial_weights" not in value:
        return []
    scale = update_scale(value, reference)
    bound = SCALE_TOLERANCE[policy]
    if scale is None or abs(scale - 1) <= bound:
        return []
    return [(f"rank {rank}: the update (final weights minus initial) is {scale:.5g} times the reference's "
             f"(median over every weight element; allowed 1 +- {bound:g} under {policy}): an update factor is off")]


def ranks_agree(values: list[dict]) -> list[str]:
    """Every rank holds exactly rank 0's weights (replicas that drifted apart are a bug)."""
    first = values[0]
    return [f"ranks 0 and {rank} disagree on weight {path}"
            for rank, value in enumerate(values[1:], start=1)
            for path, weight in first["weights"].items()
            if not np.array_equal(value["weights"].get(path), weight)]


def same_rows_problems(values: list[dict]) -> list[str]:
    """Ranks that fed the same rows report the same losses, evaluate and predictions, and every rank
    holds rank 0's weights: what a model with dropout can be held to, where no single process draws
    the ranks' masks. A mask drawn once for a tensor every rank holds whole, or its slice on each rank
    of a sharded one, gives ranks of one batch shard the same numbers; a mask each rank draws for its
    own copy does not. Ranks of different batch shards draw for different rows: only their weights,
    synchronised, must agree."""
    problems = []
    for ranks in batch_groups(values).values():
        first = values[ranks[0]]
        for rank in ranks[1:]:
            for key in (*REPORTED, "predict"):
                if problem := compare(key, values[rank][key], first[key]):
                    problems.append(f"ranks {ranks[0]} and {rank} fed the same rows: {problem.replace('reference', f'rank {ranks[0]}')}")
    return problems + ranks_agree(values)


def numerics_problems(values: list[dict], reference: dict, tol: dict | None = None,
                      policy: str = "float32") -> list[str]:
    """Every rank against the single-process reference (element-wise, and its update's scale), and the
    ranks against each other. ``tol``: another reference's tolerance (the JAX backend's,
    ``jax_compare.tolerance``) in place of ``policy``'s."""
    tol = tol or TOLERANCES[policy]
    problems = []
    for key in REPORTED:
        problems += reported_problems(key, values, reference[key], tol)
    for rank, value in enumerate(values):
        problems += predict_problems(rank, value, np.asarray(reference["predict"]), tol, OUTLIERS[policy])
        problems += weight_problems(rank, value, reference, tol, OUTLIERS[policy])
        problems += scale_problems(rank, value, reference, policy)
    return problems + ranks_agree(values)


def listed(head: str, problems: list[str]) -> str:
    """``head:`` and the first ``SHOWN`` problems, a line each, then how many more."""
    shown = problems[:SHOWN]
    more = f"\n... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return head + ":\n" + "\n".join(shown) + more
