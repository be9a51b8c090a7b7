"""Hugging Face's sharded layout (``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``)
against huggingface_hub as oracle: the same shards, names and index for the same tensors and limit, in
both directions, through the streaming writer the engine exports with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards
from huggingface_hub.serialization._base import parse_size_to_int
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinity.aio import AioHandle
from infinity.engine.checkpoint.weights_out import Segment, WeightFiles
from infinity.weights.hf_layout import (
    WEIGHTS_NAME,
    checkpoint_tensors,
    index_name,
    parse_size,
    shard_file_names,
    split_shards,
)
from infinity.weights.reader import TensorFiles

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
sizes = st.lists(st.integers(0, 64), min_size=1, max_size=10)
# huggingface_hub takes empty tensors for views of one storage and moves them into the first one's shard:
# where it puts them is its own; the oracle of grouping is asked about tensors with bytes.
nonempty_sizes = st.lists(st.integers(1, 64), min_size=1, max_size=10)


def state_dict(nbytes: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}.w": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate(nbytes)
    }


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@settings(max_examples=200, deadline=None)
@given(nbytes=nonempty_sizes, limit=st.integers(1, 100))
def test_shards_and_their_names_are_huggingface_hubs(nbytes, limit):
    sd = state_dict(nbytes)
    hub = split_torch_state_dict_into_shards(sd, max_shard_size=limit)
    groups = split_shards([(k, t.nbytes) for k, t in sd.items()], limit)
    assert (
        dict(zip(shard_file_names(WEIGHTS_NAME, len(groups)), groups, strict=True))
        == hub.filename_to_tensors
    )


@pytest.mark.parametrize("text", ["5GB", "500MB", "1.5GB", "10KB", "3TB", " 7 MB "])
def test_sizes_are_parsed_as_huggingface_hub_parses_them(text):
    assert parse_size(text) == parse_size_to_int(text)


@SETTINGS
@given(nbytes=sizes, limit=st.integers(1, 100), seed=st.integers(0, 3))
def test_what_huggingface_hub_saves_is_read_back(tmp_path_factory, nbytes, limit, seed):
    sd = state_dict(nbytes, seed)
    directory = tmp_path_factory.mktemp("hub")
    save_torch_state_dict(sd, directory, max_shard_size=limit)
    tensors = checkpoint_tensors(directory)
    read = {}
    with TensorFiles() as files:
        for name, t in tensors.items():
            read[name] = torch.empty(t.shape, dtype=t.dtype)
            files.read_whole(t, read[name])
    same(read, sd)
    index = directory / index_name(WEIGHTS_NAME)
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        assert {name: t.path.name for name, t in tensors.items()} == weight_map


@SETTINGS
@given(nbytes=nonempty_sizes, limit=st.integers(1, 100), seed=st.integers(0, 3))
def test_the_streaming_writer_writes_huggingface_hubs_layout(nvme_dir, nbytes, limit, seed):
    """WeightFiles (export, save_16bit_model) fed one stream of bytes: the files and index huggingface_hub
    would write for the same tensors, each shard loading with safetensors.torch."""
    sd = state_dict(nbytes, seed)
    directory = Path(nvme_dir) / f"out-{seed}-{limit}-{len(nbytes)}"
    directory.mkdir(exist_ok=True)
    segments = [Segment(k, t.dtype, tuple(t.shape)) for k, t in sd.items()]
    with AioHandle() as handle:
        out = WeightFiles(
            directory,
            handle,
            segments,
            weights_name=WEIGHTS_NAME,
            max_shard_nbytes=limit,
            replace_stale=True,
        )
        for t in sd.values():
            out.append(t)
        files = out.commit()
    hub = split_torch_state_dict_into_shards(sd, max_shard_size=limit)
    assert [f.name for f in files] == list(hub.filename_to_tensors)
    loaded = {}
    for f in files:
        shard = safetensors.torch.load_file(f)
        assert list(shard) == sorted(hub.filename_to_tensors[f.name])
        loaded.update(shard)
    same(loaded, sd)
    index = directory / index_name(WEIGHTS_NAME)
    if hub.is_sharded:
        doc = json.loads(index.read_text())
        assert doc == {"metadata": hub.metadata, "weight_map": hub.tensor_to_filename}
    else:
        assert not index.exists()
    assert {
        n: t.path.name for n, t in checkpoint_tensors(directory).items()
    } == hub.tensor_to_filename


def test_an_index_that_disagrees_with_its_shards_is_named(tmp_path: Path):
    save_torch_state_dict(
        state_dict([4, 4, 8]), tmp_path, max_shard_size=10
    )  # [layer.0, layer.1], [layer.2]
    index = tmp_path / index_name(WEIGHTS_NAME)
    doc = json.loads(index.read_text())
    doc["weight_map"]["layer.0.w"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(
        ValueError,
        match=r"puts tensor 'layer.0.w' in 'model-00002-of-00002.safetensors', but "
        r"'model-00001-of-00002.safetensors' holds it",
    ):
        checkpoint_tensors(tmp_path)
    doc["weight_map"]["layer.9.w"] = "model-00002-of-00002.safetensors"
    doc["weight_map"]["layer.0.w"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(
        ValueError,
        match=r"puts tensor 'layer.9.w' in 'model-00002-of-00002.safetensors', but "
        r"no shard holds it",
    ):
        checkpoint_tensors(tmp_path)
    doc["weight_map"] = {"layer.0.w": "../model.safetensors"}
    index.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="which is not in its directory"):
        checkpoint_tensors(tmp_path)
    index.write_text("{}")
    with pytest.raises(ValueError, match=f"'{index}' is not a safetensors index"):
        checkpoint_tensors(tmp_path)
