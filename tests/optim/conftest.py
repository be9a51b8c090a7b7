import pytest
from adam_helpers import streamed_stores

from infinity.optim import kernel


@pytest.fixture(params=kernel.ISAS)
def isa(request):
    """Runs the test once per kernel set (scalar, AVX2, AVX-512) this CPU supports."""
    name = request.param
    if name not in kernel.supported_isas():
        pytest.skip(
            f"this CPU cannot run the {name} kernels (it supports {', '.join(kernel.supported_isas())})"
        )
    with kernel.use_isa(name):
        yield name


@pytest.fixture(params=[False, True], ids=["cached-copy", "streamed-copy"])
def copy_mode(request):
    """Runs the test with the 16-bit copy written through the cache, and with non-temporal stores."""
    with streamed_stores(request.param):
        yield request.param
