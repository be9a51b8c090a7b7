"""``infinity generate --model-dir DIR`` and from_pretrained (issue 15): a save_pretrained directory of a
model built from config (random weights, no downloads) with a small word-level tokenizer; the
continuation printed is plain ``model.generate``'s.
"""

from __future__ import annotations

import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import infinity
from infinity.cli.main import main
from infinity.inference import from_pretrained
from tests.inference.models import PAD, VOCAB, inference_config, pair, prompts

WORDS = ["<pad>", "<bos>", "<eos>"] + [f"w{i}" for i in range(3, VOCAB)]


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def save(name: str, d, dtype=torch.float32):
    model, plain = pair(name)
    model.to(dtype).save_pretrained(d)
    tokenizer().save_pretrained(d)
    return plain.to(dtype)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_from_pretrained_gives_the_checkpoints_model(name, nvme_dir, tmp_path):
    plain = save(name, tmp_path / "model")
    cfg = inference_config(nvme_dir)
    model = from_pretrained(tmp_path / "model", cfg)
    assert all(p.numel() == 0 for p in model.parameters())  # in the NVMe store since zero.Init
    ids, mask = prompts(3, padded=True)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    engine = infinity.initialize(model, cfg)
    try:
        with torch.no_grad():
            want = plain(input_ids=ids, attention_mask=mask).logits
        got = engine(input_ids=ids, attention_mask=mask).logits
        real = mask.bool()
        assert torch.allclose(got[real], want[real], rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert engine.generate(ids, **kw).tolist() == plain.generate(ids, **kw).tolist()
    finally:
        engine.close()


def test_a_directory_without_safetensors_is_refused(nvme_dir, tmp_path):
    pair("gpt2")[0].config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        from_pretrained(tmp_path, inference_config(nvme_dir))


@pytest.mark.parametrize(
    "name,batch,bits", [("gpt2", 1, None), ("llama", 2, None), ("llama", 1, 8)]
)
def test_generate_prints_the_continuation(name, batch, bits, nvme_dir, tmp_path, capsys):
    d = tmp_path / "model"
    plain = save(name, d)
    prompt = "w5 w17 w99 w42 w7"
    ids = tokenizer()(prompt, return_tensors="pt")["input_ids"]
    argv = [
        "generate",
        "--model-dir",
        str(d),
        "--prompt",
        prompt,
        "--batch",
        str(batch),
        "--max-new-tokens",
        "6",
        "--nvme-path",
        str(nvme_dir),
    ]
    code = main(argv + (["--bits", str(bits)] if bits else []))
    out = capsys.readouterr()
    assert code == 0, out.err
    assert (
        "6/6 tokens" in out.err
        and "tok/s" in out.err
        and "GB/s read" in out.err
        and "peak RSS" in out.err
    )
    if bits is None:
        want = plain.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=PAD)[
            0, ids.shape[1] :
        ]
        assert out.out.strip() == tokenizer().decode(want, skip_special_tokens=True).strip()
    else:  # quantised: a continuation of the right length (its accuracy is test_quantized.py's)
        assert len(out.out.split()) <= 6 and out.out.strip()


def test_generate_refuses_a_directory_without_a_tokenizer(nvme_dir, tmp_path, capsys):
    pair("gpt2")[0].save_pretrained(tmp_path)
    code = main(
        ["generate", "--model-dir", str(tmp_path), "--prompt", "w3", "--nvme-path", str(nvme_dir)]
    )
    assert code == 2 and "cannot read a tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("name,batch", [("gpt2", 1), ("llama", 3)])
def test_sampling_with_a_seed_equals_transformers_generate(name, batch, nvme_dir, tmp_path, capsys):
    """--do-sample with --temperature/--top-k/--top-p/--seed: transformers' own sampling on the plain model
    with the same seed (the engine runs the model's generate; its logits equal plain PyTorch's)."""
    d = tmp_path / "model"
    plain = save(name, d)
    prompt = "w5 w17 w99 w42 w7"
    ids = tokenizer()([prompt] * batch, return_tensors="pt")["input_ids"]
    sampling = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(1234)
    want = plain.generate(ids, max_new_tokens=8, pad_token_id=PAD, **sampling)[:, ids.shape[1] :]
    code = main(
        [
            "generate",
            "--model-dir",
            str(d),
            "--prompt",
            prompt,
            "--batch",
            str(batch),
            "--max-new-tokens",
            "8",
            "--nvme-path",
            str(nvme_dir),
            "--do-sample",
            "--temperature",
            "0.7",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
            "--seed",
            "1234",
            "--no-progress",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [tokenizer().decode(r, skip_special_tokens=True).strip() for r in want]
    assert out.out.strip().splitlines() == list(dict.fromkeys(rows))
    if batch > 1:
        assert len(set(rows)) > 1  # the rows were sampled, not copies of one greedy row


def test_tokens_stream_to_stdout_as_they_are_produced(nvme_dir, tmp_path, capsys, monkeypatch):
    d = tmp_path / "model"
    plain = save("gpt2", d)
    forwards = []
    import infinity.inference.pretrained as pretrained

    load = pretrained.from_pretrained

    def counted(*args, **kwargs):
        model = load(*args, **kwargs)
        model.register_forward_hook(lambda *_: forwards.append(1))
        return model

    monkeypatch.setattr(pretrained, "from_pretrained", counted)
    writes = []
    real_write = sys.stdout.write
    monkeypatch.setattr(
        sys.stdout, "write", lambda s: (writes.append((s, len(forwards))), real_write(s))[1]
    )
    prompt = "w5 w17 w99 w42 w7"
    code = main(
        [
            "generate",
            "--model-dir",
            str(d),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "8",
            "--nvme-path",
            str(nvme_dir),
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    ids = tokenizer()(prompt, return_tensors="pt")["input_ids"]
    want = plain.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=PAD)[
        0, ids.shape[1] :
    ]
    assert out.out.strip() == tokenizer().decode(want, skip_special_tokens=True).strip()
    # the first words were written while generation still ran (8 forwards in all: prefill + 7 decode steps)
    texts = [(s, n) for s, n in writes if s.strip()]
    assert len(texts) > 1 and texts[0][1] < 8, writes
    assert "8/8 tokens" in out.err


def test_generate_names_a_missing_model_directory(nvme_dir, tmp_path, capsys):
    missing = tmp_path / "nonexistent"
    code = main(
        ["generate", "--model-dir", str(missing), "--prompt", "w3", "--nvme-path", str(nvme_dir)]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"infinity generate: --model-dir {missing} does not exist"


def test_sampling_options_without_do_sample_are_refused(nvme_dir, tmp_path, capsys):
    d = tmp_path / "model"
    save("gpt2", d)
    code = main(
        [
            "generate",
            "--model-dir",
            str(d),
            "--prompt",
            "w3",
            "--nvme-path",
            str(nvme_dir),
            "--temperature",
            "0.5",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--temperature applies only with --do-sample" in err
