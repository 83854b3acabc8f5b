"""Every ``python -m`` module of the plugin and every script with a ``__main__`` answers ``--help``:
exit 0, argparse's usage, and a description of what it is. Found by reading the sources (a module-level
``if __name__ == "__main__":``, or a package's ``__main__.py``), so a new entry point is held to it without a list kept by hand."""

from __future__ import annotations

import ast
import concurrent.futures
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "keras_dtensor_conformance"  # the ``fixtures`` folder, installed under this name


def has_main(path: str) -> bool:
    """A module-level ``if __name__ == "__main__":`` (not one inside a string, as a reproducer's template)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__" for node in tree.body)


def entry_points() -> dict[str, tuple[list[str], str]]:
    """``{name: (command, path)}`` for the plugin's modules (``python -m``) and the scripts (``python FILE``)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "fixtures")):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if name == "__main__.py" or (name.endswith(".py") and has_main(path)):
                parts = os.path.relpath(path, os.path.join(ROOT, "fixtures"))[:-3].split(os.sep)
                module = ".".join([PACKAGE, *(parts[:-1] if name == "__main__.py" else parts)])  # a package's own
                found[module] = ([sys.executable, "-m", module], path)
    for name in sorted(os.listdir(os.path.join(ROOT, "scripts"))):
        path = os.path.join(ROOT, "scripts", name)
        if name.endswith(".py") and has_main(path):
            found[f"scripts/{name}"] = ([sys.executable, path], path)
    return found


ENTRY_POINTS = entry_points()


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """Every entry point's ``--help``, run side by side (each imports what it needs first)."""
    def run(command):
        return subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run, command) for name, (command, _) in ENTRY_POINTS.items()}
        return {name: future.result() for name, future in futures.items()}


def test_the_entry_points_are_found():
    assert {f"{PACKAGE}.rank.worker", f"{PACKAGE}.rank.zygote", f"{PACKAGE}.rank.bare", f"{PACKAGE}.rank.build_probe",
            f"{PACKAGE}.report.annotations", f"{PACKAGE}.report.merge", f"{PACKAGE}.slicing",
            "scripts/upstream_kit.py", "scripts/factor_sweep.py"} <= set(ENTRY_POINTS)
    assert f"{PACKAGE}.report.reproducers" not in ENTRY_POINTS  # its __main__ is the generated script's


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_help_says_what_it_is_and_exits_0(helps, name):
    result = helps[name]
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("usage:"), result.stdout
    # argparse's layout: the usage block, then the description, then the arguments.
    description = result.stdout.split("\n\n")[1]
    assert not description.startswith(("options:", "positional arguments:")) and len(description.split()) >= 5, (
        result.stdout)
