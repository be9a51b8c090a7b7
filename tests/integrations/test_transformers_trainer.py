"""InfinityTrainer (infinity.integrations.transformers) trains as the plain transformers Trainer does.

One training, three ways, fp32: the plain ``Trainer`` (no offload: torch's AdamW, accelerate's
backward, ``clip_grad_norm_``, the linear warmup/decay schedule), ``InfinityTrainer`` (stage 3 with
parameters and Adam state on NVMe, or stage 2 with the optimizer on CPU) and infinity's own loop
(``initialize`` + engine) with the same AdamW, schedule and batches. The model is a GPT-2 built
from a tiny config with random weights (no download); the data order is the Trainer's own (a
random sampler under the Trainer's seed), the loop replays the batches the plain run recorded.
Per-step losses agree within 1e-5 relative. Then: resume from checkpoint-N equals continuing,
``save_model`` loads with ``from_pretrained``, "auto" values are HF's, and the refusals; a PEFT LoRA
run's checkpoint-N/ holds the plain Trainer's files and the adapters' engine state (not the base's), and
resumes in a new process with the uninterrupted run's losses.
``deepspeed`` is unimportable throughout (conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import warnings
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    get_scheduler,
)

import infinity
from infinity.config import ConfigError
from infinity.engine.checkpoint.lock import LOCK_NAME
from infinity.engine.checkpoint.reader import read_manifest
from infinity.integrations.transformers import ENGINE_TAG, InfinityTrainer
from infinity.weights import read_header
from infinity.zero.gathered import GatheredParameters
from tests.distributed import run_distributed
from tests.hf.saved_files import claimed_nbytes

VOCAB, SEQ, SAMPLES = 64, 16, 32
BATCH, GAS, MAX_STEPS, WARMUP = 4, 2, 6, 2  # 4 updates per epoch: the run crosses an epoch
LR, WD, CLIP = 3e-3, 0.01, 0.5


def gpt2() -> GPT2LMHeadModel:
    """No dropout: infinity's own loop draws no random numbers where the Trainer's would."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


@contextlib.contextmanager
def peft_quietly():
    """peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing`` as it wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        yield


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(
            0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1)
        )

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    """The loss and gradient norm (before clipping) of every optimizer step (logging_steps=1), as the
    Trainer logs them."""

    def __init__(self):
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.grad_norms.append(float(logs["grad_norm"]))


class Recording:
    """The batches the Trainer trained on, in order (the data collator sees each one)."""

    def __init__(self):
        self.batches: list[dict[str, torch.Tensor]] = []

    def __call__(self, features):
        batch = default_data_collator(features)
        self.batches.append({k: v.clone() for k, v in batch.items()})
        return batch


def arguments(out, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=GAS,
        max_steps=MAX_STEPS,
        learning_rate=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        warmup_steps=WARMUP,
        adam_epsilon=1e-6,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def stage3_nvme(nvme_dir) -> dict:
    offload = {"device": "nvme", "nvme_path": str(nvme_dir)}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
    }


def stage2_cpu() -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }


def infinity_run(
    out, config, *, resume: str | None = None, model=None, **overrides
) -> tuple[Losses, InfinityTrainer]:
    rec = Losses()
    trainer = InfinityTrainer(
        model=model or gpt2(),
        args=arguments(out, **overrides),
        train_dataset=Tokens(),
        callbacks=[rec],
        infinity_config=config,
    )
    trainer.train(resume_from_checkpoint=resume)
    return rec, trainer


def assert_close(got: list[float], want: list[float], what: str, rtol: float = 1e-5) -> None:
    assert len(got) == len(want), (what, got, want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rtol * abs(w), f"{what}, step {i + 1}: {g} vs {w}\n{got}\n{want}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer's per-step losses and gradient norms, and the batches it saw."""
    rec, batches = Losses(), Recording()
    trainer = Trainer(
        model=gpt2(),
        args=arguments(tmp_path_factory.mktemp("plain")),
        train_dataset=Tokens(),
        data_collator=batches,
        callbacks=[rec],
    )
    trainer.train()
    # the collator may see a batch more than was trained on (the data loader reads ahead)
    assert len(rec.losses) == MAX_STEPS and len(batches.batches) >= MAX_STEPS * GAS
    return rec.losses, batches.batches[: MAX_STEPS * GAS], rec.grad_norms


def own_loop(config: dict, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """infinity's loop: the Trainer's AdamW (from lr=: no optimizer section) and linear schedule, and
    the Trainer's loss: each micro-batch's summed token loss over the label count of the whole window
    (``num_items_in_batch``, the Trainer's count: every label, shifted or not), summed over the window;
    the engine divides what it is given by the accumulation count, hence ``loss * GAS``."""

    def schedule(opt):
        return get_scheduler(
            "linear", optimizer=opt, num_warmup_steps=WARMUP, num_training_steps=MAX_STEPS
        )

    engine = infinity.initialize(
        gpt2(),
        config,
        lr_scheduler=schedule,
        lr=LR,
        weight_decay=WD,
        eps=1e-6,
        betas=(0.9, 0.999),
        gradient_clipping=CLIP,
        gradient_accumulation_steps=GAS,
        train_micro_batch_size_per_gpu=BATCH,
    )
    losses = []
    with engine:
        for start in range(0, len(batches), GAS):
            window = batches[start : start + GAS]
            items = torch.tensor(sum(b["labels"].numel() for b in window))
            step_loss = 0.0
            for batch in window:
                loss = engine(**batch, num_items_in_batch=items).loss
                engine.backward(loss * GAS)
                engine.step()
                step_loss += loss.item()
            losses.append(step_loss)
    return losses


@pytest.mark.parametrize("layout", ["stage3_nvme", "stage2_cpu"])
def test_trainer_matches_plain_trainer_and_own_loop(plain, nvme_dir, tmp_path, layout):
    config = stage3_nvme(nvme_dir) if layout == "stage3_nvme" else stage2_cpu()
    rec, trainer = infinity_run(tmp_path, config)
    assert_close(rec.losses, plain[0], "InfinityTrainer vs plain Trainer")
    assert_close(rec.grad_norms, plain[2], "gradient norm before clipping", rtol=1e-4)
    assert_close(own_loop(config, plain[1]), plain[0], "infinity's loop vs plain Trainer")
    assert trainer.state.global_step == MAX_STEPS and trainer.engine.global_steps == MAX_STEPS
    if layout == "stage3_nvme":
        io = trainer.engine.io_stats()
        assert io["read_nbytes"] > 0 and io["write_nbytes"] > 0  # parameters and moments on NVMe
    trainer.engine.close()


@pytest.mark.parametrize("each_node", [False, True], ids=["shared", "save_on_each_node"])
def test_resume_equals_continue(nvme_dir, tmp_path, each_node):
    """checkpoint-3 (mid-epoch) through the Trainer's own flow; the resumed run's steps 4-6 are the
    continued run's. ``save_on_each_node``: the engine checkpoint is node-local (a node manifest)."""
    full, trainer = infinity_run(
        tmp_path / "a",
        stage3_nvme(nvme_dir),
        save_strategy="steps",
        save_steps=3,
        save_on_each_node=each_node,
    )
    trainer.engine.close()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert (checkpoint / ENGINE_TAG).is_dir() and (checkpoint / "trainer_state.json").is_file()
    assert (checkpoint / ENGINE_TAG / "node-00000.json").is_file() == each_node
    assert (checkpoint / "model.safetensors").is_file() and not (
        checkpoint / "optimizer.pt"
    ).exists()
    resumed, trainer = infinity_run(
        tmp_path / "b", stage3_nvme(nvme_dir), resume=str(checkpoint), save_on_each_node=each_node
    )
    assert trainer.state.global_step == MAX_STEPS
    assert_close(resumed.losses, full.losses[3:], "resumed vs continued", rtol=1e-6)
    trainer.engine.close()


def test_save_model_loads_with_from_pretrained(plain, nvme_dir, tmp_path):
    _, trainer = infinity_run(tmp_path / "run", stage3_nvme(nvme_dir))
    trainer.save_model(str(tmp_path / "model"))
    assert json.loads((tmp_path / "model" / "config.json").read_text())["n_embd"] == 32
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    ids = plain[1][0]["input_ids"]
    trainer.engine.eval()
    with torch.no_grad():
        want = trainer.engine(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    trainer.engine.close()


def test_evaluate_runs_through_the_engine(nvme_dir, tmp_path):
    """evaluate() after train(): under stage 3 only the engine has the weights."""
    args = dict(max_steps=2)
    trainer = InfinityTrainer(
        model=gpt2(),
        args=arguments(tmp_path / "a", **args),
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
        infinity_config=stage3_nvme(nvme_dir),
    )
    trainer.train()
    plain = Trainer(
        model=gpt2(),
        args=arguments(tmp_path / "b", **args),
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
    )
    plain.train()
    got, want = trainer.evaluate()["eval_loss"], plain.evaluate()["eval_loss"]
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    trainer.engine.close()


def test_auto_values_come_from_training_arguments(nvme_dir, tmp_path):
    """A config whose optimizer and WarmupDecayLR schedule are all "auto", filled as HF fills them."""
    config = {
        **stage3_nvme(nvme_dir),
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
    }
    _, trainer = infinity_run(tmp_path, config, max_steps=4, adam_beta2=0.99)
    cfg = trainer.engine.config
    assert (
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
        cfg.gradient_clipping,
    ) == (BATCH, GAS, CLIP)
    p = cfg.optimizer.params
    assert (p.lr, tuple(p.betas), p.eps, p.weight_decay) == (LR, (0.9, 0.99), 1e-6, WD)
    s = cfg.scheduler.params
    assert (s.warmup_min_lr, s.warmup_max_lr, s.warmup_num_steps, s.total_num_steps) == (
        0,
        LR,
        WARMUP,
        4,
    )
    assert trainer.engine.global_steps == 4
    trainer.engine.close()


def test_config_optimizer_with_the_trainers_schedule(nvme_dir, tmp_path):
    """An optimizer section and no scheduler: the Trainer's linear schedule drives the engine's Adam
    (HF's DeepSpeed path does the same), down to 0 at max_steps."""
    config = {**stage3_nvme(nvme_dir), "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    rec, trainer = infinity_run(tmp_path, config)
    assert len(rec.losses) == MAX_STEPS
    assert isinstance(trainer.engine.lr_scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert trainer.engine.get_lr() == [0.0]
    trainer.engine.close()


@pytest.mark.parametrize(
    "key,value,named",
    [
        ("gradient_accumulation_steps", 4, "gradient_accumulation_steps"),
        ("optimizer", {"type": "AdamW", "params": {"lr": 1e-2}}, "learning_rate"),
        ("bf16", {"enabled": True}, "bf16"),
    ],
)
def test_config_disagreeing_with_training_arguments_is_refused(
    nvme_dir, tmp_path, key, value, named
):
    config = {**stage3_nvme(nvme_dir), key: value}
    with pytest.raises(ConfigError, match=named):
        infinity_run(tmp_path, config)


# -- precision ([Note: the Trainer's precision]) ------------------------------------------------


def test_bf16_arguments_and_no_bf16_section_train_in_bf16_as_with_the_section(nvme_dir, tmp_path):
    """Accelerate's DeepSpeed plugin adds the missing section, enabled: the run is the one whose
    config enables bf16 (the same losses, gradient norms and bf16 weights), not an fp32 one."""
    runs = {}
    for name, extra in (("added", {}), ("written", {"bf16": {"enabled": True}})):
        (nvme_dir / name).mkdir()
        config = {**stage3_nvme(nvme_dir / name), **extra}
        rec, trainer = infinity_run(tmp_path / name, config, max_steps=2, bf16=True)
        engine = trainer.engine
        assert engine.dtype == torch.bfloat16 and engine.config.bf16.enabled, name
        with GatheredParameters(engine):
            weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        engine.close()
        assert all(w.dtype == torch.bfloat16 for w in weights.values()), name
        runs[name] = (rec.losses, rec.grad_norms, weights)
    (losses, norms, weights), (want_losses, want_norms, want) = runs["added"], runs["written"]
    assert losses == want_losses and norms == want_norms
    for n, w in want.items():
        assert torch.equal(weights[n], w), n


def test_bf16_arguments_against_a_disabled_bf16_section_are_refused_naming_both(nvme_dir, tmp_path):
    config = {**stage3_nvme(nvme_dir), "bf16": {"enabled": False}}
    with pytest.raises(
        ConfigError,
        match=r"bf16\|bf16_full_eval=True was given but the config sets bf16\.enabled to False",
    ):
        infinity_run(tmp_path, config, bf16=True)


# -- layer-major accumulation ([Note: the Trainer's window, layer-major]) ------------------------

LM_GAS, LM_BATCH, LM_STEPS = 4, 3, 3  # 11 batches an epoch (the last of 2 samples): windows 4, 4, 3


def small_pool(nvme_dir) -> dict:
    """Stage 3 on NVMe with a parameter pool (2 x 10,000 elements) smaller than the model (about
    30,000 in 21 units), so a unit used again after others is read again: the reads per step count."""
    config = stage3_nvme(nvme_dir)
    zero = config["zero_optimization"]
    zero.update(stage3_param_persistence_threshold=100, sub_group_size=3000)
    zero["offload_param"] = {
        **zero["offload_param"],
        "buffer_count": 2,
        "buffer_size": 10_000,
        "max_in_cpu": 0,
    }
    return config


class StepTraffic(TrainerCallback):
    """Per optimizer step: parameter bytes read and gradient bytes written on NVMe (the stores'
    per-key counters), and the threads compute_loss ran in."""

    def __init__(self):
        self.trainer = None
        self.snapshots = []

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer.engine
        engine.synchronize()
        rt = engine.runtime
        self.snapshots.append((rt.param_store.key_traffic(), rt.state_store.key_traffic()))

    def per_step(self) -> list[tuple[int, int]]:
        steps = []
        for (p0, s0), (p1, s1) in zip(self.snapshots[:-1], self.snapshots[1:], strict=True):
            grads = sum(n for key, n in s1.since(s0).written.items() if key[1] == "g")
            steps.append((sum(p1.since(p0).read.values()), grads))
        return steps


def layer_major_run(out, nvme_dir, *, layer_major, **overrides):
    traffic, rec = StepTraffic(), Losses()
    values = dict(
        per_device_train_batch_size=LM_BATCH,
        gradient_accumulation_steps=LM_GAS,
        max_steps=LM_STEPS,
        adam_epsilon=1e-4,
    )
    trainer = InfinityTrainer(
        model=gpt2(),
        args=arguments(out, **{**values, **overrides}),
        train_dataset=Tokens(),
        callbacks=[rec, traffic],
        infinity_config=small_pool(nvme_dir),
        layer_major=layer_major,
    )
    traffic.trainer = trainer
    threads = []
    compute_loss = trainer.compute_loss

    def recorded(model, inputs, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recorded
    trainer.train()
    with GatheredParameters(trainer.engine):
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.engine.close()
    return rec.losses, weights, traffic.per_step(), threads


def assert_weights_close(got, want, rel, what):
    for name, ref in want.items():
        err = (got[name] - ref).abs().max().item() / ref.abs().max().item()
        assert err <= rel, f"{what}: {name} differs by {err:.2e} of its largest element"


def test_layer_major_window_equals_the_plain_trainer_and_reads_each_unit_once(nvme_dir, tmp_path):
    """gradient_accumulation_steps=4: InfinityTrainer runs each full window through
    engine.train_batch, compute_loss in the micro-batch threads, and the epoch's short last window
    (3 batches) micro-batch-major. Oracles: the plain Trainer and InfinityTrainer(layer_major=False).

    Tolerances: the losses as test_trainer_matches_plain_trainer_and_own_loop's (1e-5 relative).
    The weights after 3 AdamW steps: each gradient is the same fp32 sum taken in another order
    (within 4 * 2^-24 of its terms' magnitudes), which Adam divides by |g| + eps: with eps = 1e-4
    that moves an element by ~2e-7 of the largest weight per step (tests/engine/test_train_batch.py
    explains the bound); against the plain Trainer torch's AdamW and the engine's kernel round
    differently too, so 1e-5 of the largest element; layer-major against micro-batch-major (the
    same engine, the same kernel) 1e-6. Bytes: a full window's step reads the parameters and writes
    the gradients as often as a step of one micro-batch (within 10%), where micro-batch-major reads
    and writes them more than 1.5 times as often."""
    rec = Losses()
    plain = Trainer(
        model=gpt2(),
        args=arguments(
            tmp_path / "plain",
            per_device_train_batch_size=LM_BATCH,
            gradient_accumulation_steps=LM_GAS,
            max_steps=LM_STEPS,
            adam_epsilon=1e-4,
        ),
        train_dataset=Tokens(),
        callbacks=[rec],
    )
    plain.train()
    plain_weights = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    assert len(rec.losses) == LM_STEPS

    (nvme_dir / "lm").mkdir()
    (nvme_dir / "mbm").mkdir()
    (nvme_dir / "g1").mkdir()
    lm_losses, lm_weights, lm_traffic, lm_threads = layer_major_run(
        tmp_path / "lm", nvme_dir / "lm", layer_major=True
    )
    mbm_losses, mbm_weights, mbm_traffic, mbm_threads = layer_major_run(
        tmp_path / "mbm", nvme_dir / "mbm", layer_major=False
    )
    assert_close(lm_losses, rec.losses, "layer-major InfinityTrainer vs plain Trainer")
    assert_close(mbm_losses, rec.losses, "micro-batch-major InfinityTrainer vs plain Trainer")
    assert_weights_close(lm_weights, plain_weights, 1e-5, "layer-major vs plain Trainer")
    assert_weights_close(lm_weights, mbm_weights, 1e-6, "layer-major vs micro-batch-major")
    # Two full windows in the micro-batch threads, the short one (3 batches) in the Trainer's.
    assert lm_threads[:8] == [f"infinity-microbatch-{i}" for i in range(4)] * 2, lm_threads
    assert len(lm_threads) == 11 and not any(
        "microbatch" in t for t in lm_threads[8:] + mbm_threads
    )

    _, _, one_traffic, _ = layer_major_run(
        tmp_path / "g1",
        nvme_dir / "g1",
        layer_major=True,
        gradient_accumulation_steps=1,
        max_steps=2,
    )
    (read_1, written_1), (read_lm, written_lm), (read_mbm, written_mbm) = (
        one_traffic[0],
        lm_traffic[0],
        mbm_traffic[0],  # each run's second step: a full window
    )
    assert read_1 > 0 and written_1 > 0
    assert read_lm <= 1.1 * read_1 and written_lm <= 1.1 * written_1, (lm_traffic, one_traffic)
    assert read_mbm > 1.5 * read_1 and written_mbm > 1.5 * written_1, (mbm_traffic, one_traffic)


def test_a_subclass_that_changes_the_batches_runs_micro_batch_major_with_a_warning(
    nvme_dir, tmp_path, caplog
):
    """train_batch would train on the batches get_batch_samples kept, not the ones a subclass
    hands training_step: such a window runs micro-batch-major (the subclass's batches), saying so."""

    class Copying(InfinityTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return super().training_step(model, dict(inputs), num_items_in_batch)

    trainer = Copying(
        model=gpt2(),
        args=arguments(tmp_path, max_steps=2),
        train_dataset=Tokens(),
        infinity_config=stage3_nvme(nvme_dir),
    )
    with caplog.at_level(logging.WARNING, logger="infinity.integrations"):
        trainer.train()
    notices = [r.getMessage() for r in caplog.records if "runs micro-batch-major" in r.getMessage()]
    assert len(notices) == 2 and "layer_major=False" in notices[0], notices
    assert trainer.engine.global_steps == trainer.state.global_step == 2
    trainer.engine.close()


def test_refusals(nvme_dir, tmp_path):
    with pytest.raises(TypeError, match="infinity_config="):
        InfinityTrainer(model=gpt2(), args=arguments(tmp_path), train_dataset=Tokens())
    with pytest.raises(FileNotFoundError, match="not a file"):
        InfinityTrainer(
            model=gpt2(), args=arguments(tmp_path), infinity_config=str(tmp_path / "missing.json")
        )
    model = gpt2()
    with pytest.raises(ValueError, match="keep one of them"):
        InfinityTrainer(
            model=model,
            args=arguments(tmp_path),
            train_dataset=Tokens(),
            optimizers=(torch.optim.AdamW(model.parameters()), None),
            infinity_config={**stage3_nvme(nvme_dir), "optimizer": {"type": "AdamW"}},
        ).train()
    with pytest.raises(TypeError, match="layer_major= takes True"):
        InfinityTrainer(
            model=gpt2(),
            args=arguments(tmp_path),
            infinity_config=stage3_nvme(nvme_dir),
            layer_major="yes",
        )
    # a checkpoint the plain Trainer wrote has no engine state
    plain = Trainer(
        model=gpt2(),
        args=arguments(tmp_path / "plain", max_steps=1, save_strategy="steps", save_steps=1),
        train_dataset=Tokens(),
    )
    plain.train()
    with pytest.raises(FileNotFoundError, match="holds no engine checkpoint"):
        infinity_run(
            tmp_path / "b", stage3_nvme(nvme_dir), resume=str(tmp_path / "plain" / "checkpoint-1")
        )


def lora_gpt2():
    """``gpt2()`` with LoRA on its attention's c_attn (a Conv1D, hence fan_in_fan_out)."""
    model = gpt2()
    torch.manual_seed(5)  # LoRA's A matrices are drawn at random
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    with peft_quietly():
        return peft.get_peft_model(model, config)


def engine_held(engine) -> dict[str, torch.Tensor]:
    """The engine's model's state dict as the engine holds it (gathered by GatheredParameters)."""
    with GatheredParameters(engine):
        return {k: v.detach().clone() for k, v in engine.module.state_dict(keep_vars=True).items()}


def saved_files(run) -> dict[str, list[str]]:
    """Each checkpoint-N/ of a run's output folder (save_total_limit kept them) with its files."""
    return {d.name: sorted(p.name for p in d.iterdir()) for d in sorted(run.glob("checkpoint-*"))}


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_save_model_and_checkpoints_write_what_the_plain_trainer_writes(nvme_dir, tmp_path, kind):
    """save_steps checkpoints (save_only_model, save_total_limit) and save_model: the same files as the
    plain Trainer's (adapters for a PEFT model), holding the engine's weights bit for bit, which equal the
    plain Trainer's within torch AdamW's fused-vs-foreach noise; reloaded by PEFT / transformers."""
    make = lora_gpt2 if kind == "lora" else gpt2
    args = dict(save_strategy="steps", save_steps=2, save_only_model=True, save_total_limit=2)
    plain = Trainer(
        model=make(), args=arguments(tmp_path / "plain", **args), train_dataset=Tokens()
    )
    plain.train()
    plain.save_model(str(tmp_path / "plain_final"))
    _, trainer = infinity_run(tmp_path / "ours", stage3_nvme(nvme_dir), model=make(), **args)
    try:
        trainer.save_model(
            str(tmp_path / "ours_final" / "nested")
        )  # folders created as the Trainer does
        held = engine_held(trainer.engine)
    finally:
        trainer.engine.close()
    ours, theirs = saved_files(tmp_path / "ours"), saved_files(tmp_path / "plain")
    assert ours == theirs and list(ours) == ["checkpoint-4", "checkpoint-6"]
    final = tmp_path / "ours_final" / "nested"
    assert sorted(p.name for p in final.iterdir()) == sorted(
        p.name for p in (tmp_path / "plain_final").iterdir()
    )
    if kind == "lora":
        name, want = (
            "adapter_model.safetensors",
            peft.get_peft_model_state_dict(trainer.model, state_dict=held),
        )
        with peft_quietly():
            reloaded = peft.PeftModel.from_pretrained(gpt2(), final)
        got = peft.get_peft_model_state_dict(reloaded)
    else:
        name, want = "model.safetensors", held
        got = GPT2LMHeadModel.from_pretrained(final).state_dict()
    reference = load_file(tmp_path / "plain_final" / name)  # the names the plain Trainer writes
    for files in (load_file(final / name), load_file(tmp_path / "ours" / "checkpoint-6" / name)):
        assert sorted(files) == sorted(reference) and all(
            torch.equal(v, want[k]) for k, v in files.items()
        )
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    for k, v in reference.items():
        assert (want[k] - v).abs().max() <= 5e-4 * v.abs().max(), k  # fused-vs-foreach AdamW noise
    nbytes = sum(v.numel() * v.element_size() for v in reference.values())
    assert claimed_nbytes(final / name) == nbytes == claimed_nbytes(tmp_path / "plain_final" / name)
    # a checkpoint with the model only cannot resume the engine: refused, naming what to do
    with pytest.raises(FileNotFoundError, match="save_only_model=False"):
        infinity_run(
            tmp_path / "again",
            stage3_nvme(nvme_dir),
            model=make(),
            resume=str(tmp_path / "ours" / "checkpoint-6"),
        )


def save_llama_base(base: Path) -> None:
    """The pretrained directory a LoRA run starts from: a tiny Llama built from its config (random
    weights, seed 0), saved by transformers."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(base)


def lora_llama(base: Path, nvme_dir=None, *, seed: int):
    """The base (read under zero.Init with ``nvme_dir``, so that the engine knows which files hold it:
    [Note: frozen units in a checkpoint]) with LoRA on q_proj and v_proj, its A matrices drawn after
    ``torch.manual_seed(seed)``."""
    reading = (
        contextlib.nullcontext() if nvme_dir is None else infinity.zero.Init(stage3_nvme(nvme_dir))
    )
    with reading:
        model = LlamaForCausalLM.from_pretrained(base)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
    )
    with peft_quietly():
        return peft.get_peft_model(model, config)


def logged_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _resume_lora_llama(rank: int, base: str, nvme: str, out: str, checkpoint: str) -> dict:
    """A fresh process: the same base, adapters from another seed, resumed from ``checkpoint``."""
    model = lora_llama(Path(base), Path(nvme), seed=6)
    rec, trainer = infinity_run(out, stage3_nvme(nvme), model=model, resume=checkpoint)
    trainer.engine.close()
    return {"new": rec.losses, "history": logged_losses(trainer), "step": trainer.state.global_step}


def test_lora_checkpoint_holds_the_plain_trainers_files_and_resumes_in_a_new_process(
    nvme_dir, tmp_path
):
    """PEFT LoRA on a Llama, stage 3 with parameters and Adam state on NVMe, save_only_model=False:
    checkpoint-3/ holds what the plain Trainer writes for a PEFT model, with the engine checkpoint in
    place of optimizer.pt / scheduler.pt, and no copy of the base (its files are named instead). A fresh
    process whose adapters start elsewhere resumes from it and logs the uninterrupted run's losses
    exactly: the same fp32 values (adapters, Adam moments, step count and lr restored; the base read
    from the same files; the same batches, from the Trainer's restored RNG and skip) go through the same
    arithmetic in the same order, so the floats are equal, bit for bit."""
    base = tmp_path / "base"
    save_llama_base(base)
    args = dict(save_strategy="steps", save_steps=3)
    Trainer(
        model=lora_llama(base, seed=5),
        args=arguments(tmp_path / "plain", **args, max_steps=3),
        train_dataset=Tokens(),
    ).train()
    full, trainer = infinity_run(
        tmp_path / "a",
        stage3_nvme(nvme_dir),
        model=lora_llama(base, nvme_dir, seed=5),
        **args,
    )
    trainer.engine.close()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    plain_files = set(saved_files(tmp_path / "plain")["checkpoint-3"])
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.json"} <= plain_files
    # the engine checkpoint's root files beside it: ``latest`` (as DeepSpeed's checkpoint-N/ has) and
    # the save lock, which stays ([Note: one save per root])
    assert set(saved_files(tmp_path / "a")["checkpoint-3"]) == (
        plain_files - {"optimizer.pt", "scheduler.pt"}
    ) | {ENGINE_TAG, "latest", LOCK_NAME}
    assert sorted(load_file(checkpoint / "adapter_model.safetensors")) == sorted(
        load_file(tmp_path / "plain" / "checkpoint-3" / "adapter_model.safetensors")
    )

    # The engine checkpoint: the adapters' fp32 masters and moments, nothing of the base, which it names
    # by its files ([Note: frozen units in a checkpoint]).
    engine_ckpt = checkpoint / ENGINE_TAG
    manifest = read_manifest(engine_ckpt)
    trained = [u for u in manifest["units"] if u["trainable"]]
    frozen = [u for u in manifest["units"] if not u["trainable"]]
    adapters = [s for u in trained for s in u["slots"]]
    assert len(adapters) == 2 * 2 * 2 and all(
        "lora_" in s["name"] for s in adapters
    )  # layers, q/v, A/B
    assert frozen and all(u["source"] is not None for u in frozen)
    parts = {}
    for part in engine_ckpt.glob("part-*.safetensors"):
        parts.update({n: e.nbytes for n, e in read_header(str(part)).entries.items()})
    assert sorted(parts) == sorted(
        f"u{i}.{r}"
        for i, u in enumerate(manifest["units"])
        if u["trainable"]
        for r in ("master", "exp_avg", "exp_avg_sq")
    )
    assert sum(parts.values()) == sum(3 * 4 * u["shard_numel"] for u in trained)
    # A copy of the base, in any of its units' forms, would alone fill the base's parameter bytes
    # (fp32 here); the part files (headers and the adapters' 4 KiB-padded arrays included) stay below.
    base_model = LlamaForCausalLM.from_pretrained(base)
    base_nbytes = sum(p.numel() * p.element_size() for p in base_model.parameters())
    part_files = sum(f.stat().st_size for f in engine_ckpt.glob("part-*.safetensors"))
    assert part_files < base_nbytes, (part_files, base_nbytes)

    resumed_nvme = nvme_dir / "resumed"
    resumed_nvme.mkdir()
    (resumed,) = run_distributed(
        _resume_lora_llama,
        str(base),
        str(resumed_nvme),
        str(tmp_path / "b"),
        str(checkpoint),
        world_size=1,
    )
    assert resumed["step"] == MAX_STEPS and len(full.losses) == MAX_STEPS
    assert resumed["new"] == full.losses[3:]  # bitwise: the same floats
    assert resumed["history"] == logged_losses(trainer) == full.losses


def test_the_trainers_logs_hold_the_engines_step_figures(nvme_dir, tmp_path):
    """log_history (and so every report_to integration) gets each step's figures under
    infinity.monitor's names: the records the engine handed its listeners."""
    trainer = InfinityTrainer(
        model=gpt2(),
        args=arguments(tmp_path, max_steps=2),
        train_dataset=Tokens(),
        infinity_config=stage3_nvme(nvme_dir),
    )
    records = []

    class Listen(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            trainer.engine.add_step_listener(records.append)

    trainer.add_callback(Listen())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == len(records) == 2
    for log, record in zip(logs, records, strict=True):
        assert log["Infinity/nvme_read_bytes"] == record.read_nbytes > 0
        assert log["Infinity/nvme_write_bytes"] == record.write_nbytes
        assert log["Infinity/prefetch_on_demand"] == record.on_demand
        assert log["Infinity/step_time_s"] == record.step_time_s > 0
        assert log["Train/Samples/train_loss"] == record.loss
        assert abs(log["loss"] - record.loss) <= 1e-4 * abs(record.loss)  # the Trainer rounds
        assert log["Train/Samples/lr"] == pytest.approx(log["learning_rate"], rel=1e-12)
    trainer.engine.close()
