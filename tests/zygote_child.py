"""Run by tests/test_zygote.py as ``python -m tests.zygote_child MODE``: says what process it is."""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import tempfile
import time

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "describe":
        import torch

        print(json.dumps({
            "argv": sys.argv[1:],
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "sid": os.getsid(0),
            "cwd": os.getcwd(),
            "env": os.environ.get("KDC_TEST_CHILD"),
            "zygote_only": os.environ.get("KDC_ZYGOTE_ONLY"),
            "threads": torch.get_num_threads(),
            "keras_imported": "keras" in sys.modules,
            "main": sys.modules["__main__"].__file__,
            "sys_path": sys.path,
            "tmp": tempfile.gettempdir(),
            "frozen": gc.get_freeze_count(),
        }))
        print("to stderr", file=sys.stderr)
    elif mode == "vec-isa":
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list

        probed = valid_vec_isa_list.cache_info().currsize  # before this process asks
        print(json.dumps({"probed": probed, "isa": [str(isa) for isa in valid_vec_isa_list()]}))
    elif mode == "first-compile":
        import torch

        before = set(sys.modules)
        torch.compile(lambda x: x * 2, backend=sys.argv[2])(torch.ones(2))
        print(json.dumps({"imported": len(set(sys.modules) - before)}))
    elif mode == "jax":
        import jax

        names = ("jax_platforms", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_compilation_cache_max_size")
        print(json.dumps({"config": {name: getattr(jax.config, name) for name in names},
                          "devices": [d.platform for d in jax.devices()]}))
    elif mode == "draw":
        import random

        import numpy

        print(json.dumps({"numpy": numpy.random.rand(), "random": random.random()}))
    elif mode == "exit":
        sys.exit(int(sys.argv[2]))
    elif mode == "raise":
        raise ValueError("the child's own error")
    elif mode == "sleep":
        time.sleep(60)
    elif mode == "source-names":  # which of these files dynamo's names of lines were read for
        from torch._dynamo import funcname_cache

        print(json.dumps({os.path.basename(path): path in funcname_cache.cache for path in sys.argv[2:]}))
    elif mode == "huge-pages":  # how much of what it shares with the zygote 2 MiB pages map here
        from keras_dtensor_conformance.rank import huge_pages

        print(json.dumps({"mib": huge_pages.huge_pages_mib()}))
    elif mode == "kill-self":
        os.kill(os.getpid(), signal.SIGKILL)
