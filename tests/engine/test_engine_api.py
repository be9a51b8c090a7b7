"""The rest of the engine's surface: steps_per_print, train/eval, module, close."""

import logging

import pytest
import torch

import infinity
from tests.engine.models import batch, tiny_gpt
from tests.engine.reference import engine_config


def test_steps_per_print_logs_every_n_steps(nvme_dir, caplog):
    cfg = engine_config(3, "cpu", "cpu", nvme_dir, gas=1)
    cfg["steps_per_print"] = 2
    torch.manual_seed(0)
    with (
        caplog.at_level(logging.INFO, logger="infinity.engine"),
        infinity.initialize(tiny_gpt(), cfg) as engine,
    ):
        for step in range(5):
            x, y = batch(step, 0, 0)
            engine.backward(engine(x, y))
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step=")]
    assert [line.split(",")[0] for line in lines] == ["step=2", "step=4"]
    assert "lr=[0.003]" in lines[0] and "grad_norm=" in lines[0]


def test_train_eval_module_and_close(nvme_dir):
    model = tiny_gpt()
    engine = infinity.initialize(model, engine_config(3, "nvme", "nvme", nvme_dir, gas=1))
    assert engine.module is model
    assert engine.eval() is engine and not model.training
    assert engine.train() is engine and model.training
    expected = infinity.models.GPTConfig(
        vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, bias=False
    )
    assert engine.num_parameters == expected.num_params
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="this engine is closed"):
        engine(*batch(0, 0, 0))
    assert not any((nvme_dir / "rank0").iterdir()), "swap files left behind after close()"


def test_updated_parameter_shards_are_written_home_and_stay_cached(nvme_dir):
    """After the optimizer step the new parameter shards are written home on their own (nothing
    dirty is left for the pool to wait on) while staying resident for the next forward."""
    import time

    engine = infinity.initialize(tiny_gpt(), engine_config(3, "nvme", "nvme", nvme_dir, gas=1))
    try:
        for i in range(2):
            engine.backward(engine(*batch(0, i, 0)))
            engine.step()
        engine.synchronize()
        store = engine.runtime.param_store
        deadline = (
            time.monotonic() + 30
        )  # the writes are asynchronous; bounded wait, not a timing check
        while store.stats().dirty_nbytes and time.monotonic() < deadline:
            time.sleep(0.01)
        st = store.stats()
        assert st.dirty_nbytes == 0
        assert st.resident_nbytes > 0
    finally:
        engine.close()
