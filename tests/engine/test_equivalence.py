"""Training under every stage x offload equals plain PyTorch (fp32, AdamW, accumulation 2, clipping).

The oracle is tests/engine/reference.py: torch.optim.AdamW(foreach=False) and
clip_grad_norm_ on an ordinary module. Per-step losses (train and an eval
forward under no_grad after each step) and the final weights must agree to
1e-5 relative.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.engine.reference import engine_config, engine_run, reference_run

STEPS, GAS = 10, 2

# Stage 0 has no offload; stages 1 and 2 offload the optimizer; stage 3 both.
COMBOS = [(0, "none", "none")]
COMBOS += [(s, "none", o) for s in (1, 2) for o in ("none", "cpu", "nvme")]
COMBOS += [(3, p, o) for p in ("none", "cpu", "nvme") for o in ("none", "cpu", "nvme")]


def assert_equivalent(losses, weights, ref_losses, ref_weights):
    assert losses.keys() >= ref_losses.keys() or set(ref_losses) >= set(losses)
    for k, ref in ref_losses.items():
        if k in losses:
            assert losses[k] == pytest.approx(ref, rel=1e-5), f"loss at {k}"
    for name, ref in ref_weights.items():
        got = torch.as_tensor(weights[name])
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, f"{name}: relative difference {err:.2e}"


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(model, world_size):
        if (model, world_size) not in cache:
            cache[(model, world_size)] = reference_run(
                model, steps=STEPS, gas=GAS, world_size=world_size
            )
        return cache[(model, world_size)]

    return get


@pytest.mark.parametrize("model", ["gpt", "twice", "alternating"])
@pytest.mark.parametrize("stage,offload_param,offload_optimizer", COMBOS)
def test_world_size_1(model, stage, offload_param, offload_optimizer, nvme_dir, references):
    cfg = engine_config(stage, offload_param, offload_optimizer, nvme_dir, gas=GAS)
    losses, weights = engine_run(model, cfg, steps=STEPS, gas=GAS)
    assert_equivalent(losses, weights, *references(model, 1))


def _ranks(rank, model, combos, nvme_dir):
    out = []
    for combo in combos:
        cfg = engine_config(*combo, nvme_dir, gas=GAS)
        out.append(engine_run(model, cfg, steps=STEPS, gas=GAS, rank=rank))
    return out


W2 = {
    "gpt": [
        (0, "none", "none"),
        (1, "none", "cpu"),
        (2, "none", "nvme"),
        (3, "none", "none"),
        (3, "cpu", "nvme"),
        (3, "nvme", "cpu"),
        (3, "nvme", "nvme"),
    ],
    "twice": [(2, "none", "cpu"), (3, "nvme", "nvme")],
    "alternating": [(1, "none", "nvme"), (3, "nvme", "nvme")],
}


@pytest.mark.distributed
@pytest.mark.parametrize("model", list(W2))
def test_world_size_2(model, nvme_dir, references):
    """Two gloo ranks; each sees its own batches; the oracle averages both ranks' gradients."""
    combos = W2[model]
    per_rank = run_distributed(_ranks, model, combos, str(nvme_dir), world_size=2)
    ref_losses, ref_weights = references(model, 2)
    for i, combo in enumerate(combos):
        losses = {**per_rank[0][i][0], **per_rank[1][i][0]}
        for name in ref_weights:  # every rank ends with the same full weights
            assert (per_rank[0][i][1][name] == per_rank[1][i][1][name]).all(), (combo, name)
        assert_equivalent(losses, per_rank[0][i][1], ref_losses, ref_weights)


@pytest.mark.parametrize("model", ["gpt", "alternating"])
@pytest.mark.parametrize("stage,offload_param", [(1, "none"), (3, "nvme")])
def test_gradients_kept_in_host_memory(model, stage, offload_param, nvme_dir, references):
    """offload_optimizer.grads_in_host: the same training, and no gradient bytes in the swap files."""
    cfg = engine_config(stage, offload_param, "nvme", nvme_dir, gas=GAS)
    cfg["zero_optimization"]["offload_optimizer"]["grads_in_host"] = True
    losses, weights = engine_run(model, cfg, steps=STEPS, gas=GAS)
    assert_equivalent(losses, weights, *references(model, 1))


def test_gradients_in_host_memory_leave_the_swap_files(nvme_dir):
    import infinity
    from tests.engine.models import MODELS

    def run(grads_in_host):
        cfg = engine_config(1, "none", "nvme", nvme_dir, gas=1)
        cfg["zero_optimization"]["offload_optimizer"]["grads_in_host"] = grads_in_host
        torch.manual_seed(0)
        engine = infinity.initialize(MODELS["gpt"](), cfg)
        try:
            x = torch.randint(0, 64, (2, 16))
            for _ in range(2):
                engine.backward(engine(x, x))
                engine.step()
            engine.synchronize()
            store = engine.runtime.state_store
            homes = {n: {store.spec((i, n)).home for i in range(2)} for n in ("m", "g")}
            swapped = {
                n: sum(nb for i in range(2) for _, _, nb in store.locate((i, n)))
                for n in ("m", "g")
            }
            return homes, swapped, engine.io_stats()
        finally:
            engine.close()

    homes, swapped, io = run(True)
    homes_swapped, swapped_swapped, io_swapped = run(False)
    assert homes == {"m": {"nvme"}, "g": {"cpu"}} and homes_swapped == {
        "m": {"nvme"},
        "g": {"nvme"},
    }
    # no gradient byte has a place in the swap files, and the moments keep theirs
    assert swapped["g"] == 0 and swapped_swapped["g"] > 0
    assert swapped["m"] == swapped_swapped["m"] > 0
    # So less crosses the disk. (How much less depends on timing: a dirty key written back
    # while the step still reads it is written again, one re-dirtied first is written once.)
    assert io["write_nbytes"] < io_swapped["write_nbytes"]
    assert io["read_nbytes"] < io_swapped["read_nbytes"]
