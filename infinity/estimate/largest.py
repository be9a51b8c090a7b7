"""The largest base that fits a budget: a family of real Llama shapes, each estimated as one model.

Each shape is built on the meta device (transformers' LlamaForCausalLM from its LlamaConfig) in the
dtype the run trains in (as a 16-bit checkpoint's config.json builds it, and as zero.Init stores it:
[Note: zero.Init's dtype] in infinity/zero/init.py), wrapped in LoRA adapters when asked (lora.py:
frozen as a user's run freezes it), and estimated by
``estimate_memory`` under one config: the sizing model the engine allocates with. The config's own
setting is judged (default: stage 3 with parameters and optimizer state on NVMe, what docs/lora.md
runs), with its sizes tuned (tune.py) when that makes it fit. The estimates do not depend on the
budget, so a scan is made once (``scan_family``) and judged against any budget (``judge``): host
memory and NVMe space, each the machine's own unless given, checked by ``check_fit`` as the
estimate checks a machine. A larger budget never names a smaller base.

Sections whose device is "auto" are planned by the placement planner within the config's
``host_memory_budget``, else this machine's available memory: give ``host_memory_budget`` in the
config to plan them for another box.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.estimate.breakdown import Breakdown
from infinity.estimate.estimate import EstimateOptions, estimate_config, estimate_memory
from infinity.estimate.fit import check_fit
from infinity.estimate.lora import with_lora
from infinity.estimate.machine import MachineView, machine_view, runtime_baseline_nbytes
from infinity.estimate.report import MemoryEstimate
from infinity.estimate.runtime_plan import train_dtype
from infinity.estimate.setting import ZeroSetting
from infinity.memory import format_nbytes


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """One Llama architecture: transformers' LlamaConfig fields."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 32000

    def build(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The model on the meta device (nothing allocated), its parameters in ``dtype``."""
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
        )
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


LLAMA_FAMILY: tuple[LlamaShape, ...] = (
    # Each shape is the config.json of the model named, on the Hugging Face Hub:
    LlamaShape("1.1B", 2048, 22, 5632, 32, 4),  # TinyLlama/TinyLlama-1.1B-Chat-v1.0
    LlamaShape("3B", 3200, 26, 8640, 32, 32),  # openlm-research/open_llama_3b
    LlamaShape("7B", 4096, 32, 11008, 32, 32),  # meta-llama/Llama-2-7b-hf
    LlamaShape("13B", 5120, 40, 13824, 40, 40),  # meta-llama/Llama-2-13b-hf
    LlamaShape("33B", 6656, 60, 17920, 52, 52),  # huggyllama/llama-30b (LLaMA's 33B)
    LlamaShape("70B", 8192, 80, 28672, 64, 8),  # meta-llama/Llama-2-70b-hf
)
"""Real Llama shapes, smallest first."""

DEFAULT_SETTING = ZeroSetting(3, "nvme", "nvme")
"""What a shape is judged in without a config: stage 3, parameters and optimizer state on NVMe."""


@dataclasses.dataclass(frozen=True)
class Budget:
    """What a run may use: host memory and NVMe space (None: this machine's, as the estimate reads it)."""

    host_nbytes: int | None = None
    nvme_nbytes: int | None = None

    def view(self, machine: MachineView) -> MachineView:
        """``machine`` with this budget's memory and free space in place of its own."""
        out = machine
        if self.host_nbytes is not None:
            out = dataclasses.replace(out, mem_available_nbytes=self.host_nbytes)
            out = dataclasses.replace(out, hugetlb_free_nbytes=0, cgroup=None)
        if self.nvme_nbytes is not None:
            disks = tuple(dataclasses.replace(d, free_nbytes=self.nvme_nbytes) for d in out.disks)
            out = dataclasses.replace(out, disks=disks)
        return out


@dataclasses.dataclass(frozen=True)
class ShapeEstimate:
    """One shape's estimate (the config's setting, and its tuned sizes when tune.py changes some)."""

    shape: LlamaShape
    estimate: MemoryEstimate

    @property
    def breakdowns(self) -> list[Breakdown]:
        return [e.breakdown for e in self.estimate.settings]


@dataclasses.dataclass(frozen=True)
class ShapeFit:
    """One row of the answer: a shape's needs and whether they fit the budget."""

    shape: LlamaShape
    num_params: int
    trainable_params: int
    nvme_nbytes: int
    host_nbytes: int
    """Host memory per rank (RAM when the device is the CPU), baseline included."""
    setting: str
    fits: bool
    why_not: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LargestBase:
    rows: tuple[ShapeFit, ...]
    """Smallest shape first."""
    budget: Budget
    machine: MachineView

    def to_dict(self) -> dict[str, Any]:
        best = self.largest
        return {
            "budget": dataclasses.asdict(self.budget),
            "mem_available_nbytes": self.machine.mem_available_nbytes,
            "disks": {d.path: d.free_nbytes for d in self.machine.disks},
            "rows": [
                {**dataclasses.asdict(r), "shape": dataclasses.asdict(r.shape)} for r in self.rows
            ],
            "largest": best.shape.name if best is not None else None,
        }

    @property
    def largest(self) -> ShapeFit | None:
        """The largest shape that fits, or None."""
        return next((r for r in reversed(self.rows) if r.fits), None)

    def table(self) -> str:
        host = self.budget.host_nbytes
        nvme = self.budget.nvme_nbytes
        disks = {d.path: d.free_nbytes for d in self.machine.disks}
        lines = [
            "budget     host memory "
            + (
                format_nbytes(host)
                if host is not None
                else f"{format_nbytes(self.machine.mem_available_nbytes)} (available here)"
            )
            + ", NVMe "
            + (
                format_nbytes(nvme)
                if nvme is not None
                else ", ".join(f"{format_nbytes(n)} free at {p}" for p, n in disks.items())
                or "(none asked)"
            ),
            "",
            f"{'base':<6} {'params':>16} {'trainable':>12} {'NVMe':>11} {'host memory':>12}  fits  "
            "setting / why not",
        ]
        for r in self.rows:
            lines.append(
                f"{r.shape.name:<6} {r.num_params:>16,} {r.trainable_params:>12,} "
                f"{format_nbytes(r.nvme_nbytes):>11} {format_nbytes(r.host_nbytes):>12}  "
                f"{'yes ' if r.fits else 'no  '}  {r.setting if r.fits else '; '.join(r.why_not)}"
            )
        best = self.largest
        lines.append("")
        if best is None:
            first = self.rows[0] if self.rows else None
            lines.append(
                "none fits"
                + (
                    f": the smallest, {first.shape.name}, {'; '.join(first.why_not)}"
                    if first
                    else ""
                )
            )
        else:
            lines.append(
                f"largest that fits: {best.shape.name} ({best.num_params:,} parameters) with "
                f"{best.setting}"
            )
        return "\n".join(lines)


def scan_family(
    family: Sequence[LlamaShape] = LLAMA_FAMILY,
    *,
    lora_rank: int | None = None,
    lora_targets: Sequence[str] | None = None,
    options: EstimateOptions | None = None,
) -> tuple[ShapeEstimate, ...]:
    """Each shape estimated (no fit check) under ``options`` (its config's own setting, else
    DEFAULT_SETTING), with LoRA adapters of ``lora_rank`` on ``lora_targets`` when a rank is given;
    the fewest parameters first. The process baseline is measured once, for every shape alike."""
    opts = options or EstimateOptions()
    if opts.baseline_nbytes is None:  # once: every shape's run starts from the same process
        opts = dataclasses.replace(opts, baseline_nbytes=runtime_baseline_nbytes())
    out = []
    for shape in family:
        cfg = estimate_config(opts.config, 1, opts.precision, shape.hidden_size)
        model = shape.build(train_dtype(cfg))
        if lora_rank is not None:
            model = with_lora(model, lora_rank, lora_targets)
        judged = _judged_settings(opts, cfg)
        estimate = estimate_memory(model, dataclasses.replace(opts, machine=False, settings=judged))
        out.append(ShapeEstimate(shape, estimate))
    return tuple(sorted(out, key=lambda s: s.estimate.num_params))


def _judged_settings(opts: EstimateOptions, cfg: InfinityConfig) -> tuple[ZeroSetting, ...]:
    """The settings judged: the options' own, else the config's setting alone, else DEFAULT_SETTING
    (estimate_memory adds each one's tuned sizes)."""
    if opts.settings is not None:
        return opts.settings
    if opts.config is None:
        return (DEFAULT_SETTING,)
    zero = cfg.zero_optimization
    return (ZeroSetting(zero.stage, zero.offload_param.device, zero.offload_optimizer.device),)


def judge(
    scanned: Sequence[ShapeEstimate], budget: Budget = Budget(), machine: MachineView | None = None
) -> LargestBase:
    """Each scanned shape against ``budget`` on ``machine`` (default: this one, read now): fits when
    one of its breakdowns fits (the fastest that does is named), else the one needing the least host
    memory (one the runtime would not refuse, where there is one) is shown with what is short."""
    paths = dict.fromkeys(p for s in scanned for b in s.breakdowns for p, _ in b.nvme_by_path)
    view = budget.view(machine or machine_view(paths))
    rows = []
    for s in scanned:
        fits = [
            (b, check_fit(b, view, ranks_per_node=s.estimate.ranks_per_node)) for b in s.breakdowns
        ]
        ok = [(b, f) for b, f in fits if f.ok]
        b, f = (
            min(ok, key=lambda bf: bf[0].speed_key())
            if ok
            else min(fits, key=lambda bf: (bool(bf[0].problems), _host(bf[0]), bf[0].nvme_nbytes))
        )
        rt = b.runtime
        trainable = (
            sum(u.layout.numel for u in rt.unit_map.units if u.trainable) if rt is not None else 0
        )
        rows.append(
            ShapeFit(
                shape=s.shape,
                num_params=s.estimate.num_params,
                trainable_params=trainable,
                nvme_nbytes=b.nvme_nbytes,
                host_nbytes=_host(b),
                setting=b.setting.words(),
                fits=f.ok,
                why_not=f.reasons,
            )
        )
    return LargestBase(tuple(rows), budget, view)


def _host(b: Breakdown) -> int:
    return b.ram_nbytes if b.device_type == "cpu" else b.host_nbytes


def largest_base(
    family: Sequence[LlamaShape] = LLAMA_FAMILY,
    budget: Budget = Budget(),
    *,
    lora_rank: int | None = None,
    lora_targets: Sequence[str] | None = None,
    options: EstimateOptions | None = None,
    **estimate: Any,
) -> LargestBase:
    """The largest shape of ``family`` whose run fits ``budget`` (scan_family, then judge). What each
    shape's estimate is asked: an EstimateOptions, or estimate_memory's keywords (config, seq,
    micro_batch, precision, nvme_path, ...), not both."""
    if options is not None and estimate:
        raise TypeError("largest_base takes an EstimateOptions or keywords, not both")
    opts = options or EstimateOptions.from_keywords(**estimate)
    scanned = scan_family(family, lora_rank=lora_rank, lora_targets=lora_targets, options=opts)
    return judge(scanned, budget)


__all__ = [
    "DEFAULT_SETTING",
    "LLAMA_FAMILY",
    "Budget",
    "LargestBase",
    "LlamaShape",
    "ShapeEstimate",
    "ShapeFit",
    "judge",
    "largest_base",
    "scan_family",
]
