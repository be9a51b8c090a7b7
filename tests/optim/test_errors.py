"""Clear errors: each names the argument, what is wrong, and the fix."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from infinity.optim import (
    AdamHyper,
    CPUAdam,
    adam_step,
    foreach_adam_step,
    has_overflow,
    kernel,
    set_isa,
)

FIELDS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "adamw": True}
ARGS = {"hyper": AdamHyper(**FIELDS), "step": 1}


def _bufs(n=8):
    return torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)


def test_non_contiguous():
    p, g, m, v = _bufs(16)
    with pytest.raises(
        ValueError, match=r"grad is not contiguous .*stride \(2,\).*\.contiguous\(\)"
    ):
        adam_step(p[:8], g[::2], m[:8], v[:8], **ARGS)
    with pytest.raises(ValueError, match=r"param is not contiguous"):
        adam_step(p.view(4, 4).t(), g, m, v, **ARGS)


def test_mismatched_sizes():
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match=r"exp_avg_sq has 7 elements but param has 8"):
        adam_step(p, g, m, v[:7], **ARGS)
    with pytest.raises(ValueError, match=r"out_half has 9 elements but param has 8"):
        adam_step(p, g, m, v, out_half=torch.empty(9, dtype=torch.bfloat16), **ARGS)


def test_wrong_dtypes():
    p, g, m, v = _bufs()
    with pytest.raises(
        TypeError,
        match=r"grad has dtype torch.float64; the CPU Adam kernel needs torch.float32 or torch.bfloat16 or torch.float16",
    ):
        adam_step(p, g.double(), m, v, **ARGS)
    with pytest.raises(
        TypeError, match=r"param has dtype torch.bfloat16; the CPU Adam kernel needs torch.float32"
    ):
        adam_step(p.bfloat16(), g, m, v, **ARGS)
    with pytest.raises(
        TypeError,
        match=r"out_half has dtype torch.float32; the CPU Adam kernel needs torch.bfloat16 or torch.float16",
    ):
        adam_step(p, g, m, v, out_half=torch.empty(8), **ARGS)
    with pytest.raises(TypeError, match=r"exp_avg must be a torch.Tensor, got list"):
        adam_step(p, g, [0.0] * 8, v, **ARGS)


def test_not_on_cpu():
    p, g, m, v = _bufs()
    with pytest.raises(
        ValueError,
        match=r"exp_avg is on meta, but the CPU Adam kernel reads and writes host memory",
    ):
        adam_step(p, g, torch.zeros(8, device="meta"), v, **ARGS)
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta"):
        has_overflow([g, torch.zeros(8, device="meta")])


def test_sparse_and_overlapping():
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match=r"grad has layout torch.sparse_coo"):
        adam_step(p, g.to_sparse(), m, v, **ARGS)
    with pytest.raises(
        ValueError, match=r"tensor 0's exp_avg overlaps tensor 0's exp_avg_sq in memory"
    ):
        adam_step(p, g, m, m, **ARGS)
    big = torch.zeros(12)
    with pytest.raises(ValueError, match=r"overlaps"):
        adam_step(p, g, big[:8], big[4:], **ARGS)
    shared = torch.randn(8)  # read-only gradients may share memory
    foreach_adam_step(
        [p, torch.randn(8)], [shared, shared], [m, torch.zeros(8)], [v, torch.zeros(8)], **ARGS
    )


def test_foreach_names_the_index_and_counts():
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match=r"grad\[1\] has 7 elements but param has 8"):
        foreach_adam_step([p, p.clone()], [g, g[:7]], [m, m.clone()], [v, v.clone()], **ARGS)
    with pytest.raises(ValueError, match=r"grads has 1 tensors but params has 2"):
        foreach_adam_step([p, p.clone()], [g], [m, m.clone()], [v, v.clone()], **ARGS)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("lr", -1.0, r"lr must be a finite number >= 0, got -1"),
        ("beta1", 1.0, r"beta1 must be in \[0, 1\), got 1"),
        ("beta2", -0.5, r"beta2 must be in \[0, 1\), got -0.5"),
        ("eps", float("nan"), r"eps must be a finite number >= 0, got nan"),
        ("weight_decay", -0.1, r"weight_decay must be a finite number >= 0"),
        ("step", 0, r"step must be >= 1 \(the number of this update; 1 for the first\), got 0"),
    ],
)
def test_hyper_parameters(key, value, message):
    p, g, m, v = _bufs()
    before = p.clone()
    with pytest.raises(ValueError, match=message):
        if key == "step":
            adam_step(p, g, m, v, **{**ARGS, key: value})
        else:  # a bad AdamHyper is never made
            AdamHyper(**{**FIELDS, key: value})
    assert torch.equal(p, before), "a refused step changes nothing"


def test_adam_hyper_is_one_typed_read_only_value():
    h = AdamHyper(**FIELDS)
    assert (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.adamw, h.bias_correction) == (
        1e-3,
        0.9,
        0.999,
        1e-8,
        0.0,
        True,
        True,
    )
    assert h == AdamHyper(**FIELDS, bias_correction=True)
    assert h != AdamHyper(**{**FIELDS, "lr": 2e-3})
    assert hash(h) == hash(AdamHyper(**FIELDS))
    assert pickle.loads(pickle.dumps(h)) == h
    assert repr(h) == (
        "AdamHyper(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.0, adamw=True, "
        "bias_correction=True)"
    )
    with pytest.raises(AttributeError):
        h.lr = 0.1  # a step running in another thread keeps the value it was given
    with pytest.raises(TypeError):
        AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True)  # keyword-only: no row of positional numbers
    with pytest.raises(TypeError):
        # no silent choice between AdamW and Adam
        AdamHyper(**{k: v for k, v in FIELDS.items() if k != "adamw"})
    with pytest.raises(TypeError):
        AdamHyper(**{**FIELDS, "adamw": 1})  # flags are bools, not numbers


def test_hyper_must_be_an_adam_hyper():
    p, g, m, v = _bufs()
    with pytest.raises(
        TypeError, match=r"hyper must be an infinity.optim.AdamHyper, got dict; make"
    ):
        adam_step(p, g, m, v, FIELDS, step=1)


def test_thread_count():
    p, g, m, v = _bufs()
    with pytest.raises(ValueError, match=r"num_threads must be a positive int or None"):
        adam_step(p, g, m, v, num_threads=0, **ARGS)
    with pytest.raises(ValueError, match=r"num_threads must be a positive int or None"):
        CPUAdam([torch.nn.Parameter(p)], num_threads=-2)


def test_isa_names():
    with pytest.raises(ValueError, match=r"isa must be one of scalar, avx2, avx512, got 'sse9'"):
        set_isa("sse9")
    missing = [name for name in kernel.ISAS if name not in kernel.supported_isas()]
    for name in missing:
        with pytest.raises(ValueError, match=rf"isa='{name}', but this CPU supports only"):
            set_isa(name)
    assert kernel.get_isa() == kernel.best_isa()


def test_cpu_adam_refuses_what_it_cannot_update():
    with pytest.raises(
        ValueError,
        match=r"param 0 of group 0 is a contiguous torch.bfloat16 tensor on cpu: keep fp32 master weights",
    ):
        CPUAdam([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match=r"param 1 of group 0 is a non-contiguous torch.float32"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, 4).t())])
    with pytest.raises(ValueError, match=r"Invalid learning rate: -0.1 \(param group 1\)"):
        CPUAdam(
            [
                {"params": [torch.nn.Parameter(torch.zeros(2))]},
                {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": -0.1},
            ]
        )
    with pytest.raises(
        ValueError, match=r"CPUAdam does not implement amsgrad=True \(param group 0\)"
    ):
        CPUAdam([{"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True}])
    w = torch.nn.Parameter(torch.zeros(3))
    opt = CPUAdam([w])
    with pytest.raises(ValueError, match=r"param 0 of group 1 is a contiguous torch.float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1, "a refused group is not kept"
    w.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match=r"CPUAdam does not support sparse gradients"):
        opt.step()


def test_isa_from_the_environment():
    """INFINITY_ADAM_ISA picks the kernel set at import; a bad value fails the import with the fix named."""
    code = "import infinity.optim as o; print(o.get_isa())"
    env = {**os.environ, kernel.ENV_VAR: "scalar"}
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "scalar", r.stderr
    env[kernel.ENV_VAR] = "avx9000"
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0
    assert "INFINITY_ADAM_ISA must be one of scalar, avx2, avx512, got 'avx9000'" in r.stderr


@pytest.mark.parametrize(
    ("dtype", "param_key", "keys", "says"),
    [
        (torch.bfloat16, "p0", ("m", "v", "g"), "needs fp32 master; state_keys .* lack one"),
        (torch.float32, None, ("m", "v", "g"), "needs fp32 master"),
        (
            torch.float32,
            "p0",
            ("master", "m", "v", "g"),
            "is its own fp32 master; state_keys .* add one",
        ),
        (torch.float32, None, ("master", "m", "v"), r"lack \['g'\]"),
    ],
)
def test_state_keys_that_do_not_fit_the_shard_are_refused(dtype, param_key, keys, says):
    """PartitionedAdam registers the keys the plan gives each shard; keys it could not use are refused."""
    from infinity.memory import BufferPool
    from infinity.optim.partitioned_adam import PartitionedAdam, ShardSegment, ShardSpec
    from infinity.store import TieredStore

    p = torch.nn.Parameter(torch.zeros(8))
    spec = ShardSpec(
        0,
        1024,
        dtype,
        (ShardSegment(0, 0, 0, 8),),
        param_key=param_key,
        state_keys=keys,
        state_homes=("cpu",) * len(keys),
    )
    with TieredStore(None, pool=BufferPool(1, 4096), name="state") as store:
        with pytest.raises(ValueError, match=f"shard 0.*{says}"):
            PartitionedAdam(
                [
                    {
                        "params": [p],
                        "lr": 1e-3,
                        "betas": (0.9, 0.999),
                        "eps": 1e-8,
                        "weight_decay": 0.0,
                    }
                ],
                {},
                [p],
                [spec],
                state_store=store,
                param_store=store,
                adamw=True,
                sub_group_numel=1024,
            )
        assert store.keys() == []


def test_shards_in_a_parameter_store_need_one():
    """A shard with a param_key and no param_store is refused when built, not at the first step."""
    from infinity.memory import BufferPool
    from infinity.optim.partitioned_adam import PartitionedAdam, ShardSegment, ShardSpec
    from infinity.store import TieredStore

    p = torch.nn.Parameter(torch.zeros(8))
    spec = ShardSpec(
        0,
        1024,
        torch.bfloat16,
        (ShardSegment(0, 0, 0, 8),),
        param_key="p0",
        state_keys=("master", "m", "v", "g"),
        state_homes=("cpu",) * 4,
    )
    group = {"params": [p], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    with TieredStore(None, pool=BufferPool(1, 4096), name="state") as store:
        with pytest.raises(ValueError, match=r"shards \[0\] have a param_key but param_store"):
            PartitionedAdam(
                [group],
                {},
                [p],
                [spec],
                state_store=store,
                param_store=None,
                adamw=True,
                sub_group_numel=1024,
            )
        assert store.keys() == []
