"""Export round trip: a checkpoint (or a live engine) becomes one safetensors file that
``safetensors.torch.load_file`` + ``load_state_dict(strict=True)`` puts into the plain PyTorch model,
which then computes what the engine computes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from infinity.cli import main as cli_main
from infinity.engine.checkpoint import CheckpointCorruptError, export_checkpoint
from infinity.weights.header import read_header
from tests.checkpoint.helpers import (
    MODELS,
    N_STEPS,
    config,
    eval_logits,
    flip_byte,
    make_engine,
    train,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """TiedNet (tied head, BatchNorm buffers) trained under stage 3 with everything on NVMe, saved."""
    import os
    import shutil
    from pathlib import Path

    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-export"
    shutil.rmtree(root, ignore_errors=True)
    (root / "swap").mkdir(parents=True)
    engine, _ = make_engine("tied", config(3, "nvme", "nvme", root / "swap"), seed=0)
    try:
        train(engine, 0, N_STEPS)
        ckpt = engine.save_checkpoint(root / "ckpt")
        logits = eval_logits(engine.eval())
    finally:
        engine.close()
    yield root, ckpt, logits
    shutil.rmtree(root, ignore_errors=True)


def plain_from(path, model_name="tied", dtype=torch.float32):
    model = MODELS[model_name]().to(dtype)
    state = load_file(str(path))
    assert set(state) == set(model.state_dict())  # tied weights under both names, buffers included
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_cli_export_fp32_gives_the_engines_outputs(trained, tmp_path, capsys):
    root, _ckpt, logits = trained
    out = tmp_path / "model.safetensors"
    assert cli_main.main(["export", str(root / "ckpt"), str(out), "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    model = plain_from(out)
    state = load_file(str(out))
    assert torch.equal(state["head.weight"], state["emb.weight"])
    assert state["norm.num_batches_tracked"].item() == N_STEPS * 2
    assert all(
        v.dtype == torch.float32 for k, v in state.items() if k != "norm.num_batches_tracked"
    )
    torch.testing.assert_close(eval_logits(model), logits, rtol=0, atol=0)
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_export_bf16_is_the_fp32_export_rounded(trained, tmp_path):
    root, ckpt, _ = trained
    fp32 = load_file(str(export_checkpoint(ckpt, tmp_path / "a.safetensors", progress=False)))
    assert (
        cli_main.main(
            [
                "export",
                str(root / "ckpt"),
                str(tmp_path / "b.safetensors"),
                "--dtype",
                "bf16",
                "--no-progress",
            ]
        )
        == 0
    )
    bf16 = load_file(str(tmp_path / "b.safetensors"))
    for k, v in fp32.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert bf16[k].dtype == want.dtype and torch.equal(bf16[k], want), k
    plain_from(tmp_path / "b.safetensors", dtype=torch.bfloat16)  # loads into the bf16 model


def test_save_16bit_model_from_a_live_bf16_engine(nvme_dir, tmp_path):
    engine, _ = make_engine("gpt", config(3, "nvme", "nvme", nvme_dir, dtype="bf16"), seed=0)
    try:
        train(engine, 0, N_STEPS)
        path = engine.save_16bit_model(tmp_path, "live.safetensors")
        logits = eval_logits(engine.eval())
        ckpt = engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        engine.close()
    live = load_file(str(path))
    assert all(v.dtype == torch.bfloat16 for v in live.values())
    model = plain_from(path, "gpt", torch.bfloat16)
    torch.testing.assert_close(eval_logits(model), logits, rtol=0, atol=0)
    # The 16-bit parameters are the fp32 masters rounded: exporting the checkpoint in bf16 gives the same bytes.
    exported = load_file(
        str(export_checkpoint(ckpt, tmp_path / "exp.safetensors", dtype=torch.bfloat16))
    )
    assert live.keys() == exported.keys()
    for k in live:
        assert torch.equal(live[k], exported[k]), k


def test_export_refuses_a_corrupt_checkpoint_and_leaves_no_file(trained, tmp_path, capsys):
    import shutil

    _root, ckpt, _ = trained
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    part = next(bad.glob("part-*.safetensors"))
    flip_byte(
        part, read_header(str(part)).entries["u1.master"].begin + 10
    )  # export reads the masters
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointCorruptError, match=part.name):
        export_checkpoint(bad, out, progress=False)
    assert cli_main.main(["export", str(bad), str(out), "--no-progress"]) == 1
    assert "corrupt" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_export_names_what_is_wrong_with_its_arguments(trained, tmp_path):
    _root, ckpt, _ = trained
    with pytest.raises(ValueError, match=r"\.safetensors"):
        export_checkpoint(ckpt, tmp_path / "model.bin")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "m.safetensors")
    with pytest.raises(
        ValueError, match="gather_nodes=True.*no.*process group|collective of a process group"
    ):
        export_checkpoint(ckpt, tmp_path / "m.safetensors", gather_nodes=True)
    assert not (tmp_path / "m.safetensors").exists()
