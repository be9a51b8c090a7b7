"""CheckpointReader: a checkpoint directory opened for reading, every cheap check done up front.

Opening resolves the directory (``latest`` or a tag), parses manifest.json,
compares its CRC32C, and checks that each file it lists exists with the
size saved. Rank files are read whole and their CRC32C compared on first
use; part files' headers are compared with their CRC32C, parsed, and their
tensors' offsets checked against the file. Tensor data is not read here:
load.py and export.py stream it.

Nothing here changes an engine. Errors are CheckpointError subclasses that
name the file and say what to do.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from infinity.aio import AioFile, AioHandle, crc32c
from infinity.engine.checkpoint import atomic
from infinity.engine.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from infinity.engine.checkpoint.format import (
    CHECKSUMMED_SINCE,
    FORMAT,
    MANIFEST,
    MANIFEST_CRC,
    VERSION,
    manifest_crc,
    part_name,
    rank_name,
)
from infinity.engine.checkpoint.model import UnitInfo
from infinity.weights.header import Entry, Header, parse_header, read_header_bytes
from infinity.weights.in_memory import tensors_from_bytes

log = logging.getLogger("infinity.checkpoint")

_REQUIRED = (
    "world_size",
    "stage",
    "partitions",
    "units",
    "files",
    "global_steps",
    "micro_steps",
    "skipped_steps",
)


def read_manifest(ckpt: Path, p: Path | None = None) -> dict[str, Any]:
    """The manifest of checkpoint ``ckpt``, read from ``p`` (default: ``ckpt/manifest.json``)."""
    p = ckpt / MANIFEST if p is None else p
    try:
        raw = p.read_bytes()
        doc = json.loads(raw)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"'{p}' is missing: '{ckpt}' is not a complete checkpoint"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(
            f"'{p}' is not valid JSON ({e}): the manifest is corrupt", path=str(p)
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorruptError(
            f"'{p}' is not an infinity checkpoint manifest (format {doc.get('format') if isinstance(doc, dict) else None!r}, "
            f"expected {FORMAT!r})",
            path=str(p),
        )
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointCorruptError(
            f"'{p}' has no valid format version ({version!r}): the manifest is corrupt", path=str(p)
        )
    if version > VERSION:
        raise CheckpointError(
            f"'{p}' has format version {version!r}; this infinity reads versions up to {VERSION}: upgrade infinity"
        )
    if version >= CHECKSUMMED_SINCE:
        _check_manifest_crc(p, raw)
    else:
        log.warning(
            "'%s' has format version %d, which has no checksum of the manifest or of the part files' "
            "headers: they are trusted as they are; save the checkpoint again to have them checked",
            p,
            version,
        )
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise CheckpointCorruptError(
            f"'{p}' lacks the field(s) {', '.join(missing)}: the manifest is corrupt", path=str(p)
        )
    return doc


def _check_manifest_crc(p: Path, raw: bytes) -> None:
    crcs = manifest_crc(raw)
    if crcs is None:
        raise CheckpointCorruptError(
            f"'{p}' does not end in its checksum field {MANIFEST_CRC!r}: the manifest was edited or damaged; "
            "restore it from a copy or load another checkpoint",
            path=str(p),
        )
    saved, got = crcs
    if saved != got:
        raise CheckpointCorruptError(
            f"checkpoint file '{p}' is corrupt: CRC32C {got:#010x}, but {saved:#010x} was saved (a bit flipped, "
            "or the manifest was edited); restore it from a copy or load another checkpoint",
            path=str(p),
        )


class FileSource(Protocol):
    """Where a rank reads the files of a checkpoint located over the process group (nodes.Fetcher)."""

    @property
    def dir(self) -> Path: ...

    def path(self, name: str) -> Path: ...

    def remote(self, name: str) -> bool: ...


class CheckpointReader:
    """``fetcher``: a checkpoint located over the process group, whose files this rank's node may lack
    ([Note: node-local checkpoints] in nodes.py); the tensors of those that ``entry`` hands out are
    recorded (``wanted``: (part, name) -> its entry) for the fetcher to fetch."""

    def __init__(
        self,
        path: str | os.PathLike,
        tag: str | None = None,
        *,
        warn: bool = True,
        fetcher: FileSource | None = None,
    ):
        self.fetcher = fetcher
        self.dir = fetcher.dir if fetcher is not None else atomic.resolve(path, tag, warn=warn)
        self.manifest = read_manifest(self.dir, self.path(MANIFEST))
        self.wanted: dict[tuple[int, str], Entry] = {}
        m = self.manifest
        self.world_size = int(m["world_size"])
        self.stage = int(m["stage"])
        self.partitions = int(m["partitions"])
        try:
            self.units = [UnitInfo.from_json(i, d) for i, d in enumerate(m["units"])]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointCorruptError(
                f"'{self.dir / MANIFEST}': malformed unit list ({e})", path=str(self.dir / MANIFEST)
            ) from None
        self.files: dict[str, dict[str, int]] = m["files"]
        for name in self.files:
            self._check_size(name)
        self._ranks: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        self._parts: dict[int, Header] = {}
        self._open: dict[int, AioFile] = {}

    @property
    def tag(self) -> str:
        return str(self.manifest.get("tag", self.dir.name))

    def path(self, name: str) -> Path:
        """Where this rank reads file ``name``: in its node's directory, or its copy fetched from a peer."""
        return self.fetcher.path(name) if self.fetcher is not None else self.dir / name

    def _check_size(self, name: str) -> int:
        spec = self.files.get(name)
        p = self.path(name)
        if spec is None:
            raise CheckpointCorruptError(
                f"'{self.dir / MANIFEST}' does not list '{name}'", path=str(p)
            )
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"checkpoint file '{p}' is missing (the manifest lists it): the checkpoint is damaged; restore the "
                "file from a copy or load another checkpoint"
            ) from None
        if size != int(spec["nbytes"]):
            raise CheckpointCorruptError(
                f"checkpoint file '{p}' has {size} bytes but {spec['nbytes']} were saved: it is truncated or was "
                "changed; restore it from a copy or load another checkpoint",
                path=str(p),
            )
        return size

    def rank(self, r: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(state, tensors) of rank ``r``'s rank file, its CRC32C checked."""
        if r in self._ranks:
            return self._ranks[r]
        name = rank_name(r)
        p = self.path(name)
        self._check_size(name)
        blob = p.read_bytes()
        want = int(self.files[name]["crc32c"])
        got = crc32c(blob)
        if got != want:
            raise CheckpointCorruptError(
                f"checkpoint file '{p}' is corrupt: CRC32C {got:#010x}, but {want:#010x} was saved; restore it "
                "from a copy or load another checkpoint",
                path=str(p),
            )
        try:
            header = parse_header(blob, file_nbytes=len(blob), path=str(p))
            state = json.loads(header.metadata["state"])
        except (ValueError, KeyError) as e:
            raise CheckpointCorruptError(
                f"'{p}' is not a valid rank file ({e})", path=str(p)
            ) from None
        self._ranks[r] = (state, tensors_from_bytes(blob, header))
        return self._ranks[r]

    def model_file(self, name: str) -> bytes:
        """A file saved beside the weights (config.json, adapter_config.json: model_files.py), its CRC32C
        checked."""
        p = self.path(name)
        if name not in self.files:
            raise CheckpointNotFoundError(
                f"the checkpoint '{self.dir}' has no {name}: it was saved without one"
            )
        self._check_size(name)
        blob = p.read_bytes()
        want = int(self.files[name]["crc32c"])
        if crc32c(blob) != want:
            raise CheckpointCorruptError(
                f"checkpoint file '{p}' is corrupt: CRC32C {crc32c(blob):#010x}, but {want:#010x} was saved; "
                "restore it from a copy or load another checkpoint",
                path=str(p),
            )
        return blob

    def engine_state(self) -> dict[str, Any]:
        state, _ = self.rank(0)
        if "engine" not in state:
            raise CheckpointCorruptError(
                f"'{self.dir / rank_name(0)}' lacks the engine state",
                path=str(self.dir / rank_name(0)),
            )
        return state["engine"]

    def part(self, q: int) -> Header:
        """The parsed header of part ``q``, its CRC32C compared (offsets checked against the file's size)."""
        if q not in self._parts:
            name = part_name(q, self.partitions)
            p = self.path(name)
            self._check_size(name)
            want = self._part_header_crc(q)
            try:
                blob, size = read_header_bytes(p)
                if want is not None and crc32c(blob) != want:
                    raise ValueError(
                        f"its header ({len(blob)} bytes) has CRC32C {crc32c(blob):#010x}, but "
                        f"{want:#010x} was saved; restore the file from a copy or load another checkpoint"
                    )
                self._parts[q] = parse_header(blob, file_nbytes=size, path=str(p))
            except ValueError as e:
                raise CheckpointCorruptError(
                    f"checkpoint file '{p}' is corrupt: {e}", path=str(p)
                ) from None
        return self._parts[q]

    def _part_header_crc(self, q: int) -> int | None:
        """The CRC32C saved for part ``q``'s header (in rank q's file), None in a version-1 checkpoint."""
        if int(self.manifest["version"]) < CHECKSUMMED_SINCE:
            return None
        state, _ = self.rank(q)
        try:
            return int(state["part"]["header_crc32c"])
        except (KeyError, TypeError, ValueError):
            p = self.path(rank_name(q))
            raise CheckpointCorruptError(
                f"'{p}' has no checksum of the header of its part file", path=str(p)
            ) from None

    def entry(self, q: int, name: str, dtype: torch.dtype, numel: int) -> Entry:
        e = self.part(q).entries.get(name)
        p = self.path(part_name(q, self.partitions))
        if e is None:
            raise CheckpointCorruptError(
                f"checkpoint file '{p}' lacks tensor {name!r}", path=str(p)
            )
        if e.dtype != dtype or e.numel != numel:
            raise CheckpointCorruptError(
                f"tensor {name!r} in '{p}' is {e.numel} x {e.dtype}; the manifest implies {numel} x {dtype}",
                path=str(p),
            )
        pname = part_name(q, self.partitions)
        if self.fetcher is not None and self.fetcher.remote(pname):
            self.wanted[(q, name)] = e
        return e

    def part_crc(self, q: int, name: str) -> int:
        """The CRC32C saved for tensor ``name`` of part ``q`` (in the rank file of rank q, which wrote it)."""
        state, _ = self.rank(q)
        try:
            return int(state["part"]["crc32c"][name])
        except (KeyError, TypeError):
            p = self.path(rank_name(q))
            raise CheckpointCorruptError(
                f"'{p}' has no checksum for tensor {name!r}", path=str(p)
            ) from None

    def part_path(self, q: int) -> str:
        return str(self.path(part_name(q, self.partitions)))

    def open_part(self, q: int, handle: AioHandle) -> AioFile:
        if q not in self._open:
            self.part(q)
            self._open[q] = handle.open(self.path(part_name(q, self.partitions)), "r", create=False)
        return self._open[q]

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
