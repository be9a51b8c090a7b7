"""The one change that would help a traced run most, from its step breakdown and its plan.

[Note: advice from the figures]
Advice is given only where the figures support it:
- the part it addresses must be the largest of the exposed parts (exposed
  read, exposed write, optimizer) and at least ``MIN_SHARE`` of the step;
- a saving is quoted only where the plan says what would change: for the
  optimizer, the placement planner's own plan with the budget raised by the
  optimizer state it keeps on NVMe (recorded in the trace when the run was
  planned within a budget). What that change removes is the optimizer's
  waits for its state's reads and writes, as the trace measured them
  (``StepBreakdown.optimizer_io_s``), in the share of that state the plan
  brings into memory; never more than the time the step waited for the
  optimizer (the Adam arithmetic stays). The NVMe bytes per step the planner
  predicts are quoted beside it;
- otherwise the advice names the setting and what the trace shows, and says
  that no prediction was made.
A step that is mostly compute gets no change to make.

Imports only the standard library.
"""

from __future__ import annotations

from typing import Any

from infinity.timeline.breakdown import StepBreakdown

MIN_SHARE = 0.10
"""The least share of the step a part must take for advice about it."""

GIB = 2**30


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def advise(step: StepBreakdown, plan: dict[str, Any]) -> str:
    """One paragraph: what to change, or that nothing in the offload settings would help."""
    exposed = {p: step.parts[p] for p in ("exposed read", "exposed write", "optimizer")}
    part = max(exposed, key=lambda p: exposed[p])
    share = step.share(part)
    if share < MIN_SHARE:
        return (
            f"{step.share('compute'):.0%} of the step is compute and no exposed part reaches "
            f"{MIN_SHARE:.0%}: the I/O is hidden; no offload setting would shorten the step much."
        )
    if part == "optimizer":
        return _optimizer(step, share, plan)
    if part == "exposed read":
        return _reads(step, share, plan)
    return (
        f"{share:.0%} of the step waits for writes or for pool memory that write-backs free: "
        "raise offload_param.buffer_count (more room in the parameter pool), or give the "
        "placement more host memory (host_memory_budget) so less is written home each step. "
        "No prediction was made for this case."
    )


def _optimizer(step: StepBreakdown, share: float, plan: dict[str, Any]) -> str:
    classes = plan.get("optimizer_classes", [])
    state = plan.get("state", {})
    on_nvme = sum(state.get(c, {}).get("nvme_nbytes", 0) for c in classes)
    head = f"{share:.0%} of the step waits for the optimizer"
    if on_nvme == 0:
        return (
            f"{head}, whose state is all in host memory: the CPU Adam itself is the cost "
            "(sub_group_size, or fewer trainable parameters, are what remain)."
        )
    names = ", ".join(c for c in classes if state.get(c, {}).get("nvme_nbytes", 0))
    head += f" (its state on NVMe: {_gib(on_nvme)} of {names})"
    pred = plan.get("prediction")
    if not plan.get("planned") or not isinstance(pred, dict) or "budget_nbytes" not in pred:
        why = (
            pred["error"]
            if isinstance(pred, dict) and "error" in pred
            else "the placement was fixed by the config, not planned within a budget"
        )
        return (
            f'{head}: keep it in host memory — offload_optimizer.device "auto" with a '
            f"host_memory_budget that has room for {_gib(on_nvme)} more. No prediction was made "
            f"({why})."
        )
    now = plan["expected_read_nbytes"] + plan["expected_write_nbytes"]
    then = pred["expected_read_nbytes"] + pred["expected_write_nbytes"]
    kept = on_nvme - pred["optimizer_nvme_nbytes"]
    text = (
        f"{head}: a host_memory_budget of {_gib(pred['budget_nbytes'])} (now "
        f"{_gib(plan['budget_nbytes'])}) keeps {_gib(kept)} of it in memory"
    )
    saved = now - then
    if kept <= 0:
        return text + "; the planner keeps no more of it in memory, so no saving is quoted."
    bytes_note = f"{_gib(saved)} fewer NVMe bytes per step" if saved > 0 else "no fewer NVMe bytes"
    if step.optimizer_io_s <= 0:
        return (
            text + f" ({bytes_note}), but the trace shows the optimizer never waiting for its "
            "state's I/O, so no saving is quoted."
        )
    kept_share = min(kept / on_nvme, 1.0)
    seconds = optimizer_saving_s(step, plan)
    return (
        text + f": the optimizer waited {step.optimizer_io_s:.2f} s/step for its state's reads "
        f"and writes, {kept_share:.0%} of which the change keeps in memory: -{seconds:.2f} s/step "
        f"(at most the time the step waited for the optimizer; {bytes_note})."
    )


def optimizer_saving_s(step: StepBreakdown, plan: dict[str, Any]) -> float | None:
    """The seconds per step the optimizer advice predicts a budget keeping its state in memory
    saves (see the note): None where the trace holds no such prediction or no wait it removes."""
    classes = plan.get("optimizer_classes", [])
    on_nvme = sum(plan.get("state", {}).get(c, {}).get("nvme_nbytes", 0) for c in classes)
    pred = plan.get("prediction")
    if not on_nvme or not plan.get("planned") or not isinstance(pred, dict):
        return None
    if "optimizer_nvme_nbytes" not in pred or step.optimizer_io_s <= 0:
        return None
    kept = on_nvme - pred["optimizer_nvme_nbytes"]
    if kept <= 0:
        return None
    return min(step.optimizer_io_s * min(kept / on_nvme, 1.0), step.parts["optimizer"])


def _reads(step: StepBreakdown, share: float, plan: dict[str, Any]) -> str:
    param = plan.get("state", {}).get("param", {}).get("nvme_nbytes", 0)
    text = f"{share:.0%} of the step waits for parameter reads the prefetch did not hide"
    if param and plan.get("planned"):
        return (
            text + f": {_gib(param)} of parameters rest on NVMe; a larger host_memory_budget "
            "keeps more of them in memory, or a larger stage3_prefetch_bucket_size starts their "
            "reads earlier. No prediction was made for this case."
        )
    return (
        text + ": raise stage3_prefetch_bucket_size (reads start earlier) or "
        "offload_param.buffer_count (more units can be read ahead). No prediction was made for "
        "this case."
    )
