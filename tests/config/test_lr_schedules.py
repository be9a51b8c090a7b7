"""The warmup schedules against DeepSpeed's formulas, written out here independently, per optimizer step."""

import io
import logging
import math

import pytest
import torch

from infinity.config import SUPPORTED_SCHEDULERS, ConfigError, load_config
from infinity.optim.lr_schedules import (
    SCHEDULERS,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)


# --- DeepSpeed's closed forms, by DeepSpeed iteration i (-1 = before the first scheduler step) ---
def _warm(i, n, kind):
    big_n = max(2, n)
    return math.log(i + 1) / math.log(big_n) if kind == "log" else i / big_n


def ds_warmup_lr(i, lo, hi, n, kind):
    if i < 0:
        return lo
    g = _warm(i, n, kind) if i < max(2, n) else 1.0
    return lo + (hi - lo) * g


def ds_decay_lr(i, lo, hi, n, total, kind):
    if i < 0:
        return lo
    big_n = max(2, n)
    g = _warm(i, n, kind) if i < big_n else max(0.0, (total - i) / max(1.0, total - big_n))
    return lo + (hi - lo) * g


def ds_cosine_lr(i, base, r0, n, total, c, kind):
    if i < 0:
        return 0.0
    big_n = max(2, n)
    if i < big_n:
        ratio = r0 + _warm(i, n, kind) * (1 - r0)
    else:
        p = min(1.0, (i - big_n + 1) / max(1, total - big_n))
        ratio = max(0.0, c + (1 - c) * (1 + math.cos(math.pi * p)) / 2)
    return base * ratio


def _optimizer(*lrs):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _lrs_seen_by_optimizer(opt, sched, steps):
    """The lr of every group at each optimizer step k = 1..steps (scheduler stepped after each)."""
    seen = []
    for _ in range(steps):
        seen.append([float(g["lr"]) for g in opt.param_groups])
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_warmup_lr_per_step(kind, n):
    opt = _optimizer(0.5)
    sched = WarmupLR(
        opt, warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=n, warmup_type=kind
    )
    seen = _lrs_seen_by_optimizer(opt, sched, 15)
    for k, lrs in enumerate(seen, start=1):
        assert lrs[0] == pytest.approx(
            ds_warmup_lr(k - 2, 0.01, 0.2, n, kind), rel=1e-12, abs=1e-15
        )
    assert sched.last_batch_iteration == 14
    assert sched.get_last_lr()[0] == pytest.approx(ds_warmup_lr(14, 0.01, 0.2, n, kind))


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(("n", "total"), [(4, 12), (5, 3), (1, 6)])
def test_warmup_decay_lr_per_step(kind, n, total):
    opt = _optimizer(0.5)
    sched = WarmupDecayLR(
        opt, total, warmup_min_lr=0.0, warmup_max_lr=0.3, warmup_num_steps=n, warmup_type=kind
    )
    seen = _lrs_seen_by_optimizer(opt, sched, total + 4)
    for k, lrs in enumerate(seen, start=1):
        assert lrs[0] == pytest.approx(
            ds_decay_lr(k - 2, 0.0, 0.3, n, total, kind), rel=1e-12, abs=1e-15
        )
    assert seen[-1][0] == 0.0  # past total_num_steps the lr stays at 0


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize(
    ("n", "total", "r0", "c"), [(4, 20, 0.0, 0.0001), (3, 10, 0.1, 0.05), (6, 4, 0.0, 0.2)]
)
def test_warmup_cosine_lr_per_step_and_per_group(kind, n, total, r0, c):
    opt = _optimizer(0.1, 0.4)
    sched = WarmupCosineLR(
        opt, total, warmup_min_ratio=r0, warmup_num_steps=n, cos_min_ratio=c, warmup_type=kind
    )
    seen = _lrs_seen_by_optimizer(opt, sched, total + 5)
    for k, lrs in enumerate(seen, start=1):
        for base, lr in zip((0.1, 0.4), lrs, strict=True):
            assert lr == pytest.approx(
                ds_cosine_lr(k - 2, base, r0, n, total, c, kind), rel=1e-12, abs=1e-15
            )
    assert seen[-1][1] == pytest.approx(0.4 * c)  # clamped at the floor after the end


def test_per_group_min_and_max_lrs():
    opt = _optimizer(1.0, 1.0)
    sched = WarmupLR(
        opt,
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=(1.0, 0.5),
        warmup_num_steps=4,
        warmup_type="linear",
    )
    seen = _lrs_seen_by_optimizer(opt, sched, 6)
    for k, lrs in enumerate(seen, start=1):
        assert lrs[0] == pytest.approx(ds_warmup_lr(k - 2, 0.0, 1.0, 4, "linear"))
        assert lrs[1] == pytest.approx(ds_warmup_lr(k - 2, 0.1, 0.5, 4, "linear"))


def test_unset_max_lr_is_each_groups_own_lr():
    opt = _optimizer(0.2, 0.6)
    sched = WarmupLR(opt, warmup_num_steps=3, warmup_type="linear")
    _lrs_seen_by_optimizer(opt, sched, 5)
    assert sched.get_last_lr() == pytest.approx([0.2, 0.6])
    decay = WarmupDecayLR(_optimizer(0.2, 0.6), 10, warmup_max_lr=None, warmup_num_steps=2)
    assert decay.lrs_at(1) == pytest.approx([0.2, 0.6])


def test_tensor_lrs_are_updated_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(
        opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=4, warmup_type="linear"
    )
    _lrs_seen_by_optimizer(opt, sched, 3)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(ds_warmup_lr(2, 0.0, 0.01, 4, "linear"))


def _make(cls, opt):
    if cls is WarmupLR:
        return WarmupLR(opt, warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=5)
    if cls is WarmupDecayLR:
        return WarmupDecayLR(opt, 12, warmup_max_lr=0.1, warmup_num_steps=5)
    return WarmupCosineLR(opt, 12, warmup_min_ratio=0.1, warmup_num_steps=5)


@pytest.mark.parametrize("cls", [WarmupLR, WarmupDecayLR, WarmupCosineLR])
def test_state_dict_round_trip(cls):
    opt_a = _optimizer(0.1)
    a = _make(cls, opt_a)
    _lrs_seen_by_optimizer(opt_a, a, 7)
    buf = io.BytesIO()
    torch.save({"optimizer": opt_a.state_dict(), "scheduler": a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    # as with any torch scheduler: build it, then load the optimizer's state (its lrs), then its own
    opt_b = _optimizer(0.1)
    b = _make(cls, opt_b)
    opt_b.load_state_dict(saved["optimizer"])
    b.load_state_dict(saved["scheduler"])
    assert b.last_batch_iteration == a.last_batch_iteration == 6
    assert _lrs_seen_by_optimizer(opt_a, a, 8) == _lrs_seen_by_optimizer(opt_b, b, 8)


@pytest.mark.parametrize("cls", [WarmupLR, WarmupDecayLR, WarmupCosineLR])
def test_deepspeed_state_dict_and_resume_arguments(cls):
    opt_a = _optimizer(0.1)
    a = _make(cls, opt_a)
    _lrs_seen_by_optimizer(opt_a, a, 7)  # DeepSpeed iteration 6 now
    # a DeepSpeed checkpoint holds only {"last_batch_iteration": k}
    opt_b = _optimizer(0.1)
    b = _make(cls, opt_b)
    b.load_state_dict({"last_batch_iteration": 6})
    assert b.last_batch_iteration == 6
    opt_b.step()
    b.step()
    opt_a.step()
    a.step()
    assert b.get_last_lr() == pytest.approx(a.get_last_lr())
    # DeepSpeed's step(last_batch_iteration=k) jumps; so does the constructor argument
    opt_c = _optimizer(0.1)
    c = _make(cls, opt_c)
    c.step(last_batch_iteration=7)
    assert c.last_batch_iteration == 7 and c.get_last_lr() == pytest.approx(a.get_last_lr())
    assert c.lrs_at(7) == pytest.approx(a.get_last_lr())


def test_constructor_resume_point():
    opt = _optimizer(0.5)
    sched = WarmupLR(
        opt, warmup_min_lr=0.0, warmup_max_lr=0.2, warmup_num_steps=10, last_batch_iteration=4
    )
    assert sched.last_batch_iteration == 4
    assert opt.param_groups[0]["lr"] == pytest.approx(ds_warmup_lr(4, 0.0, 0.2, 10, "log"))
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(ds_warmup_lr(5, 0.0, 0.2, 10, "log"))


def test_a_wrapper_holding_the_optimizer_is_accepted():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = _optimizer(0.1)
    sched = WarmupLR(Wrapper(opt), warmup_max_lr=0.1)
    assert sched.optimizer is opt


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda o: WarmupLR(o, warmup_num_steps=0),
            ValueError,
            r"^warmup_num_steps must be a positive integer, got 0$",
        ),
        (
            lambda o: WarmupLR(o, warmup_num_steps=2.0),
            ValueError,
            r"^warmup_num_steps must be a positive integer, got 2\.0$",
        ),
        (
            lambda o: WarmupLR(o, warmup_type="cosine"),
            ValueError,
            r"^warmup_type must be 'log' or 'linear', got 'cosine'$",
        ),
        (
            lambda o: WarmupLR(o, warmup_min_lr=[0.0, 0.1]),
            ValueError,
            r"^expected 1 values for warmup_min_lr \(one per param group\), got 2$",
        ),
        (
            lambda o: WarmupLR(o, warmup_max_lr=-1.0),
            ValueError,
            r"^warmup_max_lr must be >= 0 and finite, got -1\.0$",
        ),
        (
            lambda o: WarmupLR(o, last_batch_iteration=-2),
            ValueError,
            r"^last_batch_iteration must be an integer >= -1, got -2$",
        ),
        (
            lambda o: WarmupDecayLR(o, 0),
            ValueError,
            r"^total_num_steps must be a positive integer, got 0$",
        ),
        (
            lambda o: WarmupCosineLR(o, 10, cos_min_ratio=1.5),
            ValueError,
            r"^cos_min_ratio must be a number in \[0, 1\], got 1\.5$",
        ),
        (lambda o: WarmupLR(object()), TypeError, r"^object is not a torch\.optim\.Optimizer$"),
    ],
)
def test_bad_arguments(make, error, message):
    with pytest.raises(error, match=message):
        make(_optimizer(0.1))


def test_total_shorter_than_warmup_is_logged(caplog):
    caplog.set_level(logging.WARNING, "infinity.optim")
    WarmupDecayLR(_optimizer(0.1), 3, warmup_num_steps=10)
    assert [r.getMessage() for r in caplog.records] == [
        "total_num_steps 3 is less than warmup_num_steps 10"
    ]


def test_build_scheduler_from_config_section():
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {
                    "total_num_steps": "auto",
                    "warmup_max_lr": "auto",
                    "warmup_num_steps": 3,
                },
            },
        },
        lr=0.05,
        total_num_steps=9,
    )
    opt = _optimizer(0.05)
    sched = build_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupDecayLR)
    seen = _lrs_seen_by_optimizer(opt, sched, 12)
    for k, lrs in enumerate(seen, start=1):
        assert lrs[0] == pytest.approx(ds_decay_lr(k - 2, 0.0, 0.05, 3, 9, "log"), abs=1e-15)


def test_build_scheduler_from_a_deepspeed_dict():
    sched = build_scheduler(
        {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 10, "warmup_num_steps": 2, "warmup_type": "linear"},
        },
        _optimizer(0.3),
    )
    assert (
        isinstance(sched, WarmupCosineLR)
        and sched.warmup_type == "linear"
        and sched.total_num_steps == 10
    )
    sched = build_scheduler({"type": "WarmupLR", "params": {}}, _optimizer(0.3))
    assert isinstance(sched, WarmupLR) and sched.warmup_num_steps == 1000 and sched.max_lrs is None


@pytest.mark.parametrize("name", ["OneCycle", "LRRangeTest", "CosineAnnealingLR"])
def test_build_scheduler_refuses_unsupported_types_listing_the_supported(name):
    with pytest.raises(ConfigError, match=r"supported: WarmupLR, WarmupDecayLR, WarmupCosineLR\."):
        build_scheduler({"type": name, "params": {}}, _optimizer(0.1))


def test_build_scheduler_refuses_other_objects():
    with pytest.raises(
        TypeError, match="scheduler_config must be a SchedulerConfig or a dict; got str"
    ):
        build_scheduler("WarmupLR", _optimizer(0.1))


def test_every_supported_schedule_has_a_class():
    assert tuple(SCHEDULERS) == SUPPORTED_SCHEDULERS
