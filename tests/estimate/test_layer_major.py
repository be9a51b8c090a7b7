"""The estimate of a run trained by engine.train_batch ([Note: layer-major accumulation]): the saved
activations of the window's micro-batches are alive at once, and each array on NVMe moves once per
step, as with one micro-batch ([Note: traffic model])."""

from infinity.estimate import estimate_memory
from infinity.models import GPT, GPTConfig
from tests.engine.reference import engine_config

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False)


def _breakdown(nvme_dir, gas, **kw):
    cfg = engine_config(3, "nvme", "nvme", nvme_dir, gas=gas)
    est = estimate_memory(
        GPT(MODEL), config=cfg, device="cpu", machine=False, micro_batch=2, seq=16, **kw
    )
    return est.focus.breakdown


def _saved(breakdown):
    (item,) = [i for i in breakdown.items if i.name == "activations saved for backward"]
    return item


def test_the_windows_activations_at_once_and_each_array_moved_once(nvme_dir):
    loop = _breakdown(nvme_dir, 4)
    layer = _breakdown(nvme_dir, 4, layer_major=True)
    single = _breakdown(nvme_dir, 1)
    assert _saved(layer).nbytes == 4 * _saved(loop).nbytes > 0
    assert "4 micro-batches at once" in _saved(layer).detail
    assert layer.nvme_traffic_nbytes == single.nvme_traffic_nbytes < loop.nvme_traffic_nbytes


def test_the_command_takes_layer_major(capsys):
    from infinity.cli.main import main

    args = ["estimate", "--params", "2M", "--seq", "16", "--micro-batch", "1", "--json"]
    assert main([*args, "--layer-major"]) == 0
    assert main(["estimate", "--params", "2M", "--inference", "--layer-major"]) == 2
    assert "--layer-major are training's" in capsys.readouterr().err
