"""Fixtures for the suite's own tests: Keras trees to point --keras-path at, inner sessions.

Keras trees are real wheels from the package registry, unpacked (a wheel is a zip), and
cached in pytest's cache folder, so the tests exercise --keras-path exactly as a user would.
"""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
import uuid
import zipfile

import psutil
import pytest

pytest_plugins = ["pytester"]

KERAS_WITHOUT_TORCH_DISTRIBUTION = "keras==3.15.1"
KERAS_NIGHTLY = "keras-nightly==3.16.0.dev2026102704"

#: Ranks inherit the controller's environment, so a tag there finds every process a session left.
TAG_VAR = "SELFTEST_SESSION_TAG"

collect_ignore = [] if os.environ.get("TORCHELASTIC_RUN_ID") else ["under_torchrun"]


def unpacked_wheel(config: pytest.Config, requirement: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """``pip download`` one wheel (no dependencies) and unzip it; cached across sessions in pytest's
    cache, or for this session alone where the cache is off (``-p no:cacheprovider``)."""
    name = requirement.replace("==", "-")
    cache = getattr(config, "cache", None)
    root = cache.mkdir(f"keras-tree-{name}") if cache is not None else tmp_path_factory.mktemp(f"keras-tree-{name}")
    tree = root / "tree"
    if not (tree / "keras" / "__init__.py").exists():
        wheels = root / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "-d", str(wheels), requirement],
            check=True,
        )
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tree)
    # Its bytecode, once, as pip writes an installed package's: every inner session's ranks and
    # references (and every mutant, tests/mutants/) import this tree, and where
    # PYTHONDONTWRITEBYTECODE is set (this project's machines and CI) each process would compile all
    # of Keras again. Files already compiled are only checked.
    compileall.compile_dir(str(tree), quiet=2, workers=0)
    return str(tree)


@pytest.fixture(scope="session")
def keras_3151_tree(pytestconfig, tmp_path_factory) -> str:
    return unpacked_wheel(pytestconfig, KERAS_WITHOUT_TORCH_DISTRIBUTION, tmp_path_factory)


@pytest.fixture(scope="session")
def keras_nightly_tree(pytestconfig, tmp_path_factory) -> str:
    return unpacked_wheel(pytestconfig, KERAS_NIGHTLY, tmp_path_factory)


def alive(proc: psutil.Process) -> bool:
    """Still running: neither gone, nor a zombie or dead entry waiting to be reaped.

    A process in the middle of exiting may already hide its environment (psutil raises or
    returns nothing), so ``tagged_processes`` no longer sees it while it still runs: a test that
    knows its ranks' processes must wait for them by this, not only for the tag scan.
    """
    try:
        return proc.is_running() and proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def tagged_processes(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``tag`` (an inner session's ranks and their children)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TAG_VAR) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


class InnerSession:
    """A pytest session in a subprocess, in pytester's folder, its processes tagged. Its zygote is
    forked by the self-tests' mother zygote (``tests/test_mutants.mother``) unless ``tagged``: then
    every process of the session shows the tag in its environment, as ``leftovers`` needs (a forked
    process shows its zygote's environment, and the mother's is no session's)."""

    def __init__(self, pytester: pytest.Pytester, tagged: bool = False):
        self.pytester = pytester
        self.tag = uuid.uuid4().hex
        self.tagged = tagged

    def env(self) -> dict[str, str]:
        from tests.test_mutants import session_env

        return dict(session_env(own_zygote=self.tagged), **{TAG_VAR: self.tag})

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(*args), cwd=self.pytester.path, env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def popen(self, *args: str) -> subprocess.Popen:
        """The session started as a terminal starts a foreground job, for a test to signal it: with
        SIGINT at its default, which Python turns into KeyboardInterrupt. A script's background job
        (``.ci/run &``) runs with SIGINT ignored, which every child would inherit and keep (a Ctrl-C
        test would then wait out its bound): a first interpreter restores it and becomes pytest."""
        restore_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                          "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
        return subprocess.Popen(
            [sys.executable, "-c", restore_sigint, *self.command(*args)[1:]], cwd=self.pytester.path,
            env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

    def leftovers(self) -> list[psutil.Process]:
        if not self.tagged:
            raise RuntimeError("a session whose leftover processes are checked is marked checks_leftovers: its "
                               "zygote is then its own, whose children show the tag")
        return tagged_processes(self.tag)


@pytest.fixture
def inner(pytester: pytest.Pytester, request) -> InnerSession:
    return InnerSession(pytester, tagged=request.node.get_closest_marker("checks_leftovers") is not None)


@pytest.fixture(scope="session")
def references(conformance_state, keras_ranks):
    from conformance.reference import References

    return References(conformance_state.manager.reference())


def pytest_addoption(parser):
    parser.addoption("--mutants-tier", choices=("small", "default"), default="small",
                     help="cells each mutant build runs: a small tier (default) or the whole default tier.")
    parser.addoption("--reproducer-proofs", choices=("one-per-path", "all"), default="one-per-path",
                     help="reproducer proofs under torchrun: one per path a script takes (default: a raised "
                          "training verdict, a judged training verdict, a judged op verdict), or every one.")


def pytest_configure(config):
    config.addinivalue_line("markers", "checks_leftovers: the test's inner session (``inner``) starts its own zygote, "
                            "so that every process it leaves shows its tag")
    config.addinivalue_line("markers", "measures_time: no mutant-kit session runs beside this test (it times "
                                       "something, and the kit's sessions would load the machine)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The mutant kit's tests after the others: its sessions run one at a time beside the other
    tests (``mutant_kit``), two at a time from there on. The tests that measure time last, on a
    machine nothing else loads: no kit session, and the work started at collection (``EARLY_WORK``:
    a virtual environment's install, which unpacks gigabytes) long done."""
    def place(item) -> int:
        if item.get_closest_marker("measures_time") is not None:
            return 2
        return 1 if getattr(getattr(item, "module", None), "__name__", None) == "tests.test_mutants" else 0

    items.sort(key=place)


@pytest.fixture(scope="session", autouse=True)
def mutant_kit(request, tmp_path_factory):
    """The kit's selected sessions (``tests/test_mutants.Kit``), queued before the first test so
    they use what the other self-tests leave of the CPU; None where no kit test is selected."""
    from tests import test_mutants

    selected = test_mutants.selected_sessions(request.session.items)
    if not selected:
        yield None
        return
    kit = test_mutants.Kit(selected, request.getfixturevalue("keras_nightly_tree"), tmp_path_factory,
                           lambda case: test_mutants.tier(request.config, case))
    yield kit
    kit.close()


@pytest.fixture(autouse=True)
def _quiet_for_timing(request, mutant_kit):
    """A test marked ``measures_time`` runs with no kit session beside it."""
    if mutant_kit is None or request.node.get_closest_marker("measures_time") is None:
        yield
        return
    with mutant_kit.lanes.quiet():
        yield


def pytest_sessionfinish(session):
    from tests.test_mutants import close_mother

    close_mother()  # after the fixtures' teardown: the kit's sessions have ended


def pytest_terminal_summary(terminalreporter):
    from tests.test_mutants import mutation_score

    score = mutation_score()
    if score:
        terminalreporter.write_sep("=", score)


#: Work that waits on the package index more than it computes (pip's resolver for every workflow
#: leg, a virtual environment's install), by the fixture that gives it: started in a thread as soon
#: as the tests are collected, so it overlaps the tests that keep the CPU busy. name -> (module,
#: function, cleanup or None).
EARLY_WORK = {
    "resolved": ("tests.workflows", "resolve_every_leg", None),
    "newest_python_env": ("tests.test_newest_python", "build_env", "remove_env"),
}
EARLY = pytest.StashKey[dict]()


def _early_function(name: str, attribute: int):
    import importlib

    module, *names = EARLY_WORK[name]
    return None if names[attribute] is None else getattr(importlib.import_module(module), names[attribute])


def pytest_collection_finish(session: pytest.Session) -> None:
    from concurrent.futures import ThreadPoolExecutor

    wanted = [name for name in EARLY_WORK
              if any(name in getattr(item, "fixturenames", ()) for item in session.items)]
    if not wanted:
        return
    pool = ThreadPoolExecutor(len(wanted), thread_name_prefix="early")
    futures = {name: pool.submit(_early_function(name, 0)) for name in wanted}
    session.config.stash[EARLY] = futures
    pool.shutdown(wait=False)

    def clean_up():
        for name, future in futures.items():
            cleanup = _early_function(name, 1)
            if cleanup is not None and not future.cancel():
                try:
                    cleanup(future.result())
                except Exception as exc:  # noqa: BLE001 - the work's own failure is its test's to report
                    print(f"early work {name} left nothing to clean up: {exc!r}")

    session.config.add_cleanup(clean_up)


def early(request: pytest.FixtureRequest, name: str):
    """What EARLY_WORK's ``name`` gave (waiting for it), or, where it was not started (a run that
    collected no test needing it before this one), the same work done now."""
    future = request.config.stash.get(EARLY, {}).get(name)
    if future is not None:
        return future.result()
    result = _early_function(name, 0)()
    cleanup = _early_function(name, 1)
    if cleanup is not None:
        request.config.add_cleanup(lambda: cleanup(result))
    return result
