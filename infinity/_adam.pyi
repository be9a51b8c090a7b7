"""Type stub for infinity._adam, the pybind11 module built from csrc/adam (see csrc/adam/bindings.cc).

Use infinity.optim, not this module: it checks tensors and passes their data
pointers here. Every function releases the GIL while the kernels run. Long
argument lists, flags and the isa/num_threads options are keyword-only (after
``*``), as bindings.cc declares them.
"""

from collections.abc import Sequence

FLOAT32: int
BFLOAT16: int
FLOAT16: int
SCALAR: int
AVX2: int
AVX512: int

class AdamHyper:
    """The hyper-parameters of an Adam/AdamW step (csrc/adam/adam.h's Hyper).

    Keyword-only, checked when made (ValueError naming the field), read-only;
    equal and hashable by value, picklable.
    """

    def __init__(
        self,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw: bool,
        bias_correction: bool = True,
    ) -> None: ...
    @property
    def lr(self) -> float: ...
    @property
    def beta1(self) -> float: ...
    @property
    def beta2(self) -> float: ...
    @property
    def eps(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def adamw(self) -> bool: ...
    @property
    def bias_correction(self) -> bool: ...

def isa_supported(isa: int) -> bool: ...
def best_isa() -> int: ...
def isa_name(isa: int) -> str: ...
def threading_backend() -> str: ...
def stream_min_bytes() -> int: ...
def set_stream_min_bytes(nbytes: int) -> None: ...
def adam_step(
    *,
    params: list[int],
    grads: list[int],
    exp_avgs: list[int],
    exp_avg_sqs: list[int],
    out_halfs: list[int],
    numels: list[int],
    grad_dtypes: list[int],
    half_dtypes: list[int],
    hyper: AdamHyper,
    step: float,
    isa: int,
    num_threads: int,
) -> None: ...
def has_overflow(
    data: list[int], numels: list[int], dtypes: list[int], *, isa: int, num_threads: int
) -> bool: ...
def sum_squares(data: list[int], numels: list[int], *, isa: int, num_threads: int) -> float: ...
def dequantize_nf4(
    *,
    codes: int,
    absmax: int,
    out: int,
    dtype: int,
    numel: int,
    group_size: int,
    isa: int,
    num_threads: int,
    scale_codes: int = 0,
    scale_code: int = 0,
    scale_absmax: int = 0,
    scale_offset: float = 0.0,
    scale_block: int = 256,
    begin: int = 0,
    end: int | None = None,
) -> None: ...
def bump_step_counts(
    ptrs: list[int], *, is_double: Sequence[int], increment: float
) -> list[float]: ...
def stream_bound(
    *,
    params: list[int],
    grads: list[int],
    exp_avgs: list[int],
    exp_avg_sqs: list[int],
    numels: list[int],
    isa: int,
    num_threads: int,
) -> None: ...
