"""README's commands work as typed: ``--keras-path PATH`` (space form) is the same as ``--keras-path=PATH``.

pytest chooses its rootdir and ini file before this plugin is loaded; a Keras checkout carries its
own ``[tool.pytest.ini_options]``, which would configure the run if its path were taken for a test
path. These tests put such a checkout (the nightly tree, hard-linked, plus a pyproject.toml with
pytest configuration and a test of its own) outside the project and run both forms.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from keras_dtensor_conformance import early_args

from tests.test_mutants import session_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkout_with_pytest_config(keras_nightly_tree, tmp_path_factory) -> str:
    tree = tmp_path_factory.mktemp("checkout") / "keras"
    shutil.copytree(keras_nightly_tree, tree, copy_function=os.link, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\ntestpaths = ["integration_tests"]\naddopts = "-p no:doctest"\n'
    )
    (tree / "integration_tests").mkdir()
    (tree / "integration_tests" / "test_keras_own.py").write_text("def test_keras_own():\n    pass\n")
    return str(tree)


def collect(*args: str) -> tuple[str, str, list[str]]:
    """(rootdir, configfile, collected node ids) of ``pytest --collect-only ARGS`` run from the project root."""
    env = session_env()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    rootdir = re.search(r"^rootdir: ([^,\n]+)", out, re.M)
    configfile = re.search(r"configfile: (\S+)", out)
    ids = re.findall(r"<Function (\S+)>", out)
    return (rootdir.group(1) if rootdir else "", configfile.group(1) if configfile else "", ids)


def test_space_and_equals_forms_choose_the_same_root_ini_and_cells(checkout_with_pytest_config):
    # A flag of ours (--conformance-strict) before another argument takes no value from it.
    space = collect("--conformance-strict", "--nproc", "2", "--keras-path", checkout_with_pytest_config)
    equals = collect("--conformance-strict", "--nproc=2", f"--keras-path={checkout_with_pytest_config}")
    assert equals[:2] == (ROOT, "pytest.ini")
    assert space == equals
    assert "test_keras_own" not in space[2] and len(space[2]) > 100


def test_pytest_main_with_the_space_form_is_one_usage_error(pytester, checkout_with_pytest_config):
    """In-process (pytest.main) the process cannot be replaced: the user is told to use '='."""
    result = pytester.runpytest_inprocess("--keras-path", checkout_with_pytest_config, "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --keras-path: pass the value with '=' (e.g. --keras-path=PATH)*"])


@pytest.mark.parametrize("args, options, want", [
    (["--keras-path", "../keras", "-q"], {"--keras-path"}, ["--keras-path=../keras", "-q"]),
    (["--keras-path=../keras"], {"--keras-path"}, None),
    (["--nproc", "3", "--full", "--", "--nproc", "4"], {"--nproc"}, ["--nproc=3", "--full", "--", "--nproc", "4"]),
    (["-k", "adam", "tests"], {"--nproc"}, None),
])
def test_rewrite_joins_only_our_valued_options(args, options, want):
    assert early_args.rewrite(args, options) == want
