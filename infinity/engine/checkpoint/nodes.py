"""Node-local checkpoints: which node holds which files, and the files a rank lacks fetched from a peer.

[Note: node-local checkpoints]
With ``checkpoint.use_node_local_storage`` (or ``save_checkpoint(...,
node_local=True)``, the transformers ``save_on_each_node`` path) there is no
directory every rank sees: each node (torchrun's ``GROUP_RANK``) keeps its own
copy of ``<root>/<tag>/`` holding its ranks' part and rank files, the same
``manifest.json`` on every node, and ``node-KKKKK.json``, that node's
checksummed list of the files it holds (``node_manifest_bytes``). Every file
of a save carries the save's ``save_id`` (a random nonce rank 0 draws), so
the parts of two different saves are never taken for one checkpoint.

Save, two phases: each node's lowest rank (its leader) takes that node's lock
and hidden directory; every rank writes and fsyncs its files there; each
leader writes the manifest and its node manifest and fsyncs the directory;
only when every node reports that (one ``agree``) does each leader rename its
directory into place and then move its ``latest``. A node killed between the
two phases leaves ``latest`` moved on some nodes and not on others: no file
system spans the nodes, so nothing can make that one step. Loads settle it
instead: ``locate`` takes, by agreement over the process group, the newest
tag among those named by any rank's ``latest`` that is complete over the
nodes of this run (every file held by some rank, one ``save_id``
everywhere), and never a half-published one.

Load on any topology: a rank reads what its node holds; what it lacks it
asks for (``Fetcher.fetch``): the manifest, rank files and part headers
whole, then exactly the tensors its shards overlap. The requests of every
rank are gathered and served in one global order, a chunk at a time
(``CHUNK_NBYTES``) from the lowest-numbered rank holding the file, with
``send``/``recv`` (so no cycle of waits can form), into a sparse copy of the
file at the same offsets under this rank's hidden ``.fetched-`` directory,
removed after the load. Each fetched tensor's CRC32C is compared with the
one its rank file saved as it arrives; rank files and headers are checked by
the reader as always. Memory: one chunk per rank, whatever the model.
A checkpoint on a shared directory is the case where every rank holds every
file: nothing is fetched.

Threading: called by one thread per rank; every function here that takes the
group is a collective every rank must call.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infinity.aio import crc32c
from infinity.engine.checkpoint import atomic
from infinity.engine.checkpoint.collective import collective_device
from infinity.engine.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPeerError,
)
from infinity.engine.checkpoint.format import (
    FORMAT,
    MANIFEST,
    manifest_bytes,
    manifest_crc,
    part_name,
)
from infinity.engine.checkpoint.reader import CheckpointReader, read_manifest
from infinity.zero.collectives import DataParallelGroup

log = logging.getLogger("infinity.checkpoint")

NODE_ENV = "GROUP_RANK"  # torchrun's node rank
CHUNK_NBYTES = 4 << 20
NODE_MANIFEST_PREFIX = "node-"


def node_index() -> int:
    """This process's node: torchrun's ``GROUP_RANK`` (0 without torchrun, where one host runs every rank)."""
    value = os.environ.get(NODE_ENV, "0")
    try:
        node = int(value)
    except ValueError:
        node = -1
    if node < 0:
        raise ValueError(
            f"{NODE_ENV}={value!r} is not a node rank (an integer >= 0, as torchrun sets)"
        )
    return node


def node_manifest_name(node: int) -> str:
    return f"{NODE_MANIFEST_PREFIX}{node:05d}.json"


@dataclasses.dataclass(frozen=True)
class Topology:
    """The node of every rank of the group."""

    nodes: tuple[int, ...]

    def ranks_of(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def leader(self, node: int) -> int:
        """The rank that creates, describes and publishes a node's directory: its lowest."""
        return self.ranks_of(node)[0]

    def describe(self, node: int) -> str:
        ranks = self.ranks_of(node)
        return f"node {node} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def node_manifest_bytes(
    *,
    save_id: str,
    tag: str,
    node: int,
    ranks: Sequence[int],
    files: Mapping[str, Mapping[str, int]],
) -> bytes:
    """``node-KKKKK.json``: the files node ``node`` holds of save ``save_id`` (size, and CRC32C where the
    manifest has one), checksummed as manifest.json is."""
    return manifest_bytes(
        {
            "format": FORMAT,
            "kind": "node",
            "save_id": save_id,
            "tag": tag,
            "node": node,
            "ranks": list(ranks),
            "files": {k: dict(v) for k, v in files.items()},
        }
    )


def read_node_manifest(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    crcs = manifest_crc(raw)
    if crcs is None or crcs[0] != crcs[1]:
        raise CheckpointCorruptError(
            f"node manifest '{path}' is corrupt (its CRC32C does not match, or it was cut short); restore "
            "it from a copy or load another checkpoint",
            path=str(path),
        )
    doc = json.loads(raw)
    if doc.get("kind") != "node" or not isinstance(doc.get("files"), dict):
        raise CheckpointCorruptError(f"'{path}' is not a node manifest", path=str(path))
    return doc


# -- which tag, and who holds what -----------------------------------------------


def _gather(group: DataParallelGroup, value: Any) -> list[Any]:
    if group.world_size == 1:
        return [value]
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, value, group=group.group)
    return out


def _inspect(d: Path) -> dict[str, Any] | None:
    """What this rank can read of checkpoint directory ``d``: None where it is not there; else its
    manifest's save id, step and file list, the files here with their saved size, and what is wrong."""
    try:
        if not (d / MANIFEST).is_file():
            return None
        m = read_manifest(d)
    except (CheckpointError, OSError) as e:
        return {"error": str(e)}
    files = {str(k): int(v["nbytes"]) for k, v in m["files"].items()}
    held = [MANIFEST]
    for name, nbytes in files.items():
        try:
            if (d / name).stat().st_size == nbytes:
                held.append(name)
        except FileNotFoundError:
            pass
    problems = []
    for p in sorted(d.glob(f"{NODE_MANIFEST_PREFIX}*.json")):
        try:
            doc = read_node_manifest(p)
        except (CheckpointError, ValueError) as e:
            problems.append(str(e))
            continue
        if doc.get("save_id") != m.get("save_id"):
            problems.append(
                f"'{p}' belongs to save {doc.get('save_id')!r} and '{d / MANIFEST}' to save "
                f"{m.get('save_id')!r}: the directory mixes the files of two different saves"
            )
    return {
        "save_id": m.get("save_id"),
        "steps": int(m["global_steps"]),
        "created": float(m.get("created_unix", 0.0)),
        "files": files,
        "saved_nodes": m.get("nodes"),
        "held": held,
        "problems": problems,
    }


@dataclasses.dataclass
class Located:
    """The checkpoint a load reads, as this rank sees it."""

    root: Path
    tag: str
    dir: Path
    """This rank's copy of the checkpoint's directory (it may hold only this node's files, or none)."""
    holders: dict[str, list[int]]
    """Every file of the checkpoint: the ranks that read it from their own node."""
    sizes: dict[str, int]
    """Every file's size, as its manifest lists it."""
    rank: int

    @property
    def everywhere(self) -> bool:
        """Whether every rank reads every file itself (a shared directory, or one node): the same on
        every rank, so either all ranks fetch (and serve) or none does."""
        ranks = {r for h in self.holders.values() for r in h}
        return all(len(h) == len(ranks) for h in self.holders.values())

    def holds(self, name: str) -> bool:
        return self.rank in self.holders.get(name, ())


def locate(
    group: DataParallelGroup, path: str | os.PathLike, tag: str | None, *, warn: bool
) -> Located:
    """The checkpoint every rank loads ([Note: node-local checkpoints]): ``tag``, or the newest named by
    some rank's ``latest`` that is complete over the nodes of this run. Every rank must call it; each
    raises the same error where there is none to load, naming the nodes, ranks and files."""
    topo = Topology(tuple(r[0] for r in _gather(group, [node_index()])))
    rank = group.rank
    local_err: CheckpointError | ValueError | None = None
    found: str | None = None
    root = Path(path)
    try:
        d = atomic.resolve(path, tag, warn=warn)
        found, root = d.name, d.parent
    except (CheckpointError, ValueError) as e:
        local_err = e
    if tag is not None and not isinstance(local_err, ValueError):
        found = str(tag)  # asked for: looked for on every node, whatever this one has
    named = _gather(group, found)
    if group.world_size == 1:
        if local_err is not None:
            raise local_err
        here = root / str(found)
        problem, _ = _verdict(str(found), [_inspect(here)], topo, root, check_files=False)
        if problem is not None:
            raise problem
        return Located(root, str(found), here, {}, {}, rank)
    candidates = sorted({t for t in named if t is not None})
    if not candidates:
        assert local_err is not None
        raise local_err
    views = _gather(group, {c: _inspect(root / c) for c in candidates})
    verdicts = {c: _verdict(c, [v[c] for v in views], topo, root) for c in candidates}
    complete = [c for c in candidates if verdicts[c][0] is None]
    if tag is not None:
        problem = verdicts[str(tag)][0]
        if problem is not None:
            raise problem
        chosen = str(tag)
    elif not complete:
        newest = max(candidates, key=lambda c: _age(c, views))
        problem = verdicts[newest][0]
        assert problem is not None
        raise problem
    else:
        chosen = max(complete, key=lambda c: _age(c, views))
        passed = [c for c in candidates if c != chosen and _age(c, views) > _age(chosen, views)]
        if passed and rank == 0:
            for c in passed:
                by = [r for r, t in enumerate(named) if t == c]
                log.warning(
                    "'latest' on rank(s) %s names checkpoint '%s', which is not complete over the nodes "
                    "of this run (%s); loading '%s', the newest that is",
                    ", ".join(map(str, by)),
                    c,
                    verdicts[c][0],
                    chosen,
                )
    sizes = next(v[chosen]["files"] for v in views if v[chosen] is not None)
    return Located(root, chosen, root / chosen, verdicts[chosen][1], sizes, rank)


def _age(tag: str, views: list[dict[str, Any]]) -> tuple[int, float]:
    for v in views:
        info = v.get(tag)
        if info and "steps" in info:
            return (info["steps"], info["created"])
    return (-1, 0.0)


def _verdict(
    tag: str,
    infos: list[dict[str, Any] | None],
    topo: Topology,
    root: Path,
    *,
    check_files: bool = True,
) -> tuple[CheckpointError | None, dict[str, list[int]]]:
    """(what makes ``tag`` unloadable on this run, or None; each file's holders). ``check_files``
    False: only what is wrong with the manifests found; missing files are left to the reader (one
    rank: it names the file as the single-node loader always has)."""
    where = f"'{root / tag}'"
    have = [(r, i) for r, i in enumerate(infos) if i is not None]
    if not have:
        return CheckpointNotFoundError(f"checkpoint {where} is on no node of this run"), {}
    for r, i in have:
        if "error" in i:
            return CheckpointCorruptError(
                f"on {topo.describe(topo.nodes[r])}: {i['error']}", path=str(root / tag)
            ), {}
        if i["problems"]:
            return CheckpointMismatchError(
                f"on {topo.describe(topo.nodes[r])}: {'; '.join(i['problems'])}; remove the stray files or "
                "load another checkpoint"
            ), {}
    ids: dict[str, list[int]] = {}
    for r, i in have:
        ids.setdefault(i["save_id"], []).append(r)
    if len(ids) > 1:
        parts = [
            f"{', '.join(sorted({topo.describe(topo.nodes[r]) for r in rs}))} hold(s) save {sid!r}"
            for sid, rs in ids.items()
        ]
        return CheckpointMismatchError(
            f"the copies of checkpoint {where} on the nodes of this run are of two different saves: "
            f"{'; '.join(parts)} ('{MANIFEST}' and the node manifests say so); a save was interrupted "
            "while it replaced that tag, or the nodes hold checkpoints of different runs: load another "
            "tag, or make every node's copy one save's"
        ), {}
    if not check_files:
        return None, {}
    files = have[0][1]["files"]
    holders = {MANIFEST: [r for r, i in have if MANIFEST in i["held"]]}
    for name in files:
        holders[name] = [r for r, i in have if name in i["held"]]
    missing = [n for n in files if not holders[n]]
    if missing:
        saved_nodes = have[0][1].get("saved_nodes") or {}
        named = [f"'{n}'{_saved_owner(n, saved_nodes)}" for n in missing]
        return CheckpointIncompleteError(
            f"checkpoint {where} is not complete over the nodes of this run: {', '.join(named)} "
            f"{'is' if len(missing) == 1 else 'are'} held by no rank (ranks looked in their own node's "
            f"{where}: {', '.join(topo.describe(n) for n in sorted(set(topo.nodes)))}); start the run "
            "on the nodes that hold them, copy the files into a node's directory, or load another tag"
        ), {}
    return None, holders


def _saved_owner(name: str, saved_nodes: Mapping[str, Sequence[int]]) -> str:
    """ " (saved by rank R on node K)" for a part or rank file, from the manifest's node map."""
    stem = name.split(".")[0]
    try:
        if stem.startswith("rank-"):
            r = int(stem[5:])
        elif stem.startswith("part-"):
            r = int(stem[5:].split("-of-")[0])
        else:
            return ""
    except ValueError:
        return ""
    for node, ranks in saved_nodes.items():
        if r in ranks:
            return f" (saved by rank {r} on node {node})"
    return f" (saved by rank {r})"


# -- fetching what this rank lacks ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Request:
    """Bytes of a checkpoint file a rank asks for: ``kind`` "file" (whole), "header" (a safetensors
    header: 8 bytes and what they count) or "range" (``nbytes`` from ``begin``, CRC32C ``crc``)."""

    name: str
    kind: str
    file_nbytes: int
    begin: int = 0
    nbytes: int = 0
    crc: int | None = None
    what: str = ""


class Fetcher:
    """This rank's view of a located checkpoint: its node's files where they are, the rest fetched from
    peers into ``staging`` (a sparse copy of each file at its own offsets)."""

    def __init__(self, group: DataParallelGroup, located: Located, staging: Path):
        self.group = group
        self.located = located
        self.staging = staging
        self._made = False

    @property
    def dir(self) -> Path:
        return self.located.dir

    def path(self, name: str) -> Path:
        return self.staging / name if self.remote(name) else self.located.dir / name

    def remote(self, name: str) -> bool:
        return not self.located.holds(name)

    def fetch(self, requests: Iterable[Request]) -> None:
        """Every rank's requests served in one global order. A collective: every rank calls it (with
        none, too). Raises what this rank failed; a peer's failure is CheckpointPeerError."""
        mine = [dataclasses.asdict(r) for r in requests]
        everyone = _gather(self.group, mine)
        error: BaseException | None = None
        failed: list[str] = []
        buf = torch.empty(CHUNK_NBYTES, dtype=torch.uint8, device=collective_device(self.group))
        for asker, reqs in enumerate(everyone):
            for k, raw in enumerate(reqs):
                req = Request(**raw)
                holders = self.located.holders[req.name]
                server = holders[k % len(holders)]
                try:
                    if self.group.rank == server:
                        err = self._serve(req, asker, buf)
                        if err is not None and error is None:
                            error = err
                    elif self.group.rank == asker:
                        err = self._receive(req, server, buf)
                        if err is not None and error is None:
                            error = err
                except (
                    OSError,
                    RuntimeError,
                ) as e:  # the transport itself failed: no protocol left
                    raise CheckpointPeerError(
                        f"fetching '{req.name}' of checkpoint '{self.located.dir}' from rank {server} "
                        f"for rank {asker} failed: {e}"
                    ) from e
        flags = _gather(self.group, error is not None)
        failed = [str(r) for r, f in enumerate(flags) if f]
        if error is not None:
            raise error
        if failed:
            raise CheckpointPeerError(
                f"fetching checkpoint files between nodes failed on rank(s) {', '.join(failed)}; their "
                "own errors say why"
            )

    def _span(self, req: Request, fd: int) -> tuple[int, int]:
        if req.kind == "file":
            return 0, os.fstat(fd).st_size
        if req.kind == "header":
            head = os.pread(fd, 8, 0)
            if len(head) != 8:
                raise OSError(errno.EIO, "shorter than a safetensors header")
            return 0, 8 + int.from_bytes(head, "little")
        return req.begin, req.nbytes

    def _send(self, t: torch.Tensor, to: int) -> None:
        dist.send(t, dst=_global(self.group, to), group=self.group.group)

    def _recv(self, t: torch.Tensor, src: int) -> None:
        dist.recv(t, src=_global(self.group, src), group=self.group.group)

    def _serve(self, req: Request, asker: int, buf: torch.Tensor) -> BaseException | None:
        """Sends the span's length, then its bytes a chunk at a time; on a read error, zeros after it
        (the asker finds the length -1 or a wrong CRC) and returns the error."""
        path = self.located.dir / req.name
        size = torch.tensor([-1], dtype=torch.int64, device=buf.device)
        fd, err = -1, None
        try:
            fd = os.open(path, os.O_RDONLY)
            begin, n = self._span(req, fd)
            size.fill_(n)
        except OSError as e:
            err = CheckpointCorruptError(
                f"'{path}' cannot be read for rank {asker}, which needs {req.what or req.name}: {e}",
                path=str(path),
            )
            begin, n = 0, 0
        try:
            self._send(size, asker)
            host = torch.empty(CHUNK_NBYTES, dtype=torch.uint8)
            for off in range(0, n, CHUNK_NBYTES):
                k = min(CHUNK_NBYTES, n - off)
                if err is None:
                    try:
                        data = os.pread(fd, k, begin + off)
                        if len(data) != k:
                            raise OSError(errno.EIO, f"{len(data)} of {k} bytes at {begin + off}")
                        host[:k].numpy()[:] = memoryview(data)
                    except OSError as e:
                        err = CheckpointCorruptError(
                            f"reading '{path}' for rank {asker} failed: {e}", path=str(path)
                        )
                if err is not None:
                    host[:k].zero_()
                buf[:k].copy_(host[:k])
                self._send(buf[:k], asker)
        finally:
            if fd >= 0:
                os.close(fd)
        return err

    def _receive(self, req: Request, server: int, buf: torch.Tensor) -> BaseException | None:
        size = torch.zeros(1, dtype=torch.int64, device=buf.device)
        self._recv(size, server)
        n = int(size.item())
        if n < 0:
            return CheckpointPeerError(
                f"rank {server} could not read '{req.name}' of checkpoint '{self.located.dir}' for this "
                "rank; its own error says why"
            )
        if not self._made:
            atomic.make_dirs(self.staging)
            self._made = True
        path = self.staging / req.name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        begin = req.begin if req.kind == "range" else 0
        crc = 0
        err: Exception | None = None
        try:
            if os.fstat(fd).st_size < req.file_nbytes:
                os.ftruncate(fd, req.file_nbytes)  # sparse: only the bytes fetched take room
            host = torch.empty(CHUNK_NBYTES, dtype=torch.uint8)
            for off in range(0, n, CHUNK_NBYTES):
                k = min(CHUNK_NBYTES, n - off)
                self._recv(buf[:k], server)
                host[:k].copy_(buf[:k])
                if err is None:
                    try:
                        os.pwrite(fd, host[:k].numpy().data, begin + off)
                    except OSError as e:
                        err = (
                            atomic.space_error(path, n, f"a copy of '{req.name}'")
                            if e.errno
                            in (
                                errno.ENOSPC,
                                errno.EDQUOT,
                            )
                            else e
                        )
                crc = crc32c(host[:k], crc)
        finally:
            os.close(fd)
        if err is None and req.crc is not None and crc != req.crc:
            err = CheckpointCorruptError(
                f"{req.what or req.name} of '{req.name}', fetched from rank {server} (which read it from "
                f"'{self.located.dir / req.name}' on its node), has CRC32C {crc:#010x}, but {req.crc:#010x} "
                "was saved: that node's file is corrupt; restore it from a copy or load another checkpoint",
                path=req.name,
            )
        return err

    def close(self) -> None:
        if self._made:
            shutil.rmtree(self.staging, ignore_errors=True)


def _global(group: DataParallelGroup, rank: int) -> int:
    return rank if group.group is None else dist.get_global_rank(group.group, rank)


def open_checkpoint(
    group: DataParallelGroup, path: str | os.PathLike, tag: str | None, *, warn: bool
) -> CheckpointReader:
    """The checkpoint a load reads, located over the process group, with the manifest, rank files and
    part headers this rank's node lacks fetched from peers (``fetch_tensors`` fetches the tensors).
    A collective; the caller closes the reader's ``fetcher``."""
    located = locate(group, path, tag, warn=warn)
    if located.everywhere:
        return CheckpointReader(located.dir, warn=False)
    staging = (
        located.root / f".{located.tag}{atomic.FETCHED}{secrets.token_hex(8)}-rank{group.rank:05d}"
    )
    fetcher = Fetcher(group, located, staging)
    try:
        fetcher.fetch(
            Request(
                name,
                "header" if name.startswith("part-") else "file",
                located.sizes.get(name, 0),
                what="its header" if name.startswith("part-") else "",
            )
            for name in sorted(located.holders)
            if fetcher.remote(name)
        )
        return CheckpointReader(path, located.tag, fetcher=fetcher)
    except BaseException:
        fetcher.close()
        raise


def close(reader: CheckpointReader) -> None:
    """Closes the reader's files and removes what its fetcher copied from peers."""
    reader.close()
    if isinstance(reader.fetcher, Fetcher):
        reader.fetcher.close()


def fetch_tensors(reader: CheckpointReader) -> None:
    """The tensors ``reader``'s plan reads from files this rank's node lacks (``reader.wanted``), fetched
    from the ranks that hold them and checked against their saved CRC32C. A collective where the
    checkpoint is not on every rank (``open_checkpoint`` gave every reader a fetcher then)."""
    wanted = []
    if isinstance(reader.fetcher, Fetcher):
        for (q, name), e in sorted(reader.wanted.items(), key=lambda kv: (kv[0][0], kv[1].begin)):
            pname = part_name(q, reader.partitions)
            wanted.append(
                Request(
                    pname,
                    "range",
                    int(reader.files[pname]["nbytes"]),
                    begin=e.begin,
                    nbytes=e.nbytes,
                    crc=reader.part_crc(q, name),
                    what=f"tensor {name!r}",
                )
            )
    if isinstance(reader.fetcher, Fetcher):
        reader.fetcher.fetch(wanted)
