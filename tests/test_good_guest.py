"""The plugin is a good guest: installed in an environment, it is loaded by every pytest session
there, and must cost nothing where no conformance cell is collected and no option of ours given.

Laziness is proven without timing: the environment's installed Keras is broken (a ``keras``
package on PYTHONPATH that raises on import), so any session that probes the build fails with a
usage error naming it. A stranger's session must pass; bad input that needs no Keras must be
rejected for what it is (not for the broken Keras a probe would have found first).
"""

from __future__ import annotations

import re
import subprocess
import types

import pytest
from keras_dtensor_conformance import options

from tests.test_session import USAGE_ERROR, only_error_line

UNRELATED = "def test_arithmetic():\n    assert 1 + 1 == 2\n"
TORCH_CELL = """
import torch.distributed as dist

def rank():
    return dist.get_rank()

def test_torch_cell(dist_ranks):
    assert dist_ranks.run(rank).values == list(range(len(dist_ranks.run(rank).values)))
"""
BROKEN = "`import keras` failed: ImportError: boom: the installed Keras is broken"


@pytest.fixture
def broken_keras(tmp_path) -> dict[str, str]:
    """An environment whose installed Keras fails to import (what a probe would report)."""
    site = tmp_path / "broken-site"
    (site / "keras").mkdir(parents=True)
    (site / "keras" / "__init__.py").write_text("raise ImportError('boom: the installed Keras is broken')\n")
    return {"PYTHONPATH": str(site)}


def run_with(inner, extra_env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = dict(inner.env(), **extra_env)
    return subprocess.run(inner.command(*args), cwd=inner.pytester.path, env=env, capture_output=True, text=True,
                          timeout=600)


def test_unrelated_project_never_probes_the_build(inner, broken_keras):
    inner.pytester.makepyfile(test_unrelated=UNRELATED)
    result = run_with(inner, broken_keras)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "1 passed" in out
    assert "keras:" not in out and "ERROR" not in out


@pytest.mark.checks_leftovers
def test_a_conformance_item_probes_at_collection_one_error_line(inner, broken_keras):
    """Without options, a collected cell makes the session probe: a broken build is still one
    ``ERROR:`` line and exit code 4 (the UsageError raised during collection), and no rank starts."""
    inner.pytester.makepyfile(test_cells=TORCH_CELL, test_unrelated=UNRELATED)
    result = run_with(inner, broken_keras)
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert only_error_line(result) == f"ERROR: the installed Keras: {BROKEN}"
    assert inner.leftovers() == []


def test_header_lines_come_after_collection_when_no_option_was_given(inner):
    inner.pytester.makepyfile(test_cells=TORCH_CELL)
    result = inner.run("--collect-only")
    assert result.returncode == 0, result.stdout + result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("keras: ")]
    assert len(headers) == 1, result.stdout
    assert "dist backend: gloo; nproc: 2" in result.stdout


@pytest.mark.parametrize("args, error", [
    (("--nproc", "0"), "ERROR: --nproc 0: needs at least one rank"),
    (("--rank-timeout", "0"), "ERROR: --rank-timeout 0.0: must be positive"),
    (("--dist-backend", "nccl", "--nproc", "64"), "ERROR: --dist-backend nccl needs one GPU per rank: --nproc 64, "),
    (("-o", "nproc=three"), "ERROR: the ini option nproc = 'three': expected an integer"),
    (("--benchmark-ratio-fail", "1.05"), "ERROR: --benchmark-ratio-fail 1.05: needs --benchmark-against PATH"),
    (("--benchmark-pairs", "1"), "ERROR: --benchmark-pairs 1: needs at least two rounds for an interval"),
], ids=["nproc", "rank-timeout", "nccl", "ini-type", "ratio-fail-alone", "one-pair"])
def test_bad_input_that_needs_no_keras_is_rejected_before_the_probe(inner, broken_keras, args, error):
    """Had the build been probed first, the error would name the broken Keras instead."""
    if "nccl" in args:
        from keras_dtensor_conformance.session import visible_gpus

        if visible_gpus() >= 64:
            pytest.skip("this machine has 64 GPUs")
    inner.pytester.makepyfile(test_cells=TORCH_CELL)
    result = run_with(inner, broken_keras, *args)
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    assert only_error_line(result).startswith(error)


# ------------------------------------------------------------------ option precedence
def fake_config(cli: dict | None = None, ini: dict | None = None, inipath: str | None = "/proj/pytest.ini"):
    """What ``options.resolve`` reads of a pytest Config: parsed flags, ini values, the ini file."""
    cli = cli or {}
    namespace = types.SimpleNamespace(**{o.dest: cli.get(o.dest) for o in options.OPTIONS})
    return types.SimpleNamespace(option=namespace, getini=lambda name: (ini or {}).get(name), inipath=inipath)


@pytest.mark.parametrize("cli, env, ini, want", [
    ({}, {}, {}, (2, "default")),
    ({}, {}, {"nproc": "3"}, (3, "the ini option nproc")),
    ({"nproc": 4}, {}, {"nproc": "3"}, (4, "--nproc")),
], ids=["default", "ini", "command-line-over-ini"])
def test_nproc_precedence(cli, env, ini, want):
    assert options.resolve(fake_config(cli, ini), env)["nproc"] == want


@pytest.mark.parametrize("cli, env, ini, want", [
    ({}, {}, {}, (None, "default")),
    ({}, {}, {"keras_path": "../keras"}, ("/proj/../keras", "the ini option keras_path")),
    ({}, {"KERAS_PATH": "/env/keras"}, {"keras_path": "../keras"}, ("/env/keras", "KERAS_PATH")),
    ({"keras_path": "/cli/keras"}, {"KERAS_PATH": "/env/keras"}, {"keras_path": "x"}, ("/cli/keras", "--keras-path")),
], ids=["default", "ini-relative-to-its-file", "env-over-ini", "command-line-over-env"])
def test_keras_path_precedence(cli, env, ini, want):
    assert options.resolve(fake_config(cli, ini), env)["keras_path"] == want


@pytest.mark.parametrize("raw, want", [(True, True), ("true", True), ("0", False), (None, False)])
def test_flag_ini_twins(raw, want):
    resolved = options.resolve(fake_config(ini={"full": raw, "conformance_strict": raw}), {})
    assert resolved["full"][0] is want and resolved["conformance_strict"][0] is want


def test_only_command_line_options_make_a_conformance_session():
    """KERAS_PATH exported in a shell, or an ini twin, must not make a stranger's session probe."""
    resolved = options.resolve(fake_config(ini={"nproc": "3"}), {"KERAS_PATH": "/env/keras"})
    assert options.from_command_line(resolved) == []
    assert options.from_command_line(options.resolve(fake_config({"full": True}), {})) == ["--full"]


def test_every_option_is_in_the_table_once():
    flags = [o.flag for o in options.OPTIONS]
    assert len(flags) == len(set(flags)) and len({o.dest for o in options.OPTIONS}) == len(flags)


def test_ini_twin_reaches_the_session(inner):
    """``nproc = 3`` in the project's ini file is the session's --nproc (written back to config.option)."""
    inner.pytester.makeini("[pytest]\nnproc = 3\n")
    inner.pytester.makepyfile(test_cells=TORCH_CELL)
    result = inner.run("--collect-only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dist backend: gloo; nproc: 3" in result.stdout


# ------------------------------------------------------------------ the rank_timeout marker
MARKED = """
import time
import pytest

def sleep_forever():
    while True:
        time.sleep(0.1)

@pytest.mark.rank_timeout(3)
def test_marker_sets_the_call_timeout(dist_ranks):
    result = dist_ranks.run(sleep_forever)
    print("VERDICT", result.status, result.outcomes[0].note)

@pytest.mark.rank_timeout(3)
def test_explicit_timeout_wins(dist_ranks):
    result = dist_ranks.run(sleep_forever, timeout=2)
    print("VERDICT", result.status, result.outcomes[0].note)
"""


def test_rank_timeout_marker_limits_each_call_of_its_test(inner):
    inner.pytester.makepyfile(test_marked=MARKED)
    result = inner.run("--rank-timeout", "60", "-s")
    assert result.returncode == 0, result.stdout + result.stderr
    verdicts = re.findall(r"VERDICT [^\n]*", result.stdout)
    assert verdicts == ["VERDICT hang no answer within the 3s timeout", "VERDICT hang no answer within the 2s timeout"]


def test_rank_timeout_marker_is_documented(inner):
    result = inner.run("--markers")
    assert "@pytest.mark.rank_timeout(seconds):" in result.stdout


def test_a_bad_rank_timeout_marker_is_one_error_line(inner):
    inner.pytester.makepyfile(test_marked="import pytest\n\n@pytest.mark.rank_timeout('soon')\n"
                                          "def test_x(dist_ranks):\n    pass\n")
    result = inner.run()
    assert result.returncode == USAGE_ERROR
    assert "the rank_timeout marker takes one positive number of seconds" in only_error_line(result)


# ------------------------------------------------------------------ benchmarks when skipped
BENCHMARKS = """
def test_our_benchmark(benchmark, conformance_state):
    benchmark(lambda: None)

def test_a_strangers_benchmark(benchmark):
    benchmark(lambda: None)

def test_cell(conformance_state):
    pass
"""


def test_our_benchmarks_are_deselected_not_skipped_when_benchmarks_are_skipped(inner):
    """pytest's skip count then agrees with the report's; a stranger's benchmark stays pytest-benchmark's."""
    inner.pytester.makepyfile(test_benchmarks=BENCHMARKS)
    result = inner.run("--benchmark-skip", "-rs")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped, 1 deselected" in result.stdout
    (skipped,) = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert "Skipping benchmark (--benchmark-skip active)" in skipped  # the stranger's, not ours
