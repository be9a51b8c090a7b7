"""The private framework APIs the adapters rely on, with the versions they were checked against.

The adapters use the frameworks' public API where one exists; where none does (the transformers
Trainer has no public hook between its setup and its loop, Lightning's strategies keep their
precision plugin in a private field, ...) they use a private name, and each such name is listed
here: the framework, the dotted name, what kind of use it is, why, and the parameters we rely on.
``tests/integrations/test_private_api.py`` imports each one from the installed framework and
fails naming the entry and the pinned version when it is gone or its parameters changed, and
reads the adapters' source to require every private name they touch on a framework object to be
in this table (so the list cannot drift from the code).

Kinds: ``override`` (an adapter class defines a private method of its framework base class, which
the framework calls), ``call`` (an adapter calls it), ``attribute`` (an adapter reads or writes a
private field the framework's own code sets; ``params`` is None), ``import`` (a private name
imported from the framework).

Nothing here imports a framework: the table is data, read by the test and by a person.
"""

from __future__ import annotations

from dataclasses import dataclass

# The versions the test extra pins (pyproject.toml) and the table was checked against.
PINNED = {"transformers": "5.23.0", "lightning": "2.6.6", "accelerate": "1.15.0", "torch": "2.13.0"}


@dataclass(frozen=True)
class PrivateApi:
    framework: str  # a key of PINNED
    name: (
        str  # importable dotted name: module path, then attributes (the owner class for attributes)
    )
    kind: str  # "override", "call", "attribute" or "import"
    why: str
    params: tuple[str, ...] | None  # the parameter names we rely on (None: not a callable)
    used_in: tuple[str, ...]  # the adapter modules (infinity/integrations/<name>.py)

    @property
    def attribute(self) -> str:
        """The private name itself (the last component)."""
        return self.name.rsplit(".", 1)[-1]


_T = "transformers.trainer.Trainer"

PRIVATE_APIS: tuple[PrivateApi, ...] = (
    # -- transformers: the Trainer's training loop runs the engine in place of the accelerator ----
    PrivateApi(
        "transformers",
        f"{_T}._prepare_for_training",
        "override",
        "the one place between the Trainer's setup and its loop where the model and optimizer are "
        "prepared: InfinityTrainer builds the engine there instead",
        ("self", "max_steps", "train_dataloader", "resume_from_checkpoint"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._move_model_to_device",
        "override",
        "the engine places the model's state; the Trainer must not move it first",
        ("self", "model", "device"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._wrap_model",
        "override",
        "evaluation after training runs through the engine (under stage 3 only it has the weights)",
        ("self", "model", "training", "dataloader"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._prepare_inputs",
        "call",
        "training_step moves the batch to the device as the Trainer's own step does",
        ("self", "inputs"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._clip_grad_norm",
        "override",
        "the engine clips at its update; the Trainer's clipping would see empty gradients",
        ("self", "model"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._get_grad_norm",
        "override",
        "the norm the Trainer logs is the engine's",
        ("self", "model", "grad_norm"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._maybe_log_save_evaluate",
        "override",
        "the Trainer's logging, saving and evaluation at each update, given the engine's norm",
        (
            "self",
            "tr_loss",
            "grad_norm",
            "model",
            "trial",
            "epoch",
            "ignore_keys_for_eval",
            "start_time",
            "learning_rate",
        ),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._get_learning_rate",
        "override",
        "the lr the engine's last update used",
        ("self",),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._save_optimizer_and_scheduler",
        "override",
        "checkpoint-N/ holds the engine checkpoint in place of optimizer.pt / scheduler.pt",
        ("self", "output_dir"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._save_scaler",
        "override",
        "the engine's loss scaler is in its checkpoint",
        ("self", "output_dir"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._load_from_checkpoint",
        "override",
        "a resume restores the engine, not the module's state_dict",
        ("self", "resume_from_checkpoint", "model"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._load_optimizer_and_scheduler",
        "override",
        "the engine restored them",
        ("self", "checkpoint"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._load_scaler",
        "override",
        "the engine restored its loss scaler",
        ("self", "checkpoint"),
        ("transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._save",
        "override",
        "save_model and every checkpoint-N/ write the model through it: a model without save_pretrained "
        "gets engine.save_pretrained's streamed model.safetensors instead of a gathered state dict",
        ("self", "output_dir", "state_dict"),
        ("transformers",),
    ),
    # -- torch --------------------------------------------------------------------------------
    PrivateApi(
        "torch",
        "torch.optim.lr_scheduler.LRScheduler._opt_called",
        "attribute",
        "the engine steps in the torch optimizer's place: set on the optimizer so the scheduler does not "
        "warn that optimizer.step() never ran ([Note: the engine steps in the optimizer's place])",
        None,
        ("_shared", "transformers"),
    ),
    PrivateApi(
        "torch",
        "torch.nn.Module._load_from_state_dict",
        "call",
        "a submodule's own entries of a whole-model file, written while its parameters are gathered",
        (
            "self",
            "state_dict",
            "prefix",
            "local_metadata",
            "strict",
            "missing_keys",
            "unexpected_keys",
            "error_msgs",
        ),
        ("_lightning_shared",),
    ),
    # -- Lightning's Trainer ---------------------------------------------------------------------
    PrivateApi(
        "lightning",
        "lightning.pytorch.plugins.precision.Precision._after_closure",
        "call",
        "InfinityPrecision.optimizer_step runs the closure itself and then Lightning's after-closure hook, "
        "as Precision.optimizer_step does",
        ("self", "model", "optimizer"),
        ("lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.strategies.strategy.Strategy._precision_plugin",
        "attribute",
        "the field behind the precision_plugin property, which InfinityStrategy redefines to turn "
        "Lightning's stock plugins into InfinityPrecision",
        None,
        ("lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.strategies.ddp.DDPStrategy._layer_sync",
        "attribute",
        "Trainer(sync_batchnorm=True) sets it; refused (the engine partitions the module as it is)",
        None,
        ("lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.strategies.ddp.DDPStrategy._setup_model",
        "override",
        "the engine wraps the module, not DistributedDataParallel",
        ("self", "model"),
        ("lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.loops.fit_loop._FitLoop._data_source",
        "attribute",
        'the train loader\'s batch size for train_micro_batch_size_per_gpu "auto", as DeepSpeedStrategy '
        "reads it (is_defined(), dataloader())",
        None,
        ("lightning",),
    ),
    # -- Fabric ----------------------------------------------------------------------------------
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy.Strategy._precision",
        "attribute",
        "the field behind the precision property, which InfinityFabricStrategy redefines",
        None,
        ("fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy.Strategy._backward_sync_control",
        "attribute",
        "fabric.no_backward_sync asks it; the engine accumulates itself",
        None,
        ("fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.ddp.DDPStrategy._setup_distributed",
        "override",
        "the config is completed once the process group exists, as Fabric's DeepSpeedStrategy does",
        ("self",),
        ("fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy.Strategy._convert_stateful_objects_in_state",
        "call",
        "fabric.save's state, stateful objects as their state_dict, as Fabric's strategies save it",
        ("self", "state", "filter"),
        ("fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy._BackwardSyncControl",
        "import",
        "the interface of fabric.no_backward_sync (no_backward_sync(module, enabled))",
        None,
        ("fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy._Sharded",
        "import",
        "marks a strategy whose module_sharded_context fabric.init_module() enters (zero.Init)",
        None,
        ("fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.utilities.load._move_state_into",
        "import",
        "fabric.load moves the checkpoint's entries into the user's state as Fabric's strategies do",
        ("source", "destination", "keys"),
        ("fabric",),
    ),
    # -- Accelerate ------------------------------------------------------------------------------
    PrivateApi(
        "accelerate",
        "accelerate.accelerator.Accelerator._models",
        "attribute",
        "the models accelerator.prepare wrapped: prepare() refuses one of them (it owns model and "
        "optimizer)",
        None,
        ("accelerate",),
    ),
)
