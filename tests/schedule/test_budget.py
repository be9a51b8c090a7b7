"""ScheduleBudget: validation, DeepSpeed's element counts, and the engine-facing refusals."""

import pytest

from infinity.memory import BufferPool
from infinity.schedule import PrefetchScheduler, ScheduleBudget, ScheduleConfigError
from infinity.store import TieredStore

MiB = 1 << 20


@pytest.mark.parametrize("bad", [-1, 1.5, True, "5e7", float("inf"), None])
def test_budget_refuses_what_is_not_a_byte_count(bad):
    with pytest.raises(ScheduleConfigError, match="max_live_nbytes"):
        ScheduleBudget(0, bad, 0)


def test_from_deepspeed_converts_elements_to_bytes():
    b = ScheduleBudget.from_deepspeed(
        prefetch_bucket_size=5e7, max_live_parameters=1e9, max_reuse_distance=1e9, itemsize=2
    )
    assert (b.prefetch_bucket_nbytes, b.max_live_nbytes, b.max_reuse_distance_nbytes) == (
        10**8,
        2 * 10**9,
        2 * 10**9,
    )
    with pytest.raises(ScheduleConfigError, match="stage3_prefetch_bucket_size"):
        ScheduleBudget.from_deepspeed(
            prefetch_bucket_size=-1, max_live_parameters=1, max_reuse_distance=1, itemsize=2
        )


def test_check_serves_names_the_key_and_the_value_that_works():
    b = ScheduleBudget.from_deepspeed(
        prefetch_bucket_size=1000, max_live_parameters=1000, max_reuse_distance=0, itemsize=2
    )
    b.check_serves(largest_unit_nbytes=2000, pool_capacity=4096)
    with pytest.raises(ScheduleConfigError) as e:
        b.check_serves(largest_unit_nbytes=3000, largest_unit="'h.0.mlp'")
    msg = str(e.value)
    assert (
        "stage3_max_live_parameters" in msg
        and "at least 1500 elements" in msg
        and "'h.0.mlp'" in msg
    )
    with pytest.raises(ScheduleConfigError, match=r"holds at once.*at least 1800 elements"):
        b.check_serves(largest_unit_nbytes=1500, working_set_nbytes=3600)
    with pytest.raises(
        ScheduleConfigError, match=r"buffer_count / buffer_size.*>= 2048 elements"
    ) as e:
        b.check_serves(largest_unit_nbytes=2000, pool_capacity=2048)
    assert "only the waiting caller could release" in str(e.value)
    # Units at home in host memory take no pool memory: only those on NVMe count.
    b.check_serves(largest_unit_nbytes=2000, pool_capacity=2048, pool_working_set_nbytes=0)
    with pytest.raises(ScheduleConfigError, match=r">= 4096 elements"):
        b.check_serves(
            largest_unit_nbytes=2000,
            working_set_nbytes=2000,
            pool_capacity=4096,
            pool_working_set_nbytes=8000,
        )


def test_for_engine_checks_against_the_store_pool(nvme_dir):
    with TieredStore(nvme_dir, pool=BufferPool(2, MiB)) as store:
        s = PrefetchScheduler.for_engine(
            store,
            prefetch_bucket_size=5e5,
            max_live_parameters=2e6,
            max_reuse_distance=1e6,
            itemsize=2,
            largest_unit_nbytes=MiB,
            working_set_nbytes=2 * MiB,
            tier="host",
        )
        assert s.budget.max_live_nbytes == 4 * 10**6 and s.budget.itemsize == 2
        s.close()
        with pytest.raises(ScheduleConfigError, match="offload_param.buffer_count"):
            PrefetchScheduler.for_engine(
                store,
                prefetch_bucket_size=0,
                max_live_parameters=1e7,
                max_reuse_distance=0,
                itemsize=2,
                largest_unit_nbytes=MiB,
                working_set_nbytes=3 * MiB,
            )


def test_for_engine_skips_the_pool_check_for_a_store_without_nvme():
    with TieredStore(None, pool=BufferPool(1, 4096)) as store:  # every unit at home in host memory
        s = PrefetchScheduler.for_engine(
            store,
            prefetch_bucket_size=0,
            max_live_parameters=1e6,
            max_reuse_distance=0,
            itemsize=4,
            largest_unit_nbytes=MiB,
            working_set_nbytes=2 * MiB,
        )
        s.close()


def test_constructor_refuses_a_non_store_and_a_bad_tier(nvme_dir):
    with pytest.raises(TypeError, match="TieredStore"):
        PrefetchScheduler(
            object(), prefetch_bucket_nbytes=0, max_live_nbytes=0, max_reuse_distance_nbytes=0
        )
    with TieredStore(nvme_dir, pool=BufferPool(1, MiB)) as store:
        with pytest.raises(ValueError, match="tier"):
            PrefetchScheduler(
                store,
                prefetch_bucket_nbytes=0,
                max_live_nbytes=0,
                max_reuse_distance_nbytes=0,
                tier="gpu",
            )
