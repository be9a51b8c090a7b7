"""The tiny PEFT models the LoRA tests train, and their oracle: the same PEFT model trained by plain
PyTorch.

``lora`` wraps one of tests/hf/models.py's models in PEFT's LoRA (rank 4, no dropout) on its
attention projections; ``plain_peft`` trains the tiny Llama's LoRA as plain PEFT would be trained
(tests/hf/reference.py's ``plain_train``: torch's AdamW over the adapters, clipping).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import peft
import torch

from tests.hf.models import build
from tests.hf.reference import plain_train

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing`` as it wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning
        )
        yield


def lora(model: torch.nn.Module, arch: str = "llama", *, seed: int = 1) -> peft.PeftModel:
    """``model`` (an ``arch`` of tests/hf/models.py) with LoRA adapters on its attention projections;
    ``seed``: the adapters' starting values (LoRA's A matrices are drawn at random)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=TARGETS[arch],
        fan_in_fan_out=arch == "gpt2",  # GPT-2's Conv1D holds its weight transposed
    )
    with peft_quietly():
        return peft.get_peft_model(model, config)


def plain_peft(
    *, steps: int, prepare: Callable[[torch.nn.Module], None] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The tiny Llama's LoRA (base seed 0, adapters seed 1) trained by plain PyTorch for ``steps``:
    the per-step losses and the trained parameters by name. ``prepare(model)``: run on the PEFT model
    before training (to change the frozen base's values, say)."""
    model = lora(build("llama", seed=0))
    if prepare is not None:
        prepare(model)
    losses = plain_train(model, "llama", steps=steps)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_loads_as(out, want: torch.nn.Module) -> None:
    """The directory ``out`` loads with ``from_pretrained`` into ``want``'s class, with its weights
    and its logits, exactly."""
    import transformers

    from tests.hf.models import batch

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(want)
    ref, got = want.state_dict(), loaded.state_dict()
    assert got.keys() == ref.keys()
    for n, w in ref.items():
        assert torch.equal(got[n], w), n
    ids = batch("llama", 9)["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want(ids).logits)
