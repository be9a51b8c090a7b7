"""Trains a model for a few steps through infinity.initialize and reports what the OS saw.

The model is infinity's GPT (``"model"``: GPTConfig fields) or a transformers
one (``"hf"``: ``{"arch": "gpt2" | "llama", "config": {...}, "checkpointing":
"reentrant" | "non_reentrant" | null}``, built from its config as
``build_hf`` builds it, with gradient checkpointing enabled as asked, and with
``"lora": {"r": ..., "targets": [...]}`` wrapped in PEFT's LoRA, whose base is frozen).

Run as ``python tests/estimate/probe.py '<json spec>'`` (a fresh process, so
the peak is this run's): prints one JSON line with the resident set after
``import torch, infinity`` (the baseline), the peak host memory (VmHWM plus
hugetlb pages, which VmHWM does not count), the bytes the swap files occupy on
disk while training, and the losses. With ``"train_batch": true`` each step is one
``engine.train_batch`` over the config's gradient_accumulation_steps micro-batches (layer-major,
in blocks as the config's ``layer_major.block`` says).
"""

from __future__ import annotations

import json
import os
import sys
import threading


def status() -> dict[str, int]:
    from infinity.host import process_status

    st = process_status()
    return {k: st[k] for k in ("VmHWM", "VmRSS", "HugetlbPages") if k in st}


def disk_nbytes(root: str) -> int:
    """Bytes allocated on disk (st_blocks) under ``root``: what fallocate reserved."""
    total = 0
    for d, _, files in os.walk(root):
        for name in files:
            total += os.stat(os.path.join(d, name)).st_blocks * 512
    return total


class Sampler(threading.Thread):
    """The largest HugetlbPages and swap-file bytes seen, every few milliseconds."""

    def __init__(self, nvme: str | None):
        super().__init__(daemon=True)
        self.nvme = nvme
        self.hugetlb = 0
        self.swap = 0
        self.stopped = threading.Event()

    def sample(self) -> None:
        self.hugetlb = max(self.hugetlb, status().get("HugetlbPages", 0))
        if self.nvme:
            self.swap = max(self.swap, disk_nbytes(self.nvme))

    def run(self) -> None:
        while not self.stopped.wait(0.002):
            self.sample()

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.sample()


def build_hf(hf: dict):
    """A transformers model from its config (random weights), checkpointed as ``hf["checkpointing"]`` says."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    arch = {"gpt2": (GPT2Config, GPT2LMHeadModel), "llama": (LlamaConfig, LlamaForCausalLM)}
    config_cls, model_cls = arch[hf["arch"]]
    model = model_cls(config_cls(**hf["config"]))
    if hf.get("checkpointing"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": hf["checkpointing"] == "reentrant"}
            )
    if hf.get("lora"):
        import peft

        r = hf["lora"]["r"]
        lora = peft.LoraConfig(
            r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=hf["lora"]["targets"]
        )
        with warnings.catch_warnings():  # peft 0.21 reads transformers 5's deprecated attribute
            warnings.simplefilter("ignore", FutureWarning)
            model = peft.get_peft_model(model, lora)
    model.train()
    return model


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    import infinity
    from infinity.estimate import runtime_baseline_nbytes
    from infinity.models import GPT, GPTConfig

    torch.set_num_threads(1)
    if spec.get("hf") is not None:
        # the user's process has imported the model's classes before initialize: part of its baseline
        from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401

        if spec["hf"].get("lora"):
            import peft  # noqa: F401
    baseline = runtime_baseline_nbytes()
    sampler = Sampler(spec.get("nvme_path"))
    sampler.start()
    hf = spec.get("hf")
    torch.manual_seed(0)
    if hf is not None:
        model = build_hf(hf)
        vocab = model.config.vocab_size
        num_params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    else:
        cfg = GPTConfig(**spec["model"])
        vocab = cfg.vocab_size
        if spec.get("zero_init"):
            # The init store's files and the runtime's coexist only until initialize closes the init
            # store: sample right then, not only when the sampler thread happens to run (it may miss it).
            from infinity.zero.init import InitStore

            close = InitStore.close

            def sampled_close(store):
                sampler.sample()
                close(store)

            InitStore.close = sampled_close
            with infinity.zero.Init(config=spec["config"]):
                model = GPT(cfg)
        else:
            model = GPT(cfg)
        num_params = cfg.num_params
    phases = {"built": status()}
    init_pool = None
    if spec.get("zero_init"):
        import weakref

        from infinity.zero.init import init_store_of

        init_store = init_store_of(model.parameters())
        if init_store is not None:
            init_pool = weakref.ref(init_store.store.pool)
        del init_store
    engine = infinity.initialize(model, spec["config"])
    phases["initialized"] = status()
    # the estimate counts zero.Init's pool in initialize's phase only (itemise.py "zero.Init pool")
    init_pool_alive = init_pool is not None and init_pool() is not None
    nvme = spec.get("nvme_path")
    swap = disk_nbytes(nvme) if nvme else 0
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(spec.get("steps", 2)):
        if spec.get("train_batch"):
            window = [
                torch.randint(0, vocab, (spec["micro_batch"], spec["seq"]), generator=g)
                for _ in range(engine.gradient_accumulation_steps)
            ]
            window = [{"input_ids": x, "labels": x} if hf is not None else (x, x) for x in window]
            losses.append(engine.train_batch(window).item())
        else:
            x = torch.randint(0, vocab, (spec["micro_batch"], spec["seq"]), generator=g)
            loss = engine(input_ids=x, labels=x).loss if hf is not None else engine(x, x)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        phases[f"step{len(losses)}"] = status()
        if nvme:
            swap = max(swap, disk_nbytes(nvme))
    sampler.stop()
    end = status()
    engine.close()
    print(
        json.dumps(
            {
                "baseline": baseline,
                "peak": end["VmHWM"] + sampler.hugetlb,
                "hugetlb": sampler.hugetlb,
                "swap": max(swap, sampler.swap),
                "losses": losses,
                "phases": phases,
                "num_params": num_params,
                "init_pool_alive": init_pool_alive,
            }
        )
    )


if __name__ == "__main__":
    main()
