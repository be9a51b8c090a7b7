"""Checkpoints of models with frozen parts ([Note: frozen units in a checkpoint]): a LoRA run (peft on a
transformers Llama loaded from a pretrained directory under zero.Init, stage 3, parameters and optimizer
on NVMe) and a frozen teacher beside a trained student (distillation). N steps, save, M more steps in the
same process gives the same losses, bit for bit, as loading the checkpoint in a fresh process whose
trained parts start from other random values, and training M steps: the same arithmetic in the same
order on the same values. The LoRA checkpoint holds the adapters and their Adam state, never the base (a
reference to the pretrained files instead); the teacher, which no file holds, is saved once."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.engine.checkpoint import CheckpointMismatchError, CheckpointNotFoundError
from infinity.engine.checkpoint.reader import read_manifest
from infinity.weights import read_header
from tests.checkpoint.helpers import config as engine_cfg
from tests.distributed import run_distributed
from tests.engine.models import batch, tiny_gpt
from tests.hf import models as hf

N, M = 2, 2


def lora_config(swap: Path) -> dict:
    return engine_cfg(
        3, "nvme", "nvme", swap, gas=1
    )  # the norms' small units persistent, frozen too


def make_base(root: Path) -> Path:
    """The pretrained directory: a tiny Llama's save_pretrained (plain transformers, seed 0)."""
    base = root / "base"
    if not base.exists():
        hf.build("llama", seed=0).save_pretrained(base)
    return base


def lora_engine(root: Path, swap: Path, *, seed: int):
    import peft
    import transformers as tf

    cfg = lora_config(swap)
    with infinity.zero.Init(
        cfg
    ):  # the base streamed into the shards ([Note: from_pretrained under zero.Init])
        model = tf.AutoModelForCausalLM.from_pretrained(make_base(root))
    torch.manual_seed(seed)  # the adapters' starting values: another seed in the resumed run
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    with (
        warnings.catch_warnings()
    ):  # peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        peft_model = peft.get_peft_model(model, lora)
    return infinity.initialize(peft_model, cfg)


def lora_train(engine, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        loss = engine(**hf.batch("llama", step)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class Distill(nn.Module):
    """A frozen teacher beside the student it teaches: cross-entropy plus KL to the teacher's output."""

    def __init__(self):
        super().__init__()
        self.teacher = tiny_gpt()
        self.student = tiny_gpt()
        self.teacher.requires_grad_(False)

    def forward(self, x, y):
        with torch.no_grad():
            t = self.teacher(x)
        s = self.student(x)
        kl = F.kl_div(
            F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean"
        )
        return F.cross_entropy(s.reshape(-1, s.shape[-1]), y.reshape(-1)) + kl


def distill_engine(stage: int, swap: Path, *, seed: int, student_seed: int):
    torch.manual_seed(seed)
    model = Distill()
    torch.manual_seed(student_seed)
    model.student = (
        tiny_gpt()
    )  # the resumed run's student starts elsewhere; the teacher is the same
    where = ("nvme", "nvme") if stage == 3 else ("none", "nvme")
    cfg = engine_cfg(stage, *where, swap, gas=1)
    return infinity.initialize(model, cfg)


def distill_train(engine, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, 0, 0)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


CASES = {
    "lora-stage3-nvme": None,
    "teacher-student-stage3-nvme": 3,
    "teacher-student-stage2": 2,
}


def build(case: str, root: Path, swap: Path, *, resumed: bool):
    if case.startswith("lora"):
        return lora_engine(root, swap, seed=1 if resumed else 0), lora_train
    return distill_engine(
        CASES[case], swap, seed=0, student_seed=2 if resumed else 1
    ), distill_train


def continue_run(case: str, root: Path) -> dict:
    engine, train = build(case, root, root / "swap", resumed=False)
    try:
        train(engine, 0, N)
        ckpt = engine.save_checkpoint(root / "ckpt")
        return {"losses": train(engine, N, M), "ckpt": str(ckpt)}
    finally:
        engine.close()


def _resume_all(rank, roots):
    out = {}
    for case, root in roots.items():
        root = Path(root)
        (root / "swap2").mkdir(exist_ok=True)
        engine, train = build(case, root, root / "swap2", resumed=True)
        try:
            engine.load_checkpoint(root / "ckpt")
            steps = engine.global_steps
            out[case] = {"losses": train(engine, N, M), "steps": steps}
        finally:
            engine.close()
    return out


@pytest.fixture(scope="module")
def runs():
    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    top = base / f"{os.getpid()}-frozen"
    shutil.rmtree(top, ignore_errors=True)
    roots = {case: top / case for case in CASES}
    try:
        for r in roots.values():
            (r / "swap").mkdir(parents=True)
        cont = {case: continue_run(case, r) for case, r in roots.items()}
        (resumed,) = run_distributed(
            _resume_all, {c: str(r) for c, r in roots.items()}, world_size=1
        )
        yield cont, resumed, roots
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("case", list(CASES))
def test_resume_in_a_new_process_gives_the_uninterrupted_losses(case, runs):
    cont, resumed, _ = runs
    assert resumed[case]["steps"] == N
    assert cont[case]["losses"] == resumed[case]["losses"]  # bitwise: the same floats


def _part_tensors(ckpt: Path) -> dict[str, int]:
    out = {}
    for part in ckpt.glob("part-*.safetensors"):
        out.update({n: e.nbytes for n, e in read_header(str(part)).entries.items()})
    return out


def test_the_lora_checkpoint_holds_the_adapters_not_the_base(runs):
    cont, _, roots = runs
    ckpt = Path(cont["lora-stage3-nvme"]["ckpt"])
    manifest = read_manifest(ckpt)
    frozen = [u for u in manifest["units"] if not u["trainable"]]
    trained = [u for u in manifest["units"] if u["trainable"]]
    assert frozen and trained and all(u["source"] is not None for u in frozen)
    assert all("lora_" in s["name"] for u in trained for s in u["slots"])
    tensors = _part_tensors(ckpt)
    assert not [n for n in tensors if n.endswith(".param")]  # no base weight
    # Exactly each adapter unit's fp32 master and two moments.
    assert sorted(tensors) == sorted(
        f"u{i}.{r}"
        for i, u in enumerate(manifest["units"])
        if u["trainable"]
        for r in ("master", "exp_avg", "exp_avg_sq")
    )
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    base = sum(f.stat().st_size for f in (roots["lora-stage3-nvme"] / "base").glob("*.safetensors"))
    adapters = sum(s_numel(s) for u in trained for s in u["slots"])
    print(
        f"\nLoRA checkpoint: {size} bytes in {len(list(ckpt.iterdir()))} files "
        f"({adapters} adapter parameters x 3 fp32 arrays = {adapters * 12} bytes of state, padded to "
        f"{sum(tensors.values())}); the base it refers to: {base} bytes"
    )
    # Nothing else: three fp32 arrays of each adapter unit's shard (padded to 4 KiB for O_DIRECT).
    assert sum(tensors.values()) == sum(3 * 4 * u["shard_numel"] for u in trained)


def s_numel(slot) -> int:
    n = 1
    for d in slot["shape"]:
        n *= d
    return n


@pytest.mark.parametrize("case", ["teacher-student-stage3-nvme", "teacher-student-stage2"])
def test_a_teacher_no_file_holds_is_saved_once(case, runs):
    cont, _, _ = runs
    ckpt = Path(cont[case]["ckpt"])
    manifest = read_manifest(ckpt)
    tensors = _part_tensors(ckpt)
    for i, u in enumerate(manifest["units"]):
        names = {f"u{i}.{r}" for r in ("master", "exp_avg", "exp_avg_sq", "param")} & set(tensors)
        assert names == (
            {f"u{i}.master", f"u{i}.exp_avg", f"u{i}.exp_avg_sq"}
            if u["trainable"]
            else {f"u{i}.param"}
        ), u["name"]
        assert u["trainable"] == u["name"].startswith("student"), u["name"]


def test_a_changed_or_missing_base_file_is_refused_naming_it(runs, tmp_path):
    """Loading a LoRA checkpoint whose pretrained files changed, or are gone, fails before anything is
    loaded, naming the file."""
    _, _, roots = runs
    root = roots["lora-stage3-nvme"]
    base_file = root / "base" / "model.safetensors"
    saved, stat = base_file.read_bytes(), base_file.stat()
    (tmp_path / "swap").mkdir()
    engine, _ = build("lora-stage3-nvme", root, tmp_path / "swap", resumed=True)
    try:
        from safetensors.torch import load_file, save_file

        state = load_file(str(base_file))
        name = next(n for n in state if "q_proj" in n)
        state[name] = state[name] + 1
        save_file(state, str(base_file), metadata={"format": "pt"})
        with pytest.raises(CheckpointMismatchError, match=str(base_file)):
            engine.load_checkpoint(root / "ckpt")
        base_file.unlink()
        with pytest.raises(CheckpointNotFoundError, match=str(base_file)):
            engine.load_checkpoint(root / "ckpt")
    finally:
        base_file.write_bytes(saved)
        os.utime(base_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        engine.close()


def _distributed(rank, root, phase):
    """World size 2 (phase "continue" or "resume"), or 1 ("one": the world-size-2 checkpoints loaded
    re-partitioned, their weights returned)."""
    root = Path(root)
    out = {}
    for case in ("lora-stage3-nvme", "teacher-student-stage3-nvme"):
        swap = root / case / f"swap-{phase}"
        engine, train = build(case, root / case, swap, resumed=phase != "continue")
        try:
            if phase == "continue":
                train(engine, 0, N)
                engine.save_checkpoint(root / case / "ckpt")
                at_save = weights_of(engine)
                out[case] = {"losses": train(engine, N, M), "at_save": at_save}
            else:
                engine.load_checkpoint(root / case / "ckpt")
                out[case] = (
                    {"weights": weights_of(engine)}
                    if phase == "one"
                    else {"losses": train(engine, N, M)}
                )
        finally:
            engine.close()
    return out


def weights_of(engine) -> dict:
    from infinity.zero.gathered import GatheredParameters

    with GatheredParameters(engine):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.distributed
def test_world_size_2_resumes_and_repartitions(tmp_path):
    """Two ranks (each its shard of the base, CRC32C agreed across ranks): resume in fresh processes gives
    the same losses on each rank; one process loads the same checkpoints re-partitioned (the base read
    from its files, the teacher's saved shards joined) with the weights the two ranks had at the save."""
    base = Path(os.environ.get("INFINITY_TEST_NVME", Path.home() / ".cache" / "infinity-tests"))
    root = base / f"{os.getpid()}-frozen-ws2"
    shutil.rmtree(root, ignore_errors=True)
    try:
        make_base(root / "lora-stage3-nvme")
        for case in ("lora-stage3-nvme", "teacher-student-stage3-nvme"):
            for phase in ("continue", "resume", "one"):
                (root / case / f"swap-{phase}").mkdir(parents=True)
        cont = run_distributed(_distributed, str(root), "continue", world_size=2)
        resumed = run_distributed(_distributed, str(root), "resume", world_size=2)
        (one,) = run_distributed(_distributed, str(root), "one", world_size=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for case in cont[0]:
        for r in range(2):
            assert cont[r][case]["losses"] == resumed[r][case]["losses"], (case, r)
        for n, w in cont[0][case]["at_save"].items():
            assert torch.equal(torch.as_tensor(one[case]["weights"][n]), torch.as_tensor(w)), (
                case,
                n,
            )
