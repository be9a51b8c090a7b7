"""GatheredParameters(model.parameters()) on a stage-3 model larger than the parameter pool
([Note: user gathers outside the pool] in infinity/zero/gathered.py).

The pool below holds a few layers (the pre-flight accepts it: it holds the largest one); the model
is about three times larger. Gathering all of it works, also right after a step whose optimizer
update still runs in the background, a change made under modifier_rank=0 reaches every layer, a
gather the machine cannot hold is refused at once, and after each of these training goes on and
matches plain PyTorch (torch AdamW, clip_grad_norm_) given the same change.
"""

from __future__ import annotations

import threading

import pytest
import torch

import infinity
import infinity.zero.gathered as gathered
from infinity.zero.gathered import GatheredParameters
from tests.distributed import run_distributed
from tests.engine.models import batch
from tests.engine.reference import BETAS, CLIP, EPS, LR, WD, engine_config

WAIT_S = 120  # generous: the gathers take well under a second; a stall or deadlock takes forever


def model():
    torch.manual_seed(0)
    cfg = infinity.models.GPTConfig(
        vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=64, bias=False
    )
    return infinity.models.GPT(cfg)


def config(nvme):
    cfg = engine_config(3, "nvme", "nvme", nvme, gas=1)
    cfg["zero_optimization"]["offload_param"].update(
        buffer_count=6, buffer_size=1 << 14
    )  # 6 x 64 KiB
    return cfg


def within(seconds, fn):
    """fn() in a thread: its result, or a failure if it neither returns nor raises within ``seconds``."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test thread
            out["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still waiting after {seconds} s (stalled or deadlocked)")
    if "error" in out:
        raise out["error"]
    return out["value"]


def change(m):
    """Rank 0's change under modifier_rank=0: one element in every layer's first parameter."""
    with torch.no_grad():
        for mod in m.modules():
            own = list(mod.parameters(recurse=False))
            if own:
                own[0].view(-1)[0] = 0.25


def oracle(steps, changed_after):
    m = model()
    opt = torch.optim.AdamW(
        m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False
    )
    for step in range(steps):
        m(*batch(step, 0, 0)).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == changed_after:
            change(m)
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def assert_close(got, want, what):
    for n, ref in want.items():
        err = (got[n] - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, f"{what}: {n}: relative difference {err:.2e}"


def train(engine, steps):
    for step in steps:
        engine.backward(engine(*batch(step, 0, 0)))
        engine.step()


def gather_all(m, **kwargs):
    with GatheredParameters(m.parameters(), **kwargs):
        return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_the_model_is_larger_than_the_pool(nvme_dir):
    m = model()
    with infinity.initialize(m, config(nvme_dir)) as engine:
        pool = engine.runtime.param_store.pool
        total = sum(u.full_nbytes for u in engine.runtime.unit_map.units if not u.persistent)
        assert total > 2 * pool.capacity


def test_gather_everything_right_after_a_step_then_train_on(nvme_dir):
    m = model()
    engine = infinity.initialize(m, config(nvme_dir))
    train(engine, [0])  # its optimizer update runs on behind this
    whole = within(WAIT_S, lambda: gather_all(m))
    assert_close(whole, oracle(1, None), "gathered after step 0")
    assert not engine.runtime.partitioner.gathered_units()  # all let go at the context's exit
    within(WAIT_S, lambda: train(engine, [1, 2]))
    whole = within(WAIT_S, lambda: gather_all(m))
    engine.close()
    assert_close(whole, oracle(3, None), "after training on")


def test_change_everything_under_modifier_rank(nvme_dir):
    m = model()
    engine = infinity.initialize(m, config(nvme_dir))
    train(engine, [0])

    def modify():
        with GatheredParameters(m.parameters(), modifier_rank=0):
            change(m)

    within(WAIT_S, modify)
    within(WAIT_S, lambda: train(engine, [1, 2]))
    whole = within(WAIT_S, lambda: gather_all(m))
    engine.close()
    assert_close(whole, oracle(3, changed_after=0), "changed after step 0, then trained")


def test_a_gather_memory_cannot_hold_is_refused_at_once_and_training_goes_on(nvme_dir, monkeypatch):
    m = model()
    engine = infinity.initialize(m, config(nvme_dir))
    train(engine, [0])
    units = engine.runtime.unit_map.units
    need = sum(u.full_nbytes for u in units if not u.persistent)
    monkeypatch.setattr(gathered, "free_memory_nbytes", lambda device: need - 1)
    with pytest.raises(MemoryError) as e:
        within(WAIT_S, lambda: gather_all(m))
    msg = str(e.value)
    assert f"GatheredParameters needs {need:,} bytes to hold" in msg
    assert f"only {need - 1:,} bytes of host memory (MemAvailable) are free" in msg
    assert "one module's per context" in msg and "save_16bit_model" in msg
    assert not engine.runtime.partitioner.gathered_units()
    small = sum(u.full_nbytes for u in units if u.module_name == "blocks.0.mlp.fc")
    assert small < need - 1  # one module's parameters still fit
    fc = within(WAIT_S, lambda: gather_all(m.blocks[0].mlp.fc))
    monkeypatch.undo()
    within(WAIT_S, lambda: train(engine, [1, 2]))
    whole = within(WAIT_S, lambda: gather_all(m))
    engine.close()
    assert_close(whole, oracle(3, None), "after the refusal")
    assert_close(
        {"blocks.0.mlp.fc.weight": fc["weight"]},
        {"blocks.0.mlp.fc.weight": oracle(1, None)["blocks.0.mlp.fc.weight"]},
        "one module's gather",
    )


def _refused_on_rank_1(rank, nvme):
    """Rank 1's memory cannot hold the gather: both ranks refuse it (one gathering alone would wait
    for the other in all_gather for good), then train on and gather together."""
    m = model()
    engine = infinity.initialize(m, config(nvme))
    train(engine, [0])
    if rank == 1:
        gathered.free_memory_nbytes = lambda device: 1
    try:
        gather_all(m)
        refused = ""
    except MemoryError as e:
        refused = str(e)
    gathered.free_memory_nbytes = FREE_MEMORY
    train(engine, [1, 2])
    whole = gather_all(m)
    engine.close()
    return refused, whole


FREE_MEMORY = gathered.free_memory_nbytes


@pytest.mark.distributed
def test_a_refusal_on_one_rank_is_every_rank_s(nvme_dir):
    (refused0, whole0), (refused1, whole1) = run_distributed(
        _refused_on_rank_1, str(nvme_dir), world_size=2, timeout=300
    )
    assert (
        refused0
        == "GatheredParameters was refused on another rank: its free memory cannot hold the parameters"
    )
    assert (
        refused1.startswith("GatheredParameters needs ")
        and "only 1 bytes of host memory" in refused1
    )
    for n, w in whole0.items():
        assert (w == whole1[n]).all(), n


def test_a_gather_that_fails_midway_lets_go_of_what_it_gathered(nvme_dir, monkeypatch):
    """A read failing at the fourth layer (an I/O error, say): the three gathered before it are let
    go (held, they would stall the next forward), and training goes on as if the gather had not
    happened."""
    m = model()
    engine = infinity.initialize(m, config(nvme_dir))
    train(engine, [0])
    part = engine.runtime.partitioner
    acquire, calls = part.shards.acquire, []

    def failing(key):
        calls.append(key)
        if len(calls) == 4:
            raise OSError(f"injected read error for {key}")
        return acquire(key)

    monkeypatch.setattr(part.shards, "acquire", failing)
    with pytest.raises(OSError, match="injected read error"):
        within(WAIT_S, lambda: gather_all(m))
    monkeypatch.undo()
    assert not part.gathered_units()
    within(WAIT_S, lambda: train(engine, [1, 2]))
    whole = within(WAIT_S, lambda: gather_all(m))
    engine.close()
    assert_close(whole, oracle(3, None), "after the failed gather")
