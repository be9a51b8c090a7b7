"""Lightning on InfinityStrategy trains as plain Lightning does, and as infinity's own loop does (fp32).

The oracle is plain Lightning (strategy="auto" on CPU: torch AdamW, Lightning's accumulation and
clip_grad_norm_, the StepLR schedule Lightning steps); per-micro-batch training losses, validation
losses and final weights agree within 1e-5 relative. infinity's own loop (initialize + engine) is
held to the same oracle, so the three agree.
"""

import pytest

from tests.integrations.lightning_runs import (
    LIGHTNING_WARNINGS,
    assert_close,
    assert_weights_close,
    engine_config,
    engine_run,
    infinity_strategy,
    lightning_run,
)

pytestmark = LIGHTNING_WARNINGS


@pytest.fixture(scope="module")
def plain():
    losses, val_losses, weights, _ = lightning_run("auto")
    return losses, val_losses, weights


def test_infinity_loop_matches_plain_lightning(plain, nvme_dir):
    losses, val_losses, weights = engine_run(engine_config(nvme_dir))
    assert_close(losses, plain[0], "training loss")
    assert_close(val_losses, plain[1], "validation loss")
    assert_weights_close(weights, plain[2])


@pytest.mark.filterwarnings("ignore:You have overridden `ShardedGPTModule.configure_sharded_model`")
@pytest.mark.parametrize("build_in", ["init", "configure_model", "configure_sharded_model"])
def test_stage3_nvme_matches_plain_lightning(plain, nvme_dir, build_in):
    """Parameters and optimizer state on NVMe; the model built in __init__, or in configure_model /
    configure_sharded_model, where it is partitioned as it is built (zero.Init)."""
    losses, val_losses, weights, module = lightning_run(
        infinity_strategy(nvme_dir), build_in=build_in
    )
    assert_close(losses, plain[0], "training loss")
    assert_close(val_losses, plain[1], "validation loss")
    assert_weights_close(weights, plain[2])
    assert module.io_stats["read_nbytes"] > 0 and module.io_stats["write_nbytes"] > 0  # NVMe in use
    built_partitioned = build_in != "init"
    assert (sum(module.numels_at_build) == 0) == built_partitioned, module.numels_at_build


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "nvme"), (2, "cpu")])
def test_lower_stages_match_plain_lightning(plain, nvme_dir, stage, offload):
    losses, val_losses, weights, _ = lightning_run(
        infinity_strategy(nvme_dir, stage=stage, offload=offload)
    )
    assert_close(losses, plain[0], "training loss")
    assert_close(val_losses, plain[1], "validation loss")
    assert_weights_close(weights, plain[2])
