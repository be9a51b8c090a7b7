"""Know before you run: what a run allocates per rank, where its state rests, and whether it fits here.

One concept per module:

- the sizing model the engine allocates: ``runtime_plan.py`` (``RuntimePlan``
  and its parts, ``plan_runtime``; [Note: one sizing model]) and
  ``rank_plan.py`` (``plan_runtime_for_rank``: initialize's RuntimePlan);
- the placement planner: ``placement.py`` (``place_in_budget``: the homes of
  "auto" sections), ``budget.py`` (the host-memory budget), ``knapsack.py``,
  ``traffic.py`` (NVMe bytes per step);
- the itemised estimate: ``setting.py`` (``ZeroSetting``: stage × offload),
  ``breakdown.py`` (``Breakdown``: a setting's items by resource and phase),
  ``itemise.py`` (``Itemiser``: a RuntimePlan read into a Breakdown),
  ``rules.py`` (what the estimator adds: measured overheads, page and block
  rounding), ``fit.py`` (``check_fit`` against a machine), ``tune.py``,
  ``estimate.py`` (``estimate_memory``, ``EstimateOptions``), ``report.py``
  (``MemoryEstimate`` as a table and a dict);
- activations: ``activations.py`` (infinity GPT's coefficients) and
  ``traced.py`` (any model, counted on fake tensors);
- LoRA: ``lora.py`` (``with_lora``: PEFT's adapters over a model, the base
  frozen as a run freezes it; ``lora_footprint``: the frozen base and the
  adapters as a setting's RuntimePlan holds them) and ``largest.py``
  (``largest_base``: real Llama shapes, each estimated, against a ``Budget``);
- the machine: ``machine.py`` (``MachineView``, the process baseline);
- the run: ``model.py`` (``ModelSpec``), ``context.py`` (``RunContext``) and
  ``preflight.py`` (the check ``infinity.initialize`` runs before it
  allocates).

The inference estimate (``estimate_inference``) is the inference room's
(``infinity.inference.estimate``); it uses the public names below.
"""

from infinity.estimate.activations import Activations, gpt_activations
from infinity.estimate.breakdown import Breakdown, Item, Problem, Resource
from infinity.estimate.estimate import (
    ActivationOptions,
    EstimateOptions,
    Ranks,
    estimate_config,
    estimate_memory,
    nvme_path_value,
)
from infinity.estimate.fit import Fit, check_fit
from infinity.estimate.itemise import Itemiser, itemise
from infinity.estimate.largest import LLAMA_FAMILY, Budget, LargestBase, largest_base
from infinity.estimate.lora import LoraFootprint, lora_footprint, with_lora
from infinity.estimate.machine import (
    DiskInfo,
    GPUInfo,
    MachineView,
    describe_machine,
    machine_view,
    ranks_on_this_node,
    runtime_baseline_nbytes,
)
from infinity.estimate.model import ModelSpec, describe_model
from infinity.estimate.preflight import (
    PreflightError,
    PreflightResult,
    preflight,
    warn_preflight_skipped,
)
from infinity.estimate.rank_plan import plan_runtime_for_rank
from infinity.estimate.report import MemoryEstimate, SettingEstimate, items_table
from infinity.estimate.runtime_plan import RuntimePlan, partitioner_working_set, plan_runtime
from infinity.estimate.setting import ZeroSetting, all_settings
from infinity.estimate.tune import tune

__all__ = [
    "LLAMA_FAMILY",
    "ActivationOptions",
    "Activations",
    "Breakdown",
    "Budget",
    "DiskInfo",
    "EstimateOptions",
    "Fit",
    "GPUInfo",
    "Item",
    "Itemiser",
    "LargestBase",
    "LoraFootprint",
    "MachineView",
    "MemoryEstimate",
    "ModelSpec",
    "PreflightError",
    "PreflightResult",
    "Problem",
    "Ranks",
    "Resource",
    "RuntimePlan",
    "SettingEstimate",
    "ZeroSetting",
    "all_settings",
    "check_fit",
    "describe_machine",
    "describe_model",
    "estimate_config",
    "estimate_memory",
    "gpt_activations",
    "items_table",
    "itemise",
    "largest_base",
    "lora_footprint",
    "machine_view",
    "nvme_path_value",
    "partitioner_working_set",
    "plan_runtime",
    "plan_runtime_for_rank",
    "preflight",
    "ranks_on_this_node",
    "runtime_baseline_nbytes",
    "tune",
    "warn_preflight_skipped",
    "with_lora",
]
