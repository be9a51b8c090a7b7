"""describe_config: the resolved config as a few lines a person reads before a long run."""

from __future__ import annotations

from infinity.config.root import InfinityConfig
from infinity.config.zero import OffloadOptimizerConfig, OffloadParamConfig, nvme_paths


def _n(x: int) -> str:
    return f"{x:,}"


def _onoff(b: bool) -> str:
    return "on" if b else "off"


def _nvme_at(section: OffloadParamConfig | OffloadOptimizerConfig) -> str:
    paths = nvme_paths(section)
    if len(paths) == 1:
        return f"nvme at {paths[0]}"
    return f"nvme striped over {len(paths)} folders ({', '.join(paths)})"


def _param_offload(p: OffloadParamConfig) -> str:
    if p.device == "none":
        return "on the compute device"
    if p.device == "auto":
        return f"auto: host memory or {_nvme_at(p)}, per unit, as the placement planner chooses"
    where = _nvme_at(p) if p.device == "nvme" else "cpu"
    extra = (
        f"; {p.buffer_count} buffers x {_n(p.buffer_size)} elements" if p.device == "nvme" else ""
    )
    cap = f"; max_in_cpu {_n(p.max_in_cpu)}" if p.device == "nvme" else ""
    return f"{where} ({'pinned' if p.pin_memory else 'pageable'}{extra}{cap})"


def _optimizer_offload(o: OffloadOptimizerConfig) -> str:
    if o.device == "none":
        return "on the compute device"
    if o.device == "auto":
        return f"auto: host memory or {_nvme_at(o)}, per unit and array, as the placement planner chooses"
    where = _nvme_at(o) if o.device == "nvme" else "cpu"
    extra = (
        f"; {o.buffer_count} buffers; pipelined read {_onoff(o.pipeline_read)}, "
        f"write {_onoff(o.pipeline_write)}"
        if o.device == "nvme"
        else ""
    )
    return f"{where} ({'pinned' if o.pin_memory else 'pageable'}{extra})"


def describe_config(cfg: InfinityConfig) -> str:
    """A few readable lines: what will run, what "auto" became, what has no effect here."""
    z = cfg.zero_optimization
    lines = [f"infinity config: world size {cfg.world_size}, {cfg.precision}"]
    lines.append(
        f"  batch      train_batch_size {cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu}"
        f" x accumulation {cfg.gradient_accumulation_steps} x world {cfg.world_size}"
    )
    if cfg.fp16.enabled:
        f = cfg.fp16
        scaling = (
            f"static loss scale {f.loss_scale:g}"
            if f.loss_scale
            else f"dynamic loss scale from 2^{f.initial_scale_power}, window {f.loss_scale_window}, "
            f"hysteresis {f.hysteresis}, min {f.min_loss_scale:g}"
        )
        lines.append(f"  precision  fp16, fp32 master weights, {scaling}")
    elif cfg.bf16.enabled:
        lines.append("  precision  bf16, fp32 master weights")
    else:
        lines.append("  precision  fp32")
    lines.append(f"  zero       stage {z.stage}; sub_group_size {_n(z.sub_group_size)} elements")
    lines.append(f"    params     {_param_offload(z.offload_param)}")
    lines.append(f"    optimizer  {_optimizer_offload(z.offload_optimizer)}")
    if "auto" in (z.offload_param.device, z.offload_optimizer.device):
        budget = cfg.host_budget
        lines.append(
            "    host memory budget  "
            + (budget.describe() if budget else "the available host memory less a safety margin")
        )
    if z.stage == 3:
        lines.append(
            f"    prefetch {_n(z.stage3_prefetch_bucket_size)}, persistence threshold "
            f"{_n(z.stage3_param_persistence_threshold)}, max live {_n(z.stage3_max_live_parameters)}, "
            f"reuse distance {_n(z.stage3_max_reuse_distance)} (elements)"
        )
    if cfg.optimizer is not None:
        o, p = cfg.optimizer, cfg.optimizer.params
        mode = "decoupled weight decay" if o.adamw_mode else "L2 weight decay"
        lines.append(
            f"  optimizer  {o.type} ({mode}): lr {p.lr:g}, betas ({p.betas[0]:g}, {p.betas[1]:g}), "
            f"eps {p.eps:g}, weight_decay {p.weight_decay:g}"
            + (
                " (HF Trainer's default: none on biases and norm weights)"
                if o.hf_trainer_default
                else ""
            )
        )
    else:
        lines.append("  optimizer  none in the config (pass one to initialize())")
    if cfg.scheduler is not None:
        params = ", ".join(
            f"{k} {v}"
            for k, v in cfg.scheduler.params.__dict__.items()
            if k != "last_batch_iteration"
        )
        lines.append(f"  scheduler  {cfg.scheduler.type}: {params}")
    clip = f"{cfg.gradient_clipping:g}" if cfg.gradient_clipping else "off"
    lines.append(
        f"  clipping   {clip}; steps_per_print {cfg.steps_per_print or '-'}; preflight {_onoff(cfg.preflight)}; "
        f"non-finite steps {'skipped' if cfg.skip_nonfinite_steps else 'applied, with a warning'}"
    )
    a = cfg.aio
    lines.append(
        f"  aio        block {_n(a.block_size)} B, queue depth {a.queue_depth}, threads {a.thread_count}, "
        f"engine {a.engine}, O_DIRECT {_onoff(a.o_direct)}"
    )
    ac = cfg.activation_checkpointing
    if ac.cpu_checkpointing or ac.partition_activations:
        where = [
            w
            for w, on in (
                ("in host memory", ac.cpu_checkpointing),
                ("split across model-parallel ranks", ac.partition_activations),
            )
            if on
        ]
        lines.append(
            f"  checkpointing  infinity.checkpointing keeps checkpoint inputs {' and '.join(where)}"
        )
    if cfg.auto_filled:
        lines.append('  "auto" filled:')
        lines.extend(f"    {path} <- {source}" for path, source in cfg.auto_filled)
    ignored = cfg.ignored_keys()
    if ignored:
        lines.append("  accepted, no effect here: " + ", ".join(ignored))
    return "\n".join(lines)
