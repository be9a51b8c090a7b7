"""The private framework APIs infinity relies on, with the versions they were checked against.

infinity uses the frameworks' public API where one exists; where none does (the transformers
Trainer has no public hook between its setup and its loop, Lightning's strategies keep their
precision plugin in a private field, transformers' from_pretrained has no hook between building the
model and loading its weights, ...) a module uses a private name, and each such name is listed
here, whichever module of infinity uses it (the adapters in integrations/, zero/hf_init.py,
engine/saving.py, ...): the framework, the dotted name, what kind of use it is, why, and the
parameters we rely on. ``tests/integrations/test_private_api.py`` imports each one from the
installed framework and fails naming the entry and the pinned version when it is gone or its
parameters changed, and reads the source of the modules the table covers to require every private
name they touch on a framework object to be in this table (so the list cannot drift from the code),
and of every module that imports a framework, so that none escapes the check.

Kinds: ``override`` (a class of ours defines a private method of its framework base class, which
the framework calls), ``patch`` (a module of ours replaces a private method on the framework's class
while a context of ours is open, and calls the original for what is not ours), ``call`` (we call
it), ``attribute`` (we read or write a private field the framework's own code sets or reads; the
owner is the class, or the module whose code uses it; ``params`` is None), ``import`` (a name
imported from the framework), ``order`` (a private method we neither define nor call, whose order
of calls to our overrides we rely on; ``params`` is None).

A public-looking name is listed when it is part of a private API's interface (the type it returns,
a field of a parameter it is given): ``through`` names that entry.

Nothing here imports a framework: the table is data, read by the test and by a person.
"""

from __future__ import annotations

from dataclasses import dataclass

# The versions the test extra pins (pyproject.toml) and the table was checked against.
PINNED = {"transformers": "5.23.0", "lightning": "2.6.6", "accelerate": "1.15.0", "torch": "2.13.0"}


@dataclass(frozen=True)
class PrivateApi:
    framework: str  # a key of PINNED
    # importable dotted name: module path, then attributes (the owner, for attributes)
    name: str
    kind: str  # "override", "patch", "call", "attribute" or "import"
    why: str
    params: tuple[str, ...] | None  # the parameter names we rely on (None: not a callable)
    # the modules that use it, as paths in the infinity package ("zero.hf_init" is
    # infinity/zero/hf_init.py)
    used_in: tuple[str, ...]
    through: str = ""  # for a public-looking name: the private entry whose interface it is part of

    @property
    def attribute(self) -> str:
        """The name itself (the last component)."""
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
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._move_model_to_device",
        "override",
        "the engine places the model's state; the Trainer must not move it first",
        ("self", "model", "device"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._wrap_model",
        "override",
        "evaluation after training runs through the engine (under stage 3 only it has the weights)",
        ("self", "model", "training", "dataloader"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._run_epoch",
        "order",
        "layer-major accumulation relies on its loop: each window's batches collected by "
        "get_batch_samples before training_step is called for each of them, in order, then one "
        "optimizer.step() ([Note: the Trainer's window, layer-major])",
        None,
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}.get_batch_samples",
        "override",
        "keeps the window's batches (and num_items_in_batch) for engine.train_batch",
        ("self", "epoch_iterator", "num_batches", "device"),
        ("integrations.transformers",),
        through=f"{_T}._run_epoch",
    ),
    PrivateApi(
        "transformers",
        f"{_T}.current_gradient_accumulation_steps",
        "attribute",
        "the window's batch count _run_epoch sets before its training_steps: the divisor of a loss "
        "not normalised by num_items_in_batch (a short last window's too)",
        None,
        ("integrations.transformers",),
        through=f"{_T}._run_epoch",
    ),
    PrivateApi(
        "transformers",
        f"{_T}._prepare_inputs",
        "call",
        "training_step moves the batch to the device as the Trainer's own step does",
        ("self", "inputs"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._clip_grad_norm",
        "override",
        "the engine clips at its update; the Trainer's clipping would see empty gradients",
        ("self", "model"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._get_grad_norm",
        "override",
        "the norm the Trainer logs is the engine's",
        ("self", "model", "grad_norm"),
        ("integrations.transformers",),
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
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._get_learning_rate",
        "override",
        "the lr the engine's last update used",
        ("self",),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._save_optimizer_and_scheduler",
        "override",
        "checkpoint-N/ holds the engine checkpoint in place of optimizer.pt / scheduler.pt",
        ("self", "output_dir"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._save_scaler",
        "override",
        "the engine's loss scaler is in its checkpoint",
        ("self", "output_dir"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._load_from_checkpoint",
        "override",
        "a resume restores the engine, not the module's state_dict",
        ("self", "resume_from_checkpoint", "model"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._load_optimizer_and_scheduler",
        "override",
        "the engine restored them",
        ("self", "checkpoint"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._load_scaler",
        "override",
        "the engine restored its loss scaler",
        ("self", "checkpoint"),
        ("integrations.transformers",),
    ),
    PrivateApi(
        "transformers",
        f"{_T}._save",
        "override",
        "save_model and every checkpoint-N/ write the model through it: a model without save_pretrained "
        "gets engine.save_pretrained's streamed model.safetensors instead of a gathered state dict",
        ("self", "output_dir", "state_dict"),
        ("integrations.transformers",),
    ),
    # -- torch --------------------------------------------------------------------------------
    PrivateApi(
        "torch",
        "torch.optim.lr_scheduler.LRScheduler._opt_called",
        "attribute",
        "the engine steps in the torch optimizer's place: set on the optimizer so the scheduler does not "
        "warn that optimizer.step() never ran ([Note: the engine steps in the optimizer's place])",
        None,
        ("integrations._shared", "integrations.transformers"),
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
        ("integrations._lightning_shared",),
    ),
    # -- Lightning's Trainer ---------------------------------------------------------------------
    PrivateApi(
        "lightning",
        "lightning.pytorch.plugins.precision.Precision._after_closure",
        "call",
        "InfinityPrecision.optimizer_step runs the closure itself and then Lightning's after-closure hook, "
        "as Precision.optimizer_step does",
        ("self", "model", "optimizer"),
        ("integrations.lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.strategies.strategy.Strategy._precision_plugin",
        "attribute",
        "the field behind the precision_plugin property, which InfinityStrategy redefines to turn "
        "Lightning's stock plugins into InfinityPrecision",
        None,
        ("integrations.lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.strategies.ddp.DDPStrategy._layer_sync",
        "attribute",
        "Trainer(sync_batchnorm=True) sets it; refused (the engine partitions the module as it is)",
        None,
        ("integrations.lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.strategies.ddp.DDPStrategy._setup_model",
        "override",
        "the engine wraps the module, not DistributedDataParallel",
        ("self", "model"),
        ("integrations.lightning",),
    ),
    PrivateApi(
        "lightning",
        "lightning.pytorch.loops.fit_loop._FitLoop._data_source",
        "attribute",
        'the train loader\'s batch size for train_micro_batch_size_per_gpu "auto", as DeepSpeedStrategy '
        "reads it (is_defined(), dataloader())",
        None,
        ("integrations.lightning",),
    ),
    # -- Fabric ----------------------------------------------------------------------------------
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy.Strategy._precision",
        "attribute",
        "the field behind the precision property, which InfinityFabricStrategy redefines",
        None,
        ("integrations.fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy.Strategy._backward_sync_control",
        "attribute",
        "fabric.no_backward_sync asks it; the engine accumulates itself",
        None,
        ("integrations.fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.ddp.DDPStrategy._setup_distributed",
        "override",
        "the config is completed once the process group exists, as Fabric's DeepSpeedStrategy does",
        ("self",),
        ("integrations.fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy.Strategy._convert_stateful_objects_in_state",
        "call",
        "fabric.save's state, stateful objects as their state_dict, as Fabric's strategies save it",
        ("self", "state", "filter"),
        ("integrations.fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy._BackwardSyncControl",
        "import",
        "the interface of fabric.no_backward_sync (no_backward_sync(module, enabled))",
        None,
        ("integrations.fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.strategies.strategy._Sharded",
        "import",
        "marks a strategy whose module_sharded_context fabric.init_module() enters (zero.Init)",
        None,
        ("integrations.fabric",),
    ),
    PrivateApi(
        "lightning",
        "lightning.fabric.utilities.load._move_state_into",
        "import",
        "fabric.load moves the checkpoint's entries into the user's state as Fabric's strategies do",
        ("source", "destination", "keys"),
        ("integrations.fabric",),
    ),
    # -- Accelerate ------------------------------------------------------------------------------
    PrivateApi(
        "accelerate",
        "accelerate.accelerator.Accelerator._models",
        "attribute",
        "the models accelerator.prepare wrapped: prepare() refuses one of them (it owns model and "
        "optimizer)",
        None,
        ("integrations.accelerate",),
    ),
    # -- transformers' from_pretrained under zero.Init ([Note: from_pretrained under zero.Init]) ------
    PrivateApi(
        "transformers",
        "transformers.modeling_utils.PreTrainedModel._load_pretrained_model",
        "patch",
        "from_pretrained has no public hook between building the model on the meta device and loading "
        "its weights: while a zero.Init context is open this staticmethod is replaced, and for a model "
        "built under it the safetensors files are streamed into the shards instead of loaded whole "
        "(anything else goes to the original); it returns (LoadStateDictInfo, disk_offload_index)",
        ("model", "state_dict", "checkpoint_files", "load_config", "expected_keys"),
        ("zero.hf_init",),
    ),
    PrivateApi(
        "transformers",
        "transformers.utils.loading_report.LoadStateDictInfo",
        "import",
        "what the replaced _load_pretrained_model returns (its fields are the parameters): the keys "
        "the checkpoint lacked and those the model lacks, so that from_pretrained initialises the "
        "missing weights and reports as it does after its own load",
        (
            "missing_keys",
            "unexpected_keys",
            "mismatched_keys",
            "error_msgs",
            "conversion_errors",
            "skipped_pp_keys",
        ),
        ("zero.hf_init",),
        through="transformers.modeling_utils.PreTrainedModel._load_pretrained_model",
    ),
    PrivateApi(
        "transformers",
        "transformers.modeling_utils.LoadStateDictConfig.is_quantized",
        "attribute",
        "the load_config _load_pretrained_model is given says whether the model is quantised: such a "
        "load goes to transformers' own code (its quantizer converts the weights as they load)",
        None,
        ("zero.hf_init",),
        through="transformers.modeling_utils.PreTrainedModel._load_pretrained_model",
    ),
    PrivateApi(
        "transformers",
        "transformers.modeling_utils.PreTrainedModel._move_missing_keys_from_meta_to_device",
        "patch",
        "wrapped while a zero.Init context is open: it is given only the missing keys that are not "
        "partitioned stand-ins (it would replace those with new, empty parameters)",
        ("self", "missing_keys", "device_map", "device_mesh", "hf_quantizer"),
        ("zero.hf_init",),
    ),
    PrivateApi(
        "transformers",
        "transformers.initialization._is_hf_initialized",
        "attribute",
        "the flag transformers sets on each tensor its load filled and its init functions "
        "(transformers.initialization) skip: set on what the checkpoint streamed into the shards, so "
        "that only the missing weights are initialised",
        None,
        ("zero.hf_init",),
    ),
    PrivateApi(
        "torch",
        "torch.nn.Module._buffers",
        "attribute",
        "a persistent buffer still on the meta device is replaced in place by CPU memory the checkpoint "
        "is read into, staying registered as it was",
        None,
        ("zero.hf_init",),
    ),
    # -- transformers' save_pretrained and the Hugging Face layout (weights/hf_layout.py) ----------
    PrivateApi(
        "transformers",
        "transformers.integrations.peft.PeftAdapterMixin._hf_peft_config_loaded",
        "attribute",
        "a transformers model with adapters loaded through transformers' own PEFT integration "
        "(load_adapter) saves only the adapters' part: its save_pretrained is left to transformers",
        None,
        ("engine.saving",),
    ),
    PrivateApi(
        "transformers",
        "transformers.modeling_utils.PreTrainedModel._keys_to_ignore_on_save",
        "attribute",
        "the state_dict names save_pretrained leaves out; the streamed save leaves them out too",
        None,
        ("weights.hf_layout",),
    ),
    PrivateApi(
        "transformers",
        "transformers.modeling_utils.PreTrainedModel._keys_to_ignore_on_load_missing",
        "attribute",
        "patterns of keys from_pretrained does not report missing; load_pretrained does not either",
        None,
        ("weights.hf_layout",),
    ),
    PrivateApi(
        "transformers",
        "transformers.modeling_utils.PreTrainedModel._keys_to_ignore_on_load_unexpected",
        "attribute",
        "patterns of keys from_pretrained does not report unexpected; load_pretrained does not either",
        None,
        ("weights.hf_layout",),
    ),
    PrivateApi(
        "transformers",
        "transformers.core_model_loading._weight_conversions",
        "attribute",
        "the weight conversions from_pretrained applied to a model it built (set on the model), "
        "reversed for saving as transformers' revert_weight_conversion does",
        None,
        ("weights.hf_layout",),
    ),
)
