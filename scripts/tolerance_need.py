"""Measure what a dtype policy's tolerance must allow, before choosing it (``judge/numerics.TOLERANCES``).

    PYTHONPATH=scripts pytest -p tolerance_need --full -k mixed conformance/test_fit.py
    python scripts/tolerance_need.py tolerance-need.jsonl

As a pytest plugin (``-p tolerance_need``, with ``scripts`` on the path) it keeps each mixed
policy's rtol, sets its atol to 1 (so every cell's comparisons run to the end: the single process's,
then the JAX backend's) and appends to ``$TOLERANCE_NEED_OUT`` (default ``tolerance-need.jsonl``),
for every comparison under a mixed policy, the atol it needs at that rtol:
``max(|got - want| - rtol * |want|)``. Run as a script it prints the largest need per policy, model
and quantity (predict, weights, logged metrics), with the cell and value that set it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re

OUT = os.environ.get("TOLERANCE_NEED_OUT", "tolerance-need.jsonl")
#: The atol that lets every comparison pass, so that each one is measured.
OPEN = 1.0


def _install() -> None:
    import numpy as np

    from conformance.cell_data import POLICIES
    from conformance.judge import numerics

    for policy in POLICIES[1:]:
        numerics.TOLERANCES[policy] = {**numerics.TOLERANCES[policy], "atol": OPEN}
    compare = numerics.compare

    def measured(name, got, want, dtype="float32", tol=None):
        if tol is not None and tol.get("atol") == OPEN:
            g, w = np.asarray(got, "float64"), np.asarray(want, "float64")
            if g.shape == w.shape and g.size:
                with open(OUT, "a") as f:
                    f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1],
                                        "name": name, "rtol": tol["rtol"],
                                        "need_atol": float((np.abs(g - w) - tol["rtol"] * np.abs(w)).max()),
                                        "max_abs": float(np.abs(g - w).max())}) + "\n")
        return compare(name, got, want, dtype, tol)

    numerics.compare = measured


def pytest_configure(config) -> None:
    _install()


def summarise(path: str) -> None:
    worst: dict[tuple, tuple[float, str]] = collections.defaultdict(lambda: (float("-inf"), ""))
    for line in open(path):
        row = json.loads(line)
        cell = re.search(r"\[(mixed_\w+?)-(.*)\]", row["test"])
        if cell is None:
            continue
        policy, rest = cell.groups()
        model = next((m for m in ("lora-sharded", "lora", "attention", "embedding", "batchnorm")
                      if rest.startswith(m + "-")), "mlp")
        kind = "predict" if "predict" in row["name"] else "weights" if "weight" in row["name"] else "metrics"
        key = (policy, model, kind)
        if row["need_atol"] > worst[key][0]:
            worst[key] = (row["need_atol"], f"{rest}: {row['name']}, |d| {row['max_abs']:.3g}")
    for (policy, model, kind), (need, where) in sorted(worst.items()):
        print(f"{policy:15} {model:13} {kind:8} {need:10.3g}  {where}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="?", default=OUT, metavar="FILE.jsonl",
                        help="what the plugin appended (default: %(default)s)")
    summarise(parser.parse_args().records)
