"""Know before you run: per-rank memory and NVMe estimates, the machine's view, and the pre-flight check.

``estimate_memory(model_or_param_count, ...)`` itemises what the runtime
allocates for every setting (stage × offload) and checks each against this
machine; ``preflight(model, cfg)`` is the check ``infinity.initialize`` runs
before allocating anything. Both read the RuntimePlan (``plan_runtime``): every
sizing decision the engine acts on, made in one place (runtime_plan.py), which
the engine allocates as it is.
"""

from infinity.estimate.activations import Activations, gpt_activations
from infinity.estimate.estimate import Fit, MemoryEstimate, SettingEstimate, estimate_memory
from infinity.estimate.inference import (
    DecoderShape,
    InferenceEstimate,
    decoder_shape,
    estimate_inference,
    preflight_inference,
)
from infinity.estimate.machine import (
    DiskInfo,
    GPUInfo,
    MachineView,
    describe_machine,
    machine_view,
    process_rss_nbytes,
    runtime_baseline_nbytes,
)
from infinity.estimate.plan import Item, Problem, Setting, SettingPlan, all_settings
from infinity.estimate.preflight import PreflightError, PreflightResult, preflight
from infinity.estimate.runtime_plan import RuntimePlan, plan_runtime
from infinity.estimate.tune import tune

__all__ = [
    "Activations",
    "DecoderShape",
    "DiskInfo",
    "Fit",
    "GPUInfo",
    "InferenceEstimate",
    "Item",
    "MachineView",
    "MemoryEstimate",
    "PreflightError",
    "PreflightResult",
    "Problem",
    "RuntimePlan",
    "Setting",
    "SettingEstimate",
    "SettingPlan",
    "all_settings",
    "decoder_shape",
    "describe_machine",
    "estimate_inference",
    "estimate_memory",
    "gpt_activations",
    "machine_view",
    "plan_runtime",
    "preflight",
    "preflight_inference",
    "process_rss_nbytes",
    "runtime_baseline_nbytes",
    "tune",
]
