"""CSVFiles: DeepSpeed's ``csv_monitor`` layout -- one file per event, ``step,<name>`` rows.

An event ``Train/Samples/train_loss`` goes to ``Train_Samples_train_loss.csv``
under the job directory, headed ``step,train_loss`` (the name's last part),
one ``samples,value`` row per optimizer step: the files DeepSpeed's
csvMonitor writes. Each write opens, appends and closes its files, so every
row is on disk when ``write_events`` returns.
"""

from __future__ import annotations

import csv
from pathlib import Path

from infinity.monitor.events import Event


class CSVFiles:
    def __init__(self, directory: Path):
        self.directory = directory
        self._started: set[str] = set()

    def path(self, name: str) -> Path:
        return self.directory / (name.replace("/", "_").replace(" ", "_") + ".csv")

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            path = self.path(name)
            with open(path, "a", newline="") as f:
                out = csv.writer(f)
                if name not in self._started:
                    self._started.add(name)
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerow([step, value])

    def close(self) -> None:
        pass
