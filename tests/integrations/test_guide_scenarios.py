"""The scenarios of the Lightning DeepSpeed guide users follow (a Korean write-up of Lightning's
DeepSpeed strategies), with "deepspeed" swapped for "infinity": each trains, and the fp32 ones train
exactly as plain Lightning does (strategy="auto", torch's optimizer: the oracle).

The guide's 1.x spellings map to Lightning 2: ``plugins="deepspeed_stage_2"`` is ``strategy=``,
``gpus=4`` is ``devices`` (CPU here), ``DeepSpeedPlugin`` is the strategy class,
``DeepSpeedCPUAdam`` is ``infinity.optim.CPUAdam`` and ``FusedAdam`` torch's Adam. Its activation
checkpointing (``deepspeed.checkpointing.checkpoint``) is the one scenario the engine cannot run
under stage 3 yet: its ``cpu_checkpointing=True`` flag is accepted, the block called plainly.
"""

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from infinity.integrations.lightning import InfinityStrategy
from infinity.optim import CPUAdam
from tests.integrations.lightning_runs import LIGHTNING_WARNINGS, assert_close, trainer

pytestmark = [
    *LIGHTNING_WARNINGS,
    # the guide's precision=16 is fp16 AMP on its GPUs; on CPU Lightning itself makes it bf16, and says so
    pytest.mark.filterwarnings(
        "ignore:You passed `Trainer\\(accelerator='cpu', precision='16-mixed'\\)`"
    ),
    pytest.mark.filterwarnings("ignore:`precision=16` is supported for historical reasons"),
    pytest.mark.filterwarnings(
        "ignore:You have overridden `MyShardedModel.configure_sharded_model`"
    ),
]

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "cpu_adam": lambda params: CPUAdam(params, lr=1e-2),  # DeepSpeedCPUAdam in the guide
    "fused_adam": lambda params: torch.optim.Adam(
        params, lr=1e-2
    ),  # FusedAdam in the guide (CUDA only)
}


class MyModel(LightningModule):
    def __init__(self, optimizer: str = "adamw", sharded: bool = False):
        super().__init__()
        self.optimizer_name = optimizer
        self.losses: list[float] = []
        self.block = None
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        if not sharded:
            self.configure_block()

    def configure_block(self):
        torch.manual_seed(1)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))

    def training_step(self, b, i):
        loss = (self(b[0]) - b[1]).square().mean()
        self.losses.append(loss.item())
        return loss

    def test_step(self, b, i):
        self.log("test_loss", (self(b[0]) - b[1]).square().mean(), sync_dist=True)

    def predict_step(self, b, i):
        return self(b[0])

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())


class MyShardedModel(MyModel):
    """The guide's configure_sharded_model: the block is built under zero.Init."""

    def __init__(self, optimizer: str = "adamw"):
        super().__init__(optimizer, sharded=True)

    def configure_sharded_model(self):
        if self.block is None:
            self.configure_block()


def data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 8, generator=g)
    ds = TensorDataset(x, x.sum(1, keepdim=True).tanh())
    # the same order under every strategy (Lightning shuffles a distributed strategy's training data)
    return DataLoader(
        ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=False)
    )


def fit(strategy, module, epochs=1, **kwargs):
    t = trainer(
        strategy, epochs=epochs, accumulate_grad_batches=1, gradient_clip_val=None, **kwargs
    )
    t.fit(module, data())
    return t


SCENARIOS = {
    # Trainer(gpus=4, plugins="deepspeed_stage_2", precision=16)
    "stage_2": lambda nvme: ("infinity_stage_2", {"precision": 16}, "adamw"),
    # plugins="deepspeed_stage_2_offload", precision=16, configure_optimizers -> DeepSpeedCPUAdam
    "stage_2_offload": lambda nvme: ("infinity_stage_2_offload", {"precision": 16}, "cpu_adam"),
    # plugins="deepspeed_stage_3", precision=16, FusedAdam; then trainer.test() and trainer.predict()
    "stage_3": lambda nvme: ("infinity_stage_3", {"precision": 16}, "fused_adam"),
    # plugins="deepspeed_stage_3_offload", precision=16
    "stage_3_offload": lambda nvme: ("infinity_stage_3_offload", {"precision": 16}, "adamw"),
    # DeepSpeedPlugin(stage=3, offload_optimizer=True, offload_parameters=True)
    "stage_3_offload_params": lambda nvme: (
        InfinityStrategy(stage=3, offload_optimizer=True, offload_parameters=True),
        {},
        "adamw",
    ),
    # DeepSpeedPlugin(stage=3, ..., remote_device="nvme", offload_*_device="nvme", nvme_path="/local_nvme")
    "stage_3_nvme": lambda nvme: (
        InfinityStrategy(
            stage=3,
            offload_optimizer=True,
            offload_parameters=True,
            remote_device="nvme",
            offload_params_device="nvme",
            offload_optimizer_device="nvme",
            nvme_path=str(nvme),
            params_buffer_size=1 << 12,
            max_in_cpu=0,
        ),
        {},
        "adamw",
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name, nvme_dir):
    strategy, kwargs, optimizer = SCENARIOS[name](nvme_dir)
    module = MyModel(optimizer)
    t = fit(strategy, module, epochs=3, **kwargs)
    assert isinstance(t.strategy, InfinityStrategy)
    assert t.strategy.engine.dtype == (torch.bfloat16 if kwargs.get("precision") else torch.float32)
    if kwargs.get("precision"):  # 16-bit: it learns (its numerics: test_lightning_strategy.py)
        per_epoch = len(module.losses) // 3
        assert sum(module.losses[-per_epoch:]) < 0.8 * sum(module.losses[:per_epoch]), module.losses
    else:  # fp32: exactly as plain Lightning
        plain = MyModel(optimizer)
        fit("auto", plain, epochs=3)
        assert_close(module.losses, plain.losses, "training loss")
    tested = t.test(module, data(), verbose=False)[0]["test_loss"]
    predicted = torch.cat(t.predict(module, data()))
    assert predicted.shape == (32, 1) and tested == pytest.approx(
        (predicted.float() - torch.cat([b[1] for b in data()])).square().mean().item(), rel=2e-2
    )


def test_configure_sharded_model_with_cpu_checkpointing(nvme_dir):
    """DeepSpeedPlugin(stage=3, cpu_offload=True, cpu_checkpointing=True) with configure_sharded_model."""
    module = MyShardedModel()
    strategy = InfinityStrategy(stage=3, cpu_offload=True, cpu_checkpointing=True)
    assert strategy.config["activation_checkpointing"]["cpu_checkpointing"] is True
    fit(strategy, module)
    plain = MyShardedModel()
    fit("auto", plain)
    assert_close(module.losses, plain.losses, "training loss")


def test_sharded_checkpoint_then_test_through_the_trainer(tmp_path, nvme_dir):
    """The guide's tip: a sharded checkpoint (save_full_weights=False) is tested through a Trainer."""
    module = MyModel()
    t = fit("infinity_stage_3_offload", module)
    want = t.test(module, data(), verbose=False)[0]["test_loss"]
    t.save_checkpoint(tmp_path / "sharded")
    fresh = MyModel()
    got = trainer("infinity_stage_3_offload").test(
        fresh, data(), ckpt_path=tmp_path / "sharded", verbose=False
    )
    assert got[0]["test_loss"] == pytest.approx(want, rel=1e-6)
