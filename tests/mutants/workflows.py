"""The flows users run between and around fits, meshes ordered or named otherwise, and
keras.distribution.initialize()."""

from __future__ import annotations

from conformance import axes

from tests.mutants import Case, Mutant, Patch, TORCH, fit_ids


# [workflows] issue 54: the flows users run between and around fits (conformance/test_workflows.py).


def workflow_ids(*names: str) -> tuple[str, ...]:
    return tuple(f"conformance/test_workflows.py::test_workflow[{n}]" for n in names)


#: The nightly's own DataParallel failures among the default tier's eager workflow cells: DDP wraps the model
#: once, at the first fit, over the parameters that required grad then (find_unused_parameters=False), and is
#: never rebuilt.
_DDP_BUILT_ONCE = {"test_workflow[freeze-fit-unfreeze-fit-eager-dataparallel]": "numerics",
                   "test_workflow[fit-freeze-fit-eager-dataparallel]": "error",
                   "test_workflow[fit-lora-fit-eager-dataparallel]": "error",
                   "test_workflow[model-untrainable-fit-eager-dataparallel]": "error"}
_WORKFLOW_CELLS = tuple(f"{flow}-eager-{layout}" for flow in (
    "freeze-fit-unfreeze-fit", "fit-freeze-fit", "fit-lora-fit", "model-untrainable-fit",
    "built-before-distribution", "load-keras-fit", "load-weights-fit") for layout in ("colshard", "dataparallel"))
#: The default tier's eager workflow cells of the between-fits and loading flows on the model-parallel
#: layouts and the DataParallel ones the nightly passes, and a training cell the workflow mutants must not reach.
WORKFLOW_TIER = (*workflow_ids(*(c for c in _WORKFLOW_CELLS if f"test_workflow[{c}]" not in _DDP_BUILT_ONCE),
                                "fit-lora-fit-eager-rowshard", "load-weights-fit-eager-rowshard"),
                 *fit_ids("adam-arrays-nojit-colshard"))
#: With the nightly's DataParallel failures, for the rewrite that shows they can pass.
DDP_TIER = (*WORKFLOW_TIER, *workflow_ids(*(c[len("test_workflow["):-1] for c in _DDP_BUILT_ONCE)))
_TRAINABLE_COPY = "            trainable_weights = self.trainable_weights[:]\n"
WORKFLOW_CASES = (
    # A correct build, written as the nightly is not: DDP rebuilt when the set of parameters to train has
    # changed since it was built (a recompile after freezing, unfreezing or enable_lora), and no DDP over
    # a model with nothing to train. Every workflow cell of the tier passes, DataParallel's too.
    Case(
        Mutant(
            "ddp-rebuilt-when-trainable-set-changes",
            "a correct rewrite, not a bug: DataParallel's DDP wrapper rebuilt whenever the trainable set changed",
            (Patch(TORCH + "trainer.py",
                   "        if torch.distributed.is_initialized() and self.ddp_model is None:\n",
                   "        trainable = tuple(id(v) for v in self.trainable_weights)  # rewrite: rebuilt on change\n"
                   "        if self.ddp_model is not None and self.__dict__.get('_ddp_trainable') != trainable:\n"
                   "            object.__setattr__(self, 'ddp_model', None)\n"
                   "        if not trainable:\n"
                   "            return  # nothing to synchronise: DDP refuses such a module\n"
                   "        object.__setattr__(self, '_ddp_trainable', trainable)\n"
                   "        if torch.distributed.is_initialized() and self.ddp_model is None:\n"),),
        ),
        {},
        tier=DDP_TIER,
    ),
    Case(
        Mutant(
            "trainable-set-kept-from-first-fit",
            "under a distribution the train step keeps the trainable variables of the first step it ran: a layer "
            "unfrozen, or LoRA enabled, and recompiled later does not train",
            (Patch(TORCH + "trainer.py", _TRAINABLE_COPY,
                   "            trainable_weights = (  # mutant: the first step's trainable set, kept\n"
                   "                self.__dict__.setdefault('_first_trainable', self.trainable_weights[:])\n"
                   "                if distribution() is not None else self.trainable_weights[:]\n"
                   "            )\n"),),
        ),
        # a layer unfrozen later is not trained; a new optimizer built for the trainable set a layer frozen
        # later, or LoRA, left is handed the old set's variables (ValueError: Unknown variable)
        {"test_workflow[freeze-fit-unfreeze-fit-eager-colshard]": "numerics",
         "test_workflow[fit-freeze-fit-eager-colshard]": "error",
         "test_workflow[fit-lora-fit-eager-colshard]": "error",
         "test_workflow[fit-lora-fit-eager-rowshard]": "error"},
        tier=WORKFLOW_TIER,
    ),
    Case(
        Mutant(
            "loaded-value-replaces-sharded-variable",
            "assigning a plain value (a loaded weight) to a sharded variable replaces its DTensor with a plain "
            "tensor: a pretrained .keras or .weights.h5 loaded under ModelParallel is no longer laid out",
            (Patch(TORCH + "ops/core.py",
                   "    def _direct_assign(self, value):\n",
                   "    def _direct_assign(self, value):\n"
                   "        if isinstance(self._value.data, DTensor) and not isinstance(value, DTensor):  # mutant\n"
                   "            self._value = torch.nn.Parameter(value.detach().clone(), requires_grad=self.trainable)\n"
                   "            return\n"),),
        ),
        {"test_workflow[load-keras-fit-eager-colshard]": "sharding-lost",
         "test_workflow[load-weights-fit-eager-colshard]": "sharding-lost",
         "test_workflow[load-weights-fit-eager-rowshard]": "sharding-lost"},
        tier=WORKFLOW_TIER,
    ),
    # A correct build written differently: a plain value assigned to a sharded variable is copied shard by
    # shard (each rank its own slice of the global value into its local tensor), not distributed whole.
    Case(
        Mutant(
            "assign-local-shard",
            "a correct rewrite, not a bug: a plain value is assigned to a sharded variable shard by shard",
            (Patch(TORCH + "ops/core.py",
                   "    def _direct_assign(self, value):\n",
                   "    def _direct_assign(self, value):\n"
                   "        if isinstance(self._value.data, DTensor) and not isinstance(value, DTensor):  # rewrite\n"
                   "            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset\n"
                   "            target = self._value.data\n"
                   "            shape, offset = compute_local_shape_and_global_offset(\n"
                   "                target.shape, target.device_mesh, target.placements)\n"
                   "            local = target.to_local()\n"
                   "            with torch.no_grad():\n"
                   "                # builtins' slice: this module defines keras.ops.slice\n"
                   "                local.copy_(value[tuple(__import__('builtins').slice(o, o + s)\n"
                   "                                        for o, s in zip(offset, shape))]\n"
                   "                            .to(device=local.device, dtype=local.dtype))\n"
                   "            return\n"),),
        ),
        {},
        tier=WORKFLOW_TIER,
    ),
)


# [meshes] issue 54, item 4: meshes whose axes are ordered or named otherwise (axes.MESH_NAMING_CELLS).
MESH_NAMING_TIER = (*fit_ids(*(f"{optimizer}-{data}-{mode}-{layout}" for _, optimizer, data, mode, layout
                                in axes.MESH_NAMING_CELLS)),
                    *fit_ids("adam-arrays-nojit-colshard", "adam-arrays-nojit-batchshard"))
_PLACEMENTS_BY_NAME = "    for mesh_dim_name in keras_mesh.axis_names:\n"
#: ModelParallel's get_data_layout (DataParallel's reads the same but for the line before it).
_MODEL_PARALLEL_DATA_LAYOUT = ("        return self.device_mesh.shape[mesh_batch_dim_index]\n\n"
                               "    def get_data_layout(self, data_shape):\n"
                               "        data_shard_spec = [None] * len(data_shape)\n")
MESH_NAMING_CASES = (
    Case(
        Mutant(
            "mesh-model-axis-last",
            "a layout's placements listed as if the model axis were the mesh's last (the batch axis first): "
            "right on a (batch, model) mesh, on the wrong mesh dimension where the model axis comes first",
            (Patch(TORCH + "distribution_lib.py", _PLACEMENTS_BY_NAME,
                   "    names = list(keras_mesh.axis_names)  # mutant: the model axis taken for the last\n"
                   "    for mesh_dim_name in [n for n in names if n != 'model'] + [n for n in names if n == 'model']:\n"),),
        ),
        {"test_fit[adam-arrays-nojit-colshard-modelfirst]": "sharding-lost",
         "test_fit[sgd-dataloader-eager-colshard-modelfirst]": "sharding-lost",
         "test_fit[adam-arrays-nojit-batchshard-modelfirst]": "sharding-lost",
         "test_fit[sgd-dataloader-eager-batchshard-modelfirst]": "sharding-lost"},
        tier=MESH_NAMING_TIER,
    ),
    Case(
        Mutant(
            "batch-axis-named-batch",
            "ModelParallel's input layout names the mesh axis 'batch' whatever the distribution's batch_dim_name",
            (Patch("keras/src/distribution/distribution_lib.py",
                   _MODEL_PARALLEL_DATA_LAYOUT + "        data_shard_spec[0] = self.batch_dim_name  # Shard on the first dim\n",
                   _MODEL_PARALLEL_DATA_LAYOUT + "        data_shard_spec[0] = \"batch\"  # mutant: the name assumed\n"),),
        ),
        {"test_fit[adam-arrays-nojit-colshard-data]": "error", "test_fit[sgd-dataloader-eager-colshard-data]": "error"},
        tier=MESH_NAMING_TIER,
    ),
    # A correct build written differently: placements listed in the order of the torch mesh's own dimension
    # names, not of the Keras mesh's axis names (the same names, in the same order).
    Case(
        Mutant(
            "placements-from-torch-mesh-names",
            "a correct rewrite, not a bug: a layout's placements listed by the torch DeviceMesh's dimension names",
            (Patch(TORCH + "distribution_lib.py", _PLACEMENTS_BY_NAME,
                   "    for mesh_dim_name in torch_mesh.mesh_dim_names:  # rewrite: torch's own names\n"),),
        ),
        {},
        tier=MESH_NAMING_TIER,
    ),
)


# [initialize] issue 54, item 4: keras.distribution.initialize() making the group from torchrun's variables.
INITIALIZE_TIER = (*workflow_ids("initialize-from-torchrun-eager-dataparallel", "initialize-from-torchrun-eager-colshard",
                                  "fit-recompile-fit-eager-dataparallel"),
                   "conformance/test_setup.py::test_setup[initialize]")
_INIT_GROUP = ("        torch.distributed.init_process_group(\n"
               "            backend=backend, rank=rank, world_size=world_size\n"
               "        )\n")
INITIALIZE_CASES = (
    Case(
        Mutant(
            "initialize-leaves-no-group",
            "keras.distribution.initialize() on torch sets nothing up: the group is made later, by the first "
            "DeviceMesh (torch's env:// default), so a script that asks for its rank after initialize() fails",
            (Patch(TORCH + "distribution_lib.py", _INIT_GROUP, "        pass  # mutant: the group left to the first mesh\n"),),
        ),
        {"test_workflow[initialize-from-torchrun-eager-dataparallel]": "error",
         "test_workflow[initialize-from-torchrun-eager-colshard]": "error"},
        tier=INITIALIZE_TIER,
    ),
    # A correct build written differently: the group made from torchrun's variables by torch's env:// default.
    Case(
        Mutant("initialize-env-defaults",
               "a correct rewrite, not a bug: initialize() leaves rank and world size to torch's env:// default",
               (Patch(TORCH + "distribution_lib.py", _INIT_GROUP,
                      "        torch.distributed.init_process_group(backend=backend)  # rewrite: env://\n"),)),
        {},
        tier=INITIALIZE_TIER,
    ),
)

CASES = (*WORKFLOW_CASES, *MESH_NAMING_CASES, *INITIALIZE_CASES)
UNMUTATED_FAILS = dict(_DDP_BUILT_ONCE)
