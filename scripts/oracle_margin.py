"""How far a build's float32 training is from the NumPy oracle's float64, against ``oracle.TOLERANCE``.

For every cell of the oracle's core set on one process (each optimizer with a rule, arrays and a
DataLoader, eager, nojit and spe4: ``jit`` is nojit in a single process), the run the judge compares
with the oracle (``rank_train.train(reference_spec(spec), False)``, as ``oracle.reference_problems``
does), and per quantity the worst absolute difference and the worst share of the tolerance used:
max |got - want| / (atol + rtol |want|), which ``np.allclose`` passes at 1 or less. The distributed
ranks' final weights, which the oracle judges too, are held to this run by the reference comparison.

    KERAS_BACKEND=torch PYTHONPATH=KERAS_TREE python scripts/oracle_margin.py
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def share(got, want, tolerance: dict) -> tuple[float, float]:
    """(max abs difference, max share of the tolerance used) of ``got`` against ``want``."""
    got, want = np.asarray(got, dtype="float64"), np.asarray(want, dtype="float64")
    difference = np.abs(got - want)
    return float(difference.max()), float((difference / (tolerance["atol"] + tolerance["rtol"] * np.abs(want))).max())


def main() -> None:
    import keras

    from conformance import axes
    from conformance.judge import oracle
    from conformance.judge.fit_checks import reference_spec
    from conformance.ranks import train as rank_train

    worst: dict[str, tuple[float, float, str]] = {}
    core = [name for name, entry in axes.OPTIMIZERS.items() if entry.oracle is not None]
    for optimizer, data, compile_mode in itertools.product(core, oracle.DATA, ("eager", "nojit", "spe4")):
        spec = reference_spec(axes.cell_spec("mlp", optimizer, data, compile_mode, "colshard"))
        assert oracle.scope(spec) is None, oracle.scope(spec)
        keras.backend.clear_session()
        evidence = rank_train.train(spec, False)
        want = oracle.expected(spec, evidence["initial_weights"])
        pairs = [(q, evidence[q], getattr(want, q)) for q in oracle.REFERENCE_QUANTITIES]
        pairs += [(f"weight {p}", evidence["weights"][p], w) for p, w in want.weights.items()]
        cell = f"{optimizer}-{data}-{compile_mode}"
        for quantity, got, expected in pairs:
            kind = quantity.split()[0]
            found = share(got, expected, oracle.TOLERANCE)
            if kind not in worst or found[1] > worst[kind][1]:
                worst[kind] = (*found, cell)
        print(cell, "done", flush=True)
    print(f"keras {keras.__version__}, {len(core)} optimizers x {len(oracle.DATA)} sources x 3 compile modes; "
          f"tolerance rtol {oracle.TOLERANCE['rtol']}, atol {oracle.TOLERANCE['atol']}")
    for kind, (difference, used, cell) in sorted(worst.items(), key=lambda item: -item[1][1]):
        print(f"{kind:12} max abs difference {difference:.3g}, {used:.3f} of the tolerance ({cell})")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
