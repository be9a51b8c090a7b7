#!/usr/bin/env python3
"""Node-local checkpoints: save and load time against one shared directory and against copying every
shard to one node first.

Two ranks (gloo, one host) act as two nodes (torchrun's GROUP_RANK), each with its own directory. A
GPT (``--params``) trains one step under ZeRO stage 3 with parameters and Adam state on NVMe, then,
each repetition:

  shared        save to one directory both ranks use, load from it (today's layout)
  node-local    save node-local (each node its own ranks' files), load on the same nodes
  node-local, other nodes
                load with the nodes swapped: every byte a rank needs is on the other node and comes
                over the process group (the resume on another topology)
  copy first    the node-local save, then every shard copied into one node's directory (the
                offline gathering DeepSpeed's universal checkpoints need), then a load from there

Times are wall seconds of the calls on rank 0 between barriers (fsyncs and publishing included;
the loads verify every checksum). On one host the "network" is loopback and both "nodes" share a
disk, so the fetch figures are an upper bound of what the protocol costs over the disk, not a
network measurement.

    python bench/checkpoint_nodes.py            # ~50M parameters, 3 repetitions
    python bench/checkpoint_nodes.py --quick    # smoke run in seconds

Results go to $INFINITY_BENCH_RESULTS or bench/results/ as JSON (checkpoint_nodes[-quick].json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent
WORLD = 2


def _config(swap: Path) -> dict:
    off = {"device": "nvme", "nvme_path": str(swap)}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1 << 22,
            "offload_param": {**off, "buffer_count": 4, "buffer_size": 1 << 22, "max_in_cpu": 0},
            "offload_optimizer": off,
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 32},
    }


def _timed(fn, *args, **kwargs) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - t


def _copy_all(work: Path, tag: str) -> None:
    """Rank 0: every node's files into node 0's copy of the checkpoint (the gathering step)."""
    dst = work / "gathered" / tag
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(work / "node0" / tag, dst)
    for p in (work / "node1" / tag).iterdir():
        if not (dst / p.name).exists():
            shutil.copy2(p, dst / p.name)


def _nothing(*args: object) -> None:
    pass


def _rank(rank: int, port: int, work: str, n_layer: int, d_model: int, repeat: int, q) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD)
    )
    os.environ["GROUP_RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import infinity
    from infinity.models import GPT, GPTConfig, TextCorpus

    work = Path(work)
    swap = work / f"swap{rank}"
    swap.mkdir(parents=True, exist_ok=True)
    gpt = GPTConfig(seq_len=64, n_layer=n_layer, d_model=d_model, n_head=4)
    cfg = _config(swap)
    torch.manual_seed(0)
    with infinity.zero.Init(cfg):
        model = GPT(gpt)
    engine = infinity.initialize(model, cfg)
    x, y = TextCorpus(1 << 14).batch(rank, 1, gpt.seq_len)
    engine.backward(engine(x, y))
    engine.step()
    mine = work / f"node{rank}"
    rows = []
    try:
        for rep in range(repeat):
            tag = f"rep{rep}"
            row = {
                "shared_save": _timed(engine.save_checkpoint, work / "shared", tag=tag),
                "shared_load": _timed(engine.load_checkpoint, work / "shared", tag=tag),
                "local_save": _timed(engine.save_checkpoint, mine, tag=tag, node_local=True),
                "local_load": _timed(engine.load_checkpoint, mine, tag=tag),
            }
            os.environ["GROUP_RANK"] = str(1 - rank)  # the nodes swapped: all fetched
            row["local_load_other_nodes"] = _timed(
                engine.load_checkpoint, work / f"node{1 - rank}", tag=tag
            )
            os.environ["GROUP_RANK"] = str(rank)
            row["copy_first_copy"] = _timed(_copy_all if rank == 0 else _nothing, work, tag)
            row["copy_first_load"] = _timed(engine.load_checkpoint, work / "gathered", tag=tag)
            row["checkpoint_nbytes"] = sum(
                f.stat().st_size for f in (work / "shared" / tag).iterdir()
            )
            rows.append(row)
            dist.barrier()  # both ranks have listed the files before either removes them
            if rank == 0:
                for d in ("shared", "node0", "node1", "gathered"):
                    shutil.rmtree(work / d / tag, ignore_errors=True)
            dist.barrier()
        nbytes = rows[-1]["checkpoint_nbytes"]
        # the units' sizes: under zero.Init the model's parameters are empty placeholders
        params = sum(u.layout.numel for u in engine.checkpoint_parts().units)
        if rank == 0:
            q.put({"rows": rows, "params": params, "ckpt_nbytes": nbytes})
    finally:
        engine.close()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, one repetition")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("infinity_nvme") / "checkpoint_nodes")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    n_layer, d_model, repeat = (2, 64, 1) if args.quick else (8, 704, args.repeat)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank, args=(r, port, str(args.work.absolute()), n_layer, d_model, repeat, q)
        )
        for r in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    try:
        result = q.get(timeout=3600)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(args.work, ignore_errors=True)
    if any(proc.exitcode for proc in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    rows = result["rows"]
    med = {k: _median([r[k] for r in rows]) for k in rows[0] if k != "checkpoint_nbytes"}
    summary = {
        "shared": med["shared_save"] + med["shared_load"],
        "node-local, same nodes": med["local_save"] + med["local_load"],
        "node-local, other nodes": med["local_save"] + med["local_load_other_nodes"],
        "copy every shard to one node first": med["local_save"]
        + med["copy_first_copy"]
        + med["copy_first_load"],
    }
    print(
        f"{result['params'] / 1e6:.1f}M parameters, {result['ckpt_nbytes'] / 1e6:.1f} MB checkpoint"
    )
    print(f"{'':40s} {'save s':>8s} {'load s':>8s} {'total s':>8s}")
    loads = {
        "shared": med["shared_load"],
        "node-local, same nodes": med["local_load"],
        "node-local, other nodes": med["local_load_other_nodes"],
        "copy every shard to one node first": med["copy_first_copy"] + med["copy_first_load"],
    }
    for name, total in summary.items():
        save = med["shared_save"] if name == "shared" else med["local_save"]
        print(f"{name:40s} {save:8.2f} {loads[name]:8.2f} {total:8.2f}")
    results = Path(os.environ.get("INFINITY_BENCH_RESULTS", ROOT / "results"))
    out = args.out or results / f"checkpoint_nodes{'-quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": "checkpoint_nodes",
        "params": result["params"],
        "checkpoint_nbytes": result["ckpt_nbytes"],
        "repetitions": rows,
        "median_s": med,
        "save_plus_load_s": summary,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
