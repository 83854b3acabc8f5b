"""The zygote (``controller/zygote.py``): children forked from it are the processes ``python -m``
would have started, with their own environment, session, files and exit codes; where it cannot
serve a child (another interpreter start-up, a zygote that is not single-threaded), the child is
started afresh instead, and the session's ranks are its children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Client

import psutil
import pytest
from keras_dtensor_conformance.controller.launch import LaunchConfig
from keras_dtensor_conformance.controller.mother import MOTHER, MOTHER_KEY, Mother
from keras_dtensor_conformance.controller.zygote import ZYGOTE_MODULE, ForkedProcess, Zygote, ended, shadowed
from keras_dtensor_conformance.rank import huge_pages
from keras_dtensor_conformance.rank.zygote import pythonpath_entries

from tests import torch_cells

CHILD = "tests.zygote_child"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """One for the module's tests: each forks what it needs from it, as a session's processes do."""
    tmp_path = tmp_path_factory.mktemp("zygote")
    env = LaunchConfig(None, str(tmp_path / "home")).base_env()
    z = Zygote(dict(env, KDC_ZYGOTE_ONLY="zygote"), str(tmp_path / "z"))
    z.start()
    yield z
    z.close()


def spawn(zygote, tmp_path, *argv, **env):
    base = {k: v for k, v in zygote.env.items() if k != "KDC_ZYGOTE_ONLY"}
    out, err = str(tmp_path / "out"), str(tmp_path / "err")
    return zygote.spawn(CHILD, list(argv), dict(base, **env), out, err), out, err


def test_a_forked_child_is_the_process_python_m_would_start(zygote, tmp_path):
    proc, out, err = spawn(zygote, tmp_path, "describe", KDC_TEST_CHILD="child", OMP_NUM_THREADS="2")
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0
    seen = json.loads(open(out).read())
    assert seen["pid"] == proc.pid and seen["ppid"] == zygote.info["pid"]
    assert seen["sid"] == proc.pid  # a session of its own, as start_new_session gives
    assert seen["argv"] == ["describe"] and seen["main"].endswith(os.path.join("tests", "zygote_child.py"))
    assert seen["cwd"] == os.getcwd()
    assert seen["env"] == "child" and seen["zygote_only"] is None  # its environment, not the zygote's
    assert seen["threads"] == 2  # OMP_NUM_THREADS as the child has it, not the zygote's 1
    assert not seen["keras_imported"]  # the build under test is the child's to import
    assert open(err).read() == "to stderr\n"


def test_a_forked_child_has_its_own_temporary_folder(zygote, tmp_path):
    """Not the one the zygote's imports found first (``tempfile`` keeps it): a session's own TMPDIR
    is where its processes' files go."""
    (tmp_path / "tmp").mkdir()
    proc, out, err = spawn(zygote, tmp_path, "describe", TMPDIR=str(tmp_path / "tmp"))
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0, open(err).read()
    assert json.loads(open(out).read())["tmp"] == str(tmp_path / "tmp")


def test_a_forked_childs_collections_leave_the_zygotes_imports_alone(zygote, tmp_path):
    """The zygote froze what its imports made (``gc.freeze``): a child's collection walks its own
    objects, not torch's, and copies no page it shares with the zygote by touching one."""
    proc, out, err = spawn(zygote, tmp_path, "describe")
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0, open(err).read()
    assert json.loads(open(out).read())["frozen"] > 100_000  # about 400,000 here: torch, SciPy, JAX and the rest


def test_a_forked_child_has_inductors_probe_of_the_cpu_done_with_the_answer_it_would_find(zygote, tmp_path):
    """The zygote ran inductor's probe of the CPU's vector instruction sets (``rank/zygote.warm``),
    which a rank would otherwise run at its first compile: the child finds it done, with the answer a
    fresh process finds (asked in one: the probe also sets inductor's cache folder in the environment)."""
    proc, out, err = spawn(zygote, tmp_path, "vec-isa")
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0, open(err).read()
    fresh = subprocess.run([sys.executable, "-m", CHILD, "vec-isa"], capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(fresh.stdout)["probed"] == 0
    assert json.loads(open(out).read()) == {"probed": 1, "isa": json.loads(fresh.stdout)["isa"]}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_forked_childs_first_compile_finds_its_backends_modules_imported(zygote, tmp_path, backend):
    """The zygote imported what a process's first ``torch.compile`` imports to find its backend
    (``torch_internals.import_compile_backends``, hundreds of modules): a child imports few."""
    proc, out, err = spawn(zygote, tmp_path, "first-compile", backend)
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=120) == 0, open(err).read()
    # 16 (aot_eager) and 40 (inductor) here, 101 on inductor where its cache has not the kernel yet (the code
    # generator's sympy modules); 373 and 561 from a zygote without them, 1,285 and 1,563 in a fresh process
    # (``python -m tests.zygote_child first-compile BACKEND``), dynamo's own included.
    assert json.loads(open(out).read())["imported"] < 200


def test_a_forked_child_finds_the_source_files_the_zygote_was_asked_to_read(zygote, tmp_path):
    """Read once in the zygote as a trace reads them (``read_source_names``), for every child after; a
    file that cannot be read there, or named by a relative path, is left for a child's own trace, and the
    zygote serves on."""
    (tmp_path / "good.py").write_text("def traced(x):\n    return x + 1\n")
    (tmp_path / "bad.py").write_text("# -*- coding: no-such-codec -*-\ndef traced(x):\n    return x\n")
    (tmp_path / "unasked.py").write_text("def traced(x):\n    return x\n")
    zygote.prime(source_names=[str(tmp_path / "bad.py"), str(tmp_path / "good.py"), "relative.py"])
    proc, out, err = spawn(zygote, tmp_path, "source-names", "relative.py", *(str(tmp_path / name) for name in
                                                                              ("good.py", "bad.py", "unasked.py")))
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0, open(err).read()
    assert json.loads(open(out).read()) == {"good.py": True, "bad.py": False, "unasked.py": False, "relative.py": False}


def _can_collapse() -> bool:
    """Whether this kernel maps a process's memory by 2 MiB pages on request: MADV_COLLAPSE (Linux 6.1)
    and transparent huge pages not turned off."""
    try:
        enabled = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    release = tuple(int(part) for part in os.uname().release.split(".")[:2] if part.isdigit())
    return "[never]" not in enabled and release >= (6, 1)


def test_a_zygote_that_forks_often_has_its_memory_in_huge_pages_and_its_children_are_as_before(zygote, tmp_path):
    """After ``huge_pages.AFTER_FORKS`` forks the zygote maps its memory by 2 MiB pages, and says so
    (``Zygote.huge_pages``): the children after share those pages and are the processes they were. A
    kernel that cannot is refused, and said so: the forks go on as before. (The module's zygote is shared:
    the tests after this one fork from a collapsed zygote, as a pool's later ranks are.)"""
    for _ in range(huge_pages.AFTER_FORKS + 1):
        if zygote.huge_pages is not None:
            break
        proc, _, err = spawn(zygote, tmp_path, "exit", "0")
        assert isinstance(proc, ForkedProcess), zygote.why_not
        assert proc.wait(timeout=60) == 0, open(err).read()
    said = zygote.huge_pages
    assert said is not None and said["after_forks"] == huge_pages.AFTER_FORKS
    proc, out, err = spawn(zygote, tmp_path, "huge-pages")
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0, open(err).read()
    if _can_collapse():
        assert said["mib"] >= 64, said  # torch's and JAX's imports alone fill more than that
        assert json.loads(open(out).read())["mib"] > 0  # the child's fork copied 2 MiB entries
    else:
        assert said["refused"] > 0, said
    test_a_forked_child_is_the_process_python_m_would_start(zygote, tmp_path)


@pytest.mark.skipif(sys.platform != "linux", reason="the collapse reads /proc")
def test_a_collapse_that_fails_says_why_and_does_not_raise(monkeypatch):
    """The zygote forks on in 4 KiB pages, and the pools' line gives the error."""
    def unreadable(maps="/proc/self/maps"):
        raise PermissionError(maps)

    monkeypatch.setattr(huge_pages, "anonymous_ranges", unreadable)
    said = huge_pages.collapse()
    assert said["mib"] == 0 and said["error"] == "PermissionError('/proc/self/maps')", said


def test_the_anonymous_ranges_are_the_private_writable_ones_without_a_file(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "00400000-00600000 r-xp 00000000 08:01 1 /usr/bin/python3\n"
        "00800000-00a00000 rw-p 00200000 08:01 1 /usr/bin/python3\n"
        "01000000-05000000 rw-p 00000000 00:00 0                          [heap]\n"
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "7f0000400000-7f0000600000 rw-s 00000000 00:01 2 /dev/zero (deleted)\n"
        "7f0000600000-7f0000800000 r--p 00000000 00:00 0 \n"
        "7ffc00000000-7ffc00200000 rw-p 00000000 00:00 0                  [stack]\n"
    )
    assert huge_pages.anonymous_ranges(str(maps)) == [(0x01000000, 0x05000000), (0x7F0000000000, 0x7F0000400000)]


def test_a_child_with_another_compiler_is_started_afresh(zygote, tmp_path):
    """Inductor read ``CXX`` at its import in the zygote, and probed the CPU with that compiler."""
    proc, _, _ = spawn(zygote, tmp_path, "exit", "0", CXX="clang++")
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=120) == 0


def test_forked_children_draw_their_own_random_numbers(zygote, tmp_path):
    """As fresh processes do: NumPy's global generator and ``random`` are not the zygote's copy."""
    draws = []
    for _ in range(2):  # each child's output is read before the next one's overwrites it
        proc, out, err = spawn(zygote, tmp_path, "draw")
        assert isinstance(proc, ForkedProcess), zygote.why_not
        assert proc.wait(timeout=60) == 0, open(err).read()
        draws.append(json.loads(open(out).read()))
    assert draws[0]["numpy"] != draws[1]["numpy"]
    assert draws[0]["random"] != draws[1]["random"]


@pytest.mark.parametrize(("argv", "code"), [(["exit", "3"], 3), (["raise"], 1), (["kill-self"], -signal.SIGKILL)],
                         ids=["exit-3", "uncaught-exception", "killed"])
def test_a_forked_childs_exit_code_is_what_popen_would_report(zygote, tmp_path, argv, code):
    proc, _, err = spawn(zygote, tmp_path, *argv)
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == code
    if argv == ["raise"]:
        assert "ValueError: the child's own error" in open(err).read()


def test_waiting_for_a_forked_child_times_out_and_it_can_be_killed(zygote, tmp_path):
    proc, _, _ = spawn(zygote, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_child_with_another_pythonpath_has_it_first_on_sys_path(zygote, tmp_path):
    """As a pool on another build (``--benchmark-against``) has: the build first, the zygote's gone."""
    other = tmp_path / "other-build"
    other.mkdir()
    proc, out, _ = spawn(zygote, tmp_path, "describe", PYTHONPATH=str(other))
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0
    path = json.loads(open(out).read())["sys_path"]
    assert path[:2] == [os.getcwd(), str(other)]
    assert not set(pythonpath_entries(zygote.env.get("PYTHONPATH", ""))) & set(path)


def test_a_child_with_another_interpreter_start_up_is_started_afresh(zygote, tmp_path):
    proc, out, _ = spawn(zygote, tmp_path, "describe", PYTHONHASHSEED="7")
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=120) == 0
    assert json.loads(open(out).read())["ppid"] == os.getpid()


def test_a_child_is_started_afresh_when_the_zygote_imported_from_its_pythonpath(tmp_path):
    """Then a child on another PYTHONPATH might find a module where it would not have looked."""
    shim = tmp_path / "shim"
    (shim / "rich").mkdir(parents=True)  # a module of PRELOAD, found in the zygote's PYTHONPATH
    (shim / "rich" / "__init__.py").write_text("")
    env = dict(LaunchConfig(None, str(tmp_path / "home")).base_env(), PYTHONPATH=str(shim))
    zygote = Zygote(env, str(tmp_path / "z"))
    zygote.start()
    try:
        proc, _, _ = spawn(zygote, tmp_path, "describe", PYTHONPATH=str(tmp_path))
        assert zygote.info["from_pythonpath"] == ["rich"]
        assert isinstance(proc, subprocess.Popen)
        assert proc.wait(timeout=120) == 0
        same, _, _ = spawn(zygote, tmp_path, "describe")  # its own PYTHONPATH: forked
        assert isinstance(same, ForkedProcess) and same.wait(timeout=60) == 0
    finally:
        zygote.close()


def test_a_child_whose_pythonpath_holds_a_module_the_zygote_imported_is_started_afresh(zygote, tmp_path):
    """Its ``python -m`` would have imported that module from there, not inherited the zygote's."""
    other = tmp_path / "other-venv"
    (other / "rich").mkdir(parents=True)
    (other / "rich" / "__init__.py").write_text("")
    proc, out, _ = spawn(zygote, tmp_path, "describe", PYTHONPATH=str(other))
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=120) == 0
    assert json.loads(open(out).read())["ppid"] == os.getpid()


JAX_REFERENCE_ENV = {"JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_COMPILATION_CACHE_MAX_SIZE": "1024", "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}


def test_a_forked_child_has_the_jax_settings_a_fresh_import_would_read(zygote, tmp_path):
    """JAX read its variables at the zygote's import; the JAX reference's own (its platform, its
    compilation cache, its device count) are what a fresh process would have."""
    env = dict(JAX_REFERENCE_ENV, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))
    proc, out, err = spawn(zygote, tmp_path, "jax", **env)
    assert isinstance(proc, ForkedProcess), zygote.why_not
    assert proc.wait(timeout=60) == 0, open(err).read()
    fresh = subprocess.run([sys.executable, "-m", CHILD, "jax"], env=dict(zygote.env, **env), capture_output=True,
                           text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr
    assert json.loads(open(out).read()) == json.loads(fresh.stdout)
    assert json.loads(fresh.stdout) == {"devices": ["cpu"] * 3, "config": {
        "jax_platforms": "cpu", "jax_compilation_cache_dir": str(tmp_path / "xla"),
        "jax_persistent_cache_min_compile_time_secs": 0.0, "jax_compilation_cache_max_size": 1024}}


def test_a_child_with_other_jax_settings_than_those_set_at_the_fork_is_started_afresh(zygote, tmp_path):
    proc, _, _ = spawn(zygote, tmp_path, "describe", JAX_ENABLE_X64="1")
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=120) == 0


def test_a_session_zygote_forked_by_a_mother_serves_its_session(tmp_path, monkeypatch):
    """The mutant kit's sessions have their zygotes forked by one that imported everything once:
    such a zygote forks its session's children as a fresh one does, and its exit code reaches the
    session; a session with another interpreter start-up gets a fresh zygote."""
    env = LaunchConfig(None, str(tmp_path / "home")).base_env()
    mother = Mother(env, str(tmp_path / "m"))
    mother.start()
    try:
        for name, value in mother.env().items():
            monkeypatch.setenv(name, value)
        zygote = Zygote(env, str(tmp_path / "z"))
        zygote.start()
        try:
            proc, out, err = spawn(zygote, tmp_path, "describe")
            assert isinstance(proc, ForkedProcess), zygote.why_not
            assert proc.wait(timeout=60) == 0, open(err).read()
            assert json.loads(open(out).read())["ppid"] == zygote.info["pid"]
            assert psutil.Process(zygote.info["pid"]).ppid() == mother.zygote.info["pid"]
        finally:
            zygote.close()
        assert zygote._proc.poll() == 0 and len(mother.served) == 1
        other = Zygote(dict(env, PYTHONHASHSEED="7"), str(tmp_path / "z2"))
        other.start()
        try:
            proc, _, _ = spawn(other, tmp_path, "describe")
            assert isinstance(other._proc, subprocess.Popen) and isinstance(proc, ForkedProcess)
            assert proc.wait(timeout=120) == 0
        finally:
            other.close()
        assert len(mother.served) == 1
        request = Client(mother.env()[MOTHER], family="AF_UNIX", authkey=bytes.fromhex(mother.env()[MOTHER_KEY]))
        with request:
            request.send((("/another/bin/python", sys.prefix), ZYGOTE_MODULE, [], env, os.devnull, os.devnull))
            assert request.recv() == ("refused", "another interpreter than the mother's: ('/another/bin/python', "
                                                 f"{sys.prefix!r})")
    finally:
        mother.close()
    assert ended(mother.zygote.info["pid"])


def test_shadowed_finds_packages_modules_and_extensions(tmp_path):
    (tmp_path / "a" / "torch").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    for name in ("rich.py", "psutil.cpython-311-x86_64-linux-gnu.so", "numpy-2.4.0.dist-info", "keras.py"):
        (tmp_path / "b" / name).write_text("")
    path = os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "missing")])
    assert shadowed(path, ["torch", "rich", "psutil", "numpy", "sys"]) == ["psutil", "rich", "torch"]
    assert shadowed("", ["torch"]) == []


def test_a_zygote_with_threads_is_not_forked(tmp_path):
    # OpenBLAS starts its pool at import when allowed more than one thread: forking then is unsafe.
    env = dict(LaunchConfig(None, str(tmp_path / "home")).base_env(), OPENBLAS_NUM_THREADS="2")
    zygote = Zygote(env, str(tmp_path / "z"))
    zygote.start()
    try:
        proc, out, _ = spawn(zygote, tmp_path, "describe")
        assert isinstance(proc, subprocess.Popen)
        assert "threads after its imports" in zygote.why_not
        assert proc.wait(timeout=120) == 0
    finally:
        zygote.close()


def test_the_sessions_ranks_are_forked_from_its_zygote(dist_ranks, conformance_state):
    zygote = conformance_state.manager.zygote
    assert zygote is not None and zygote.serving, zygote and zygote.why_not
    dist_ranks.run(torch_cells.whoami)
    for pid in dist_ranks.pids:
        assert psutil.Process(pid).ppid() == zygote.info["pid"]

