"""A byte progress bar with GB/s (tqdm) for saves, loads and exports large enough to wait for."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

# Below this, a save takes about a second on NVMe: not worth a bar.
PROGRESS_MIN_NBYTES = 1 << 30


class Progress:
    """Counts bytes; draws a bar on stderr when ``enabled`` (None: when ``total`` is large)."""

    def __init__(self, total_nbytes: int, desc: str, enabled: bool | None = None):
        self.total = total_nbytes
        self.done = 0
        self.start = time.perf_counter()
        show = total_nbytes >= PROGRESS_MIN_NBYTES if enabled is None else enabled
        self._bar = (
            tqdm(
                total=total_nbytes,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,  # the rate reads in GB/s, as fio and the documented figures do
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )
            if show
            else None
        )

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def close(self) -> float:
        """Removes the bar; returns the seconds since the start."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        return self.seconds

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
