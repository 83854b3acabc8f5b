"""The smallest update-factor error the judge catches, per dtype policy.

    python scripts/factor_sweep.py 1.002 1.003 1.005 1.01

For each factor F: the kit's ``mixed-learning-rate-off-1pct`` with its factor F applied under every
policy (the torch backend's learning rate times F, shared by single-process and distributed torch,
so only the JAX backend and the NumPy oracle can see it), written over the installed Keras, and the
kit's mixed tier run on it (6 mixed cells, 2 float32 ones). Prints each cell's verdict per factor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests import mutants


def main(factors: list[str]) -> None:
    import importlib.util

    (keras_dir,) = importlib.util.find_spec("keras").submodule_search_locations
    case = next(c for c in mutants.CASES if c.mutant.name == "mixed-learning-rate-off-1pct")
    (patch,) = case.mutant.patches
    only_mixed = ('        if keras.config.dtype_policy().name.startswith("mixed"):\n'
                  '            learning_rate = learning_rate * 1.01\n')
    with tempfile.TemporaryDirectory() as work:
        source = os.path.join(work, "installed")
        os.makedirs(source)
        os.symlink(keras_dir, os.path.join(source, "keras"))
        for factor in factors:
            new = patch.new.replace(only_mixed, f"        learning_rate = learning_rate * {float(factor)!r}\n")
            mutant = mutants.Mutant(f"lr-{factor}", "sweep", (mutants.Patch(patch.path, patch.old, new),))
            tree = mutants.write_mutant(_copy_of(source, work), os.path.join(work, f"lr-{factor}"), mutant)
            out = os.path.join(work, f"lr-{factor}.json")
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--keras-path", tree,
                            "--conformance-json", out, *case.tier], check=False, capture_output=True,
                           cwd=os.path.join(os.path.dirname(__file__), ".."))
            with open(out) as f:
                cells = json.load(f)["cells"]
            print(factor, " ".join(f"{c['id']}={c['verdict']}" for c in cells), flush=True)


def _copy_of(source: str, work: str) -> str:
    """A real folder (write_mutant hard-links a tree; a symlinked package is resolved once)."""
    tree = os.path.join(work, "tree")
    if not os.path.exists(tree):
        subprocess.run(["cp", "-rL", source, tree], check=True)
    return tree


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("factors", nargs="*", metavar="FACTOR", default=["1.002", "1.003", "1.005", "1.01"],
                        help="update factors to write into the mutant (default: %(default)s)")
    main(parser.parse_args().factors)
