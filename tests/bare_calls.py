"""Calls the bare group's self-tests run (``tests/test_bare_group.py``): each reads torchrun's variables,
as a user's script would, and returns, raises, dies or hangs."""

from __future__ import annotations

import os
import time


def environment(tag: str) -> dict:
    return {"tag": tag, **{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")},
            "pid": os.getpid()}


def raises() -> None:
    raise ValueError(f"rank {os.environ['RANK']} refuses")


def dies_on_rank_one() -> dict:
    if os.environ["RANK"] == "1":
        os._exit(3)
    return environment("survivor")


def hangs_on_rank_one() -> dict:
    while os.environ["RANK"] == "1":
        time.sleep(0.1)
    return environment("done")
