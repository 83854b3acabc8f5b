"""Mutants that cost time, not verdicts: a slow optimizer update and step, DataParallel without DDP or
with a second gradient sync (the step-time benchmarks' and the communication budget's proofs)."""

from __future__ import annotations

from tests.mutants import Case, Mutant, Patch, fit_ids

SLOW_OPTIMIZER = Mutant(
    name="slow-optimizer-update",
    imitates="a step-time regression: extra host work in every optimizer update",
    patches=(
        Patch(
            "keras/src/optimizers/base_optimizer.py",
            "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
            "        __import__(\"time\").sleep(0.1)  # mutant: 100 ms of host work per update\n"
            "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
        ),
    ),
)


_DDP_WRAP = (
    "                object.__setattr__(\n"
    "                    self,\n"
    '                    "ddp_model",\n'
    "                    DistributedDataParallel(\n"
    "                        self,\n"
    "                        device_ids=device_ids,\n"
    "                        process_group=process_group,\n"
    "                        find_unused_parameters=False,\n"
    "                    ),\n"
    "                )\n"
)
BEFORE_UPDATE = "            # Update weights\n            with torch.no_grad():\n"

#: A correct DataParallel written differently (issue 25, item 5): no DistributedDataParallel; the
#: weights broadcast once from the group's first process, every gradient all-reduced and averaged
#: after backward. It moves each gradient's bytes once, as DDP's buckets do.
DATAPARALLEL_WITHOUT_DDP = Mutant(
    "dataparallel-without-ddp",
    "a DataParallel trainer that synchronises by hand: weights broadcast once, each gradient all-reduced once",
    (Patch("keras/src/backend/torch/trainer.py",
           "        if torch.distributed.is_initialized() and self.ddp_model is None:\n",
           "        if (torch.distributed.is_initialized() and self.ddp_model is None\n"
           "                and getattr(self, '_sync_group', None) is None):  # mutant\n"),
     Patch("keras/src/backend/torch/trainer.py", _DDP_WRAP,
           "                group = process_group or dist.group.WORLD  # mutant: no DDP\n"
           "                for v in self.weights:\n"
           "                    dist.broadcast(v.value.data, src=dist.get_global_rank(group, 0), group=group)\n"
           "                object.__setattr__(self, '_sync_group', group)\n"),
     Patch("keras/src/backend/torch/trainer.py", BEFORE_UPDATE,
           "            group = getattr(self, '_sync_group', None)  # mutant: each gradient once\n"
           "            for g in gradients if group is not None else ():\n"
           "                if g is not None:\n"
           "                    dist.all_reduce(g, group=group)\n"
           "                    g.div_(dist.get_world_size(group))\n" + BEFORE_UPDATE)),
)

#: DataParallel synchronising every gradient a second time after DDP averaged it: the numbers are
#: identical (an average of equal values), the traffic twice.
DATAPARALLEL_DOUBLE_SYNC = Mutant(
    "dataparallel-double-sync",
    "every gradient all-reduced and averaged again after DDP's buckets averaged it",
    (Patch("keras/src/backend/torch/trainer.py", BEFORE_UPDATE,
           "            for g in gradients if self.ddp_model is not None else ():  # mutant: again\n"
           "                if g is not None:\n"
           "                    dist.all_reduce(g, group=self.ddp_model.process_group)\n"
           "                    g.div_(dist.get_world_size(self.ddp_model.process_group))\n" + BEFORE_UPDATE),),
)


def slow_step(fraction: float) -> Mutant:
    """Every optimizer update adds ``fraction`` of a training step's CPU time in busy host work.

    Calibrated at run time: the update measures the process CPU time between its own calls (one
    step, less the work it added itself), takes the median of the last five (a round's boundary,
    or another pool's round in between, is then an outlier) and spins until the process has spent
    that fraction more, so the step costs ``fraction`` more CPU on any machine and any model,
    loaded or not. CPU time, not wall time: a rank's step spends part of its wall time waiting in
    collectives, so a spin of 10 % of the wall step made the CPU step 13-16 % dearer here (and the
    wall step 11-15 %), a larger regression than the one it was named for.
    """
    name = f"slow-step-{round(fraction * 100)}pct"
    return Mutant(
        name=name,
        imitates=f"a {fraction:.0%} step-time regression in the optimizer update",
        patches=(
            Patch(
                "keras/src/optimizers/base_optimizer.py",
                "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
                f"        _clock, _state = __import__(\"time\").process_time, globals().setdefault(\"_MUTANT\", {{}})  # {name}\n"
                "        _now = _clock()\n"
                "        if \"last\" in _state:\n"
                "            _state[\"steps\"] = (_state.get(\"steps\", []) + [_now - _state[\"last\"] - _state[\"spun\"]])[-5:]\n"
                f"            _end = _now + {fraction!r} * sorted(_state[\"steps\"])[len(_state[\"steps\"]) // 2]\n"
                "            while _clock() < _end:\n"
                "                pass\n"
                "        _state[\"last\"], _state[\"spun\"] = _now, _clock() - _now\n"
                "        if len(grads) == 0:\n            # It is possible that the grad is empty. In this case,\n",
            ),
        ),
    )


#: A sharded variable whose full initial value stays alive beside its shards (a build that distributes a
#: variable and keeps the replicated original it distributed): every number and placement as before, and each
#: rank holds the whole of every sharded variable again. The step-time benchmarks' memory figure shows it
#: (``tests/test_benchmark_facts.py``).
FULL_COPY_KEPT = Mutant(
    "full-copy-kept",
    "a sharded variable keeps the full tensor it was distributed from: every rank holds a whole copy beside its shard",
    (Patch("keras/src/backend/torch/ops/core.py",
           "        dtensor = distribution_lib.distribute_tensor(value, self._layout)\n",
           "        dtensor = distribution_lib.distribute_tensor(value, self._layout)\n"
           "        self._full_copy = value  # mutant: the full original kept alive\n"),),
)

# The kit's case: a build 30 % slower that computes every number as before passes the cells of an optimizer
# update on split kernels and under DataParallel (the benchmarks flag such a build: tests/test_benchmark_against.py,
# docs/benchmarks.md). The build holding full copies is the memory figure's proof (tests/test_benchmark_facts.py).
PERFORMANCE_CASES = (
    Case(slow_step(0.3), {}, tier=fit_ids("adam-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel")),
)
CASES = PERFORMANCE_CASES
