"""AioHandle is built from one AioConfig: keywords, a config, or both, all through AioConfig.from_dict."""

from __future__ import annotations

import dataclasses

import pytest

from infinity.aio import AioConfig, AioHandle


def test_keywords_are_deepspeed_keys(engine):
    with AioHandle(engine=engine, block_size=8192, queue_depth=4, intra_op_parallelism=2) as h:
        assert h.config == AioConfig(engine=engine, block_size=8192, queue_depth=4, thread_count=2)


def test_from_a_config_every_field_is_kept(engine):
    cfg = AioConfig(
        block_size=8192,
        queue_depth=3,
        thread_count=2,
        single_submit=True,
        overlap_events=False,
        engine=engine,
        o_direct=False,
        use_gds=True,
    )
    for make in (AioHandle, AioHandle.from_config):
        with make(cfg) as h:
            assert h.config == cfg


def test_keywords_override_a_config(engine):
    base = AioConfig(block_size=8192, queue_depth=3, engine=engine)
    with AioHandle(base, queue_depth=5, thread_count=2) as h:
        assert h.config == dataclasses.replace(base, queue_depth=5, thread_count=2)
    assert base.queue_depth == 3


def test_auto_is_resolved_in_the_handle_config():
    with AioHandle() as h:
        assert h.config.engine in ("io_uring", "threads")
        assert h.engine == h.config.engine
        assert dataclasses.replace(h.config, engine="auto") == AioConfig()


def test_json_values_are_normalised_whichever_way_built():
    """DeepSpeed's tuner writes "false"; JSON may hold 8192.0: the engine gets False and 8192."""
    for cfg in (
        AioConfig(block_size=8192.0, single_submit="true", o_direct="False"),
        AioConfig.from_dict({"block_size": 8192.0, "single_submit": "true", "o_direct": "False"}),
    ):
        assert cfg == AioConfig(block_size=8192, single_submit=True, o_direct=False)
        assert type(cfg.block_size) is int and cfg.single_submit is True


def test_keys_and_dict_come_from_the_fields():
    names = [f.name for f in dataclasses.fields(AioConfig)]
    assert [k for k in AioConfig.KEYS if k != "intra_op_parallelism"] == names
    d = AioConfig(thread_count=3).to_dict()
    assert d["intra_op_parallelism"] == 3 and "thread_count" not in d
    assert AioConfig.from_dict(d) == AioConfig(thread_count=3)


def test_alias_and_field_agreeing_is_fine():
    assert AioConfig.from_dict({"thread_count": 2, "intra_op_parallelism": 2}).thread_count == 2
    with pytest.raises(ValueError, match="aio.intra_op_parallelism and aio.thread_count"):
        AioConfig.from_dict({"intra_op_parallelism": 2, "thread_count": 3})


def test_a_dict_is_not_a_config():
    with pytest.raises(
        TypeError, match=r"AioHandle takes an AioConfig .* got dict; .*AioHandle\(\*\*section\)"
    ):
        AioHandle({"block_size": 8192})
