"""examples/ run as users run them (a fresh interpreter, deepspeed unimportable), small sizes:
training lowers the loss, a checkpoint is written, and --resume continues from it to more steps."""

import json

import pytest

from tests.integrations.subprocesses import ROOT, run, without_deepspeed


def _summary(stdout: str) -> dict:
    return json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.parametrize(
    "script,checkpoint",
    [
        ("lightning_stage3_nvme.py", "last.ckpt"),
        ("fabric_loop.py", ""),
    ],
)
def test_example_trains_and_resumes(script, checkpoint, tmp_path, nvme_dir):
    env = without_deepspeed(tmp_path)
    args = [
        str(ROOT / "examples" / script),
        "--quick",
        "--nvme-path",
        str(nvme_dir),
        "--out",
        "out",
    ]
    first = _summary(run(args, cwd=tmp_path, env=env).stdout)
    assert first["steps"] == 6 and first["last_loss"] < first["first_loss"] - 0.2, first
    assert (
        first["nvme_read_nbytes"] > 0 and first["nvme_write_nbytes"] > 0
    )  # parameters and moments on NVMe
    assert (tmp_path / "out" / checkpoint / "checkpoint").is_dir()
    again = _summary(run([*args, "--resume", "--steps", "8"], cwd=tmp_path, env=env).stdout)
    assert again["steps"] == 8, again
    # picked up where the first run stopped: its loss is that of the trained model, not of a fresh one
    assert again["first_loss"] < first["first_loss"] - 0.2, (first, again)


def test_distill_accelerate_trains_the_student_on_the_teachers_logits_and_resumes(
    tmp_path, nvme_dir
):
    """The Accelerate teacher/student scenario: the frozen ZeRO-3 teacher reads its weights from NVMe,
    the ZeRO-2 student's distillation loss falls, and accelerator.load_state continues the student."""
    env = without_deepspeed(tmp_path)
    args = [
        str(ROOT / "examples" / "distill_accelerate.py"),
        "--quick",
        "--nvme-path",
        str(nvme_dir),
        "--out",
        "out",
    ]
    first = _summary(run(args, cwd=tmp_path, env=env).stdout)
    assert first["steps"] == 6 and first["last_loss"] < first["first_loss"] - 0.2, first
    assert first["teacher_nvme_read_nbytes"] > 0  # the teacher's parameters came from NVMe
    assert (tmp_path / "out" / "infinity_model").is_dir()
    again = _summary(run([*args, "--resume", "--steps", "8"], cwd=tmp_path, env=env).stdout)
    assert again["steps"] == 8, again
    assert again["first_loss"] < first["first_loss"] - 0.2, (first, again)


def test_hf_trainer_example_trains_resumes_and_saves(tmp_path, nvme_dir):
    """examples/hf_trainer_gpt2.py: InfinityTrainer with "auto" values from TrainingArguments, the
    Trainer's checkpoint-N folders, --resume through resume_from_checkpoint, a from_pretrained reload."""
    env = without_deepspeed(tmp_path)
    args = [
        str(ROOT / "examples" / "hf_trainer_gpt2.py"),
        "--quick",
        "--nvme-path",
        str(nvme_dir),
        "--out",
        "out",
    ]
    first = _summary(run(args, cwd=tmp_path, env=env).stdout)
    assert first["steps"] == 6 and first["last_loss"] < first["first_loss"] - 0.2, first
    assert (
        first["nvme_read_nbytes"] > 0 and first["nvme_write_nbytes"] > 0
    )  # parameters and moments on NVMe
    assert (tmp_path / "out" / "checkpoint-6" / "infinity").is_dir()
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    assert abs(first["reloaded_loss"] - first["last_loss"]) < 0.5, (
        first
    )  # the trained weights, not fresh ones
    again = _summary(run([*args, "--resume", "--steps", "8"], cwd=tmp_path, env=env).stdout)
    assert again["steps"] == 8, again
    assert again["first_loss"] < first["first_loss"] - 0.2, (first, again)


def test_qlora_sft_trl_trains_adapters_over_an_nf4_base_and_merges_them(tmp_path, nvme_dir):
    """TRL's SFTTrainer on the engine with the frozen base in NF4 on NVMe: the loss falls, the
    checkpoint refers to the base's files (it is smaller than the base), and the merged model,
    reloaded with from_pretrained, gives the trained model's loss (W + s·B·A rounded once: fp32)."""
    args = [
        str(ROOT / "examples" / "qlora_sft_trl.py"),
        "--quick",
        "--nvme-path",
        str(nvme_dir),
        "--out",
        "out",
    ]
    got = _summary(run(args, cwd=tmp_path, env=without_deepspeed(tmp_path)).stdout)
    assert got["steps"] == 6 and got["last_loss"] < got["first_loss"] - 0.1, got
    assert got["checkpoint_nbytes"] < got["base_nbytes"], got
    assert got["merged_loss"] == pytest.approx(got["trained_loss"], rel=1e-5), got
