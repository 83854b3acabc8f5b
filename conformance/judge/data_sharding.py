"""The per-process data contract of a Keras-sharded cell (``ranks/data_sharding.py``): evidence -> verdict.

Given the GLOBAL dataset and ``auto_shard_dataset=True``, Keras must give each process a distinct
part of every epoch and all of them together the whole; ranks that share a batch coordinate (the
model axis of a 2x2 mesh) form one global batch, so they must receive the same rows in the same
order; a ``(1, n)`` mesh has one batch shard, so every rank receives everything. With
``shuffle=True`` epoch 2 must be ordered otherwise than epoch 1 (and still be a partition).
``predict`` returns on each process the predictions of the rows it fed (the torch trainer's
``_gather_non_batch_axes``: "each process gets every feature of the rows that it fed in"), so
over the batch coordinates every row comes back once.

``evaluate`` returns on every rank the loss over every row the batch shards evaluated (each batch
coordinate's rows once, a padded row as often as it was fed), as one process evaluating them would:
the judge computes it in NumPy from each rank's trained weights (``row_losses``), and a rank that
returns another value (its own shard's loss: the metrics not reduced) is ``numerics``.

A row count the shards do not divide: no row may be dropped. ``DistributedSampler`` (which Keras
puts under a DataLoader) pads with up to ``shards - 1`` repeated rows so every process takes as
many steps (torch documents this; a process with one step fewer leaves its peers waiting in a
collective), so up to that many repeats are accepted; more are not, nor a row no process received.

Plain functions of plain data, so ``tests/test_data_sharding_judge.py`` holds them to bad evidence.
"""

from __future__ import annotations

import re
from collections import Counter

from keras_dtensor_conformance import DATA_NOT_SHARDED, NUMERICS

from conformance.judge.numerics import compare

#: What a build says when it refuses to shard a source itself (``get_data_adapter``'s guard for a
#: multi-process distribution with ``auto_shard_dataset``, written for tf.data on JAX/TF).
REFUSED = re.compile(r"with auto-sharding enabled, the data must be provided as")


def _flat(steps: list[list[int]]) -> list[int]:
    return [row for step in steps for row in step]


def _short(rows, limit: int = 8) -> str:
    rows = sorted(rows)
    return ", ".join(map(str, rows[:limit])) + (f", ... ({len(rows)} rows)" if len(rows) > limit else "")


def partition_problems(phase: str, received: dict[int, list[int]], coords: dict[int, int], samples: int) -> list[str]:
    """What breaks the contract in one phase: ``received`` is rank -> the global rows its steps got,
    in order; ``coords`` rank -> its batch coordinate. Empty when each batch coordinate got a
    distinct part (its ranks alike) and together the whole."""
    problems = []
    unknown = sorted(r for r, rows in received.items() if -1 in rows)
    if unknown:
        return [f"{phase}: ranks {unknown} received rows that are in no global row (data corrupted on the way)"]
    groups: dict[int, list[int]] = {}
    for rank, coord in sorted(coords.items()):
        groups.setdefault(coord, []).append(rank)
    for coord, ranks in groups.items():
        first = received[ranks[0]]
        for other in ranks[1:]:
            theirs = received[other]
            if theirs != first:
                at = next((i for i, (a, b) in enumerate(zip(first, theirs, strict=False)) if a != b),
                          min(len(first), len(theirs)))
                problems.append(f"{phase}: ranks {ranks[0]} and {other} share batch coordinate {coord} (one global "
                                f"batch) but received different rows: {len(first)} vs {len(theirs)} rows, first "
                                f"difference at position {at}")
    if problems:
        return problems
    shards = len(groups)
    parts = {coord: received[ranks[0]] for coord, ranks in groups.items()}
    everything = set(range(samples))
    if shards > 1 and all(set(rows) == everything for rows in parts.values()):
        return [(f"{phase}: Keras did not shard the data: each of the {shards} batch shards received all {samples} "
                 f"rows (auto_shard_dataset=True asks Keras to give each process its own part)")]
    counts = Counter(row for rows in parts.values() for row in rows)
    missing = everything - set(counts)
    if missing:
        problems.append(f"{phase}: rows no process received (silently dropped): {_short(missing)}")
    extra = sum(counts.values()) - len(counts)
    allowed = (-samples) % shards  # DistributedSampler's padding up to a multiple of the shards
    if extra > allowed:
        repeated = [row for row, n in counts.items() if n > 1]
        problems.append(f"{phase}: {extra} rows received more than once over the {shards} batch shards (at most "
                        f"{allowed} repeats pad {samples} rows to a multiple of {shards}): {_short(repeated)}")
    return problems


def data_failure(spec: dict, values: list[dict], coords: dict[int, int]) -> tuple[str, str] | None:
    """(verdict, message) of a Keras-sharded cell's evidence (one dict per rank, in rank order), or None.

    ``spec['shuffles']``: the source is shuffled (fit(shuffle=True) or a RandomSampler), so each
    rank's epoch 2 must be ordered otherwise than its epoch 1."""
    samples = values[0]["samples"]
    problems = []
    epochs = min(len(v["fit"]) for v in values)
    for epoch in range(epochs):
        received = {v["rank"]: _flat(v["fit"][epoch]) for v in values}
        problems += partition_problems(f"fit epoch {epoch + 1}", received, coords, samples)
    steps = {v["rank"]: [len(e) for e in v["fit"]] for v in values}
    if len({tuple(s) for s in steps.values()}) > 1:
        problems.append(f"fit: processes took different numbers of steps per epoch: {steps}")
    if spec.get("shuffles") and not problems:
        same = [v["rank"] for v in values if len(v["fit"]) > 1 and _flat(v["fit"][0]) == _flat(v["fit"][1])]
        if same:
            problems.append(f"fit: shuffle=True but ranks {same} received epoch 2 in epoch 1's order (not reshuffled)")
    problems += partition_problems("evaluate", {v["rank"]: _flat(v["evaluate"]) for v in values}, coords, samples)
    problems += partition_problems("predict (rows fed)", {v["rank"]: _flat(v["predict_fed"]) for v in values},
                                   coords, samples)
    for v in values:
        if sorted(v["predict_returned"]) != sorted(_flat(v["predict_fed"])):
            problems.append(f"predict: rank {v['rank']} returned {len(v['predict_returned'])} predictions, not one for "
                            f"each of the {len(_flat(v['predict_fed']))} rows it fed")
    return (DATA_NOT_SHARDED, "\n".join(problems)) if problems else None


def evaluate_failure(values: list[dict], coords: dict[int, int]) -> tuple[str, str] | None:
    """(``numerics``, message) when a rank's ``evaluate`` returned another loss than the one over every
    row the batch shards evaluated (one rank per batch coordinate), from that rank's trained weights;
    None when all agree. Judged after ``data_failure``: with rows dropped or repeated, that is the bug."""
    fed: dict[int, list[int]] = {}
    for v in values:
        fed.setdefault(coords[v["rank"]], _flat(v["evaluate"]))
    rows = [row for part in fed.values() for row in part]
    problems = []
    for v in values:
        want = sum(v["row_losses"][row] for row in rows) / len(rows)
        problem = compare(f"evaluate: rank {v['rank']} returned loss {v['evaluate_loss']:.6g}", v["evaluate_loss"], want)
        if problem:
            problems.append(f"{problem}; the loss over the {len(rows)} rows the {len(fed)} batch shard(s) evaluated "
                            f"is {want:.6g}")
    return (NUMERICS, "\n".join(problems)) if problems else None


def refused(text: str) -> bool:
    """Whether a rank's failure text is the build refusing to shard the source itself."""
    return bool(REFUSED.search(text))
