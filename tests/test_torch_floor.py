"""The torch floor: an older torch is one line that names it, read from metadata without importing torch."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest
from keras_dtensor_conformance import torch_internals
from keras_dtensor_conformance.torch_internals import TORCH_FLOOR, release, unsupported_torch


def installed(monkeypatch, version: str | None) -> None:
    """Fake the installed torch's metadata (None: no distribution named torch)."""
    def fake(name: str) -> str:
        assert name == "torch"
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", fake)


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1+cu126", "2.12.0.dev20260301+cpu", "2.5.1", "1.13.1"])
def test_an_older_torch_is_one_line_naming_the_floor(monkeypatch, version):
    installed(monkeypatch, version)
    message = unsupported_torch()
    assert message == (f"torch {version} is older than 2.13, the oldest torch this suite was run on: "
                       'pip install "torch>=2.13"')
    assert "\n" not in message


@pytest.mark.parametrize("version", [
    "2.13.0", "2.13.0+cpu", "2.13.0+cu128",  # the release, CPU and CUDA wheels
    "2.13.1", "2.14.1+cpu", "2.15.0", "3.0.0",  # later releases
    "2.13.0.dev20260301", "2.13.0a0+git1234abc",  # a nightly or a source build of the floor's release: the floor
    "2.15.0.dev20261101+cpu",
])
def test_the_floor_and_later_are_supported(monkeypatch, version):
    installed(monkeypatch, version)
    assert unsupported_torch() is None


def test_without_metadata_the_probe_speaks(monkeypatch):
    """No torch distribution (a source tree on sys.path, or none): nothing to compare; the build
    probe, which imports torch, reports what is wrong."""
    installed(monkeypatch, None)
    assert unsupported_torch() is None and torch_internals.installed_torch() is None


def test_an_explicit_version_is_judged_without_metadata(monkeypatch):
    installed(monkeypatch, "2.13.0")
    assert unsupported_torch("2.12.0").startswith("torch 2.12.0 is older than 2.13")
    assert unsupported_torch("not a version") is None


def test_release_drops_local_labels_and_dev_parts():
    assert release("2.13.0+cpu") == release("2.13.0.dev20260301") == release("2.13.0a0+git1") == (2, 13, 0)
    assert release(TORCH_FLOOR) == (2, 13)


def test_the_running_torch_is_supported():
    assert unsupported_torch() is None  # the torch these self-tests run on is at or above the floor


def test_importing_the_module_imports_no_torch():
    """The controller calls it before anything imports torch; the ranks import it before each cell."""
    code = ("import sys; import keras_dtensor_conformance.torch_internals as t; t.unsupported_torch(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


PRIVATE_TORCH_IMPORT = re.compile(r"^\s*(?:from\s+(torch[\w.]*)\s+import\s+(.*)|import\s+(torch[\w.]*))", re.M)


def private_torch_imports(path: pathlib.Path) -> list[str]:
    """Import statements of a private torch module or name (``torch._dynamo.utils``, ``import _pop_mode``)."""
    found = []
    for match in PRIVATE_TORCH_IMPORT.finditer(path.read_text(encoding="utf-8")):
        module = match.group(1) or match.group(3)
        names = [n.strip() for n in (match.group(2) or "").strip("()").split(",")]
        if "._" in module or any(n.startswith("_") for n in names):
            found.append(match.group(0).strip())
    return found


def test_private_torch_is_imported_here_or_listed_here():
    """A private torch import outside ``torch_internals`` is in a module a reproducer inlines, which
    ``torch_internals``' docstring names (a script can import nothing of this project)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    listed = torch_internals.__doc__
    unlisted = {}
    for path in sorted([*(root / "fixtures").rglob("*.py"), *(root / "conformance").rglob("*.py")]):
        if path.name == "torch_internals.py":
            continue
        relative = path.relative_to(root).as_posix()
        if private_torch_imports(path) and f"``{relative}``" not in listed:
            unlisted[relative] = private_torch_imports(path)
    assert unlisted == {}


def test_a_session_on_an_older_torch_is_one_error_line(inner):
    """The session's activation asks ``unsupported_torch`` before the build probe: an older torch
    (faked here by the inner session's conftest, in its metadata) is exit 4 with one ``ERROR:`` line."""
    inner.pytester.makeconftest("""
import importlib.metadata

real = importlib.metadata.version
importlib.metadata.version = lambda name: "2.11.0+cpu" if name == "torch" else real(name)
""")
    inner.pytester.makepyfile("def test_cell(dist_ranks):\n    pass\n")
    result = inner.run()
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("ERROR:")]
    assert result.returncode == 4 and errors == [
        'ERROR: torch 2.11.0+cpu is older than 2.13, the oldest torch this suite was run on: pip install "torch>=2.13"'
    ], result.stdout + result.stderr
