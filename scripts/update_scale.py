"""Measure the update-scale check's noise on a build, before sizing ``numerics.SCALE_TOLERANCE``.

    PYTHONPATH=scripts pytest -p update_scale conformance/test_fit.py -k mixed --conformance-seed 3
    python scripts/update_scale.py update-scale.jsonl

As a pytest plugin (``-p update_scale``, with ``scripts`` on the path) it appends to
``$UPDATE_SCALE_OUT`` (default ``update-scale.jsonl``), for every rank of every training cell and
each reference it is compared with (the single process's, the JAX backend's), the least-squares
factor ``s`` of ``numerics.update_scale``. Run as a script it prints, per dtype policy and
reference, the count and the largest ``|s - 1|`` with the cell that set it, and how many exceed the
tolerance. On a correct build every ``|s - 1|`` is noise: the largest is what the tolerance must
stay above; a build whose update factor is off by e moves ``s`` by about e.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

OUT = os.environ.get("UPDATE_SCALE_OUT", "update-scale.jsonl")


def pytest_configure(config) -> None:
    from conformance.judge import numerics

    checked = numerics.scale_problems

    def measured(rank, value, reference, policy):
        if "initial_weights" in value:
            scale = numerics.update_scale(value, reference)
            with open(OUT, "a") as f:
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0],
                                    "rank": rank, "policy": policy, "scale": scale,
                                    "seed": config.getoption("conformance_seed"),
                                    "reference": "jax" if "jax_version" in reference else "single-process"}) + "\n")
        return checked(rank, value, reference, policy)

    numerics.scale_problems = measured


def summarise(path: str) -> None:
    from conformance.judge.numerics import SCALE_TOLERANCE

    worst: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0, "", 0])
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        if row["scale"] is None:
            continue
        entry = worst[(row["policy"], row["reference"])]
        off = abs(row["scale"] - 1)
        entry[0] += 1
        entry[3] += off > SCALE_TOLERANCE[row["policy"]]
        if off > entry[1]:
            entry[1], entry[2] = off, f"{row['test']} seed {row['seed']} rank {row['rank']}"
    for (policy, reference), (count, off, where, over) in sorted(worst.items()):
        print(f"{policy:15} {reference:15} {count:5} comparisons  max |s-1| {off:.2e}  over tolerance "
              f"{SCALE_TOLERANCE[policy]:g}: {over}  ({where})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", nargs="?", default=OUT, metavar="FILE.jsonl",
                        help="what the plugin appended (default: %(default)s)")
    summarise(parser.parse_args().records)
