"""NF4 dequantisation: infinity's kernel (each ISA this CPU runs) vs the memory-bandwidth bound, torch ops
and bitsandbytes' CPU dequantize_4bit; plain NF4 and NF4 with double quantisation (its scales quantised
again: the kernel dequantises them in the same pass); and the widest ISA's kernel with plain stores in
place of its non-temporal ones (what streaming the output saves).

    python bench/dequant.py            # 64M elements into bf16, 2 threads, 5 rounds
    python bench/dequant.py --quick    # seconds: 4M elements, 3 rounds (the CI smoke run)

A dequantisation of n elements in groups of g into bf16 reads n/2 code bytes and 4n/g scale bytes
(double quantisation: n/g scale codes, 4n/(256g) block absmax bytes and the offset) and writes 2n bytes.
The bound is a plain copy (torch's ``copy_`` of a uint8 buffer, the same threads) of as many bytes as
plain NF4 moves — half read, half written — the most any kernel could do with that traffic; the figure
of merit is a contender's GB/s (its own bytes over its time) over the copy's (1.0: at the bound). Every
contender runs once per round, in turn, on the same codes and scales; ratios are taken inside a round
and reported as median and min-max over the rounds. Writes a JSON into bench/results/ (--quick:
bench/out/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infinity import _adam  # noqa: E402
from infinity.optim import kernel  # noqa: E402
from infinity.weights import nf4  # noqa: E402

ISA_CODES = {"scalar": _adam.SCALAR, "avx2": _adam.AVX2, "avx512": _adam.AVX512}


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Seconds per call, the best of ``repeat`` (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def torch_ops(codes: torch.Tensor, absmax: torch.Tensor, n: int, g: int, out: torch.Tensor) -> None:
    """The same arithmetic as a chain of torch ops (what the kernel replaces)."""
    q = torch.stack((codes >> 4, codes & 0xF), dim=1).reshape(-1)[:n].long()
    out.copy_(nf4.CODE[q].view(-1, g).mul_(absmax[:, None]).view(-1))


def cached_stores(fn: Callable[[], object]) -> None:
    """``fn`` with the kernel's non-temporal stores of a large output off: what streaming saves
    (a plain store reads each line of the output before writing it)."""
    previous = _adam.stream_min_bytes()
    _adam.set_stream_min_bytes(2**63)
    try:
        fn()
    finally:
        _adam.set_stream_min_bytes(previous)


def contenders(
    codes, absmax, nested: nf4.NestedScales, n, g, out, threads
) -> dict[str, tuple[Callable[[], object], int]]:
    """Each contender's call and the bytes it moves."""
    plain = codes.numel() + 4 * absmax.numel() + 2 * n
    dq = codes.numel() + nested.codes.numel() + 4 * (nested.absmax.numel() + 1) + 2 * n
    runs: dict[str, tuple[Callable[[], object], int]] = {}
    for name in kernel.supported_isas():
        code = ISA_CODES[name]
        runs[f"infinity {name}"] = (
            lambda code=code: nf4.dequantize_into(
                codes, absmax, out, g, isa=code, num_threads=threads
            ),
            plain,
        )
        runs[f"infinity {name}, double quant"] = (
            lambda code=code: nf4.dequantize_into(
                codes, nested, out, g, isa=code, num_threads=threads
            ),
            dq,
        )
    best = kernel.best_isa()
    runs[f"infinity {best}, plain stores"] = (
        lambda: cached_stores(
            lambda: nf4.dequantize_into(
                codes, absmax, out, g, isa=ISA_CODES[best], num_threads=threads
            )
        ),
        plain,
    )
    runs["torch ops"] = (lambda: torch_ops(codes, absmax, n, g, out), plain)
    try:
        import bitsandbytes.functional as bnb  # the bench's own optional contender
    except ImportError:
        return runs
    state = bnb.QuantState(
        absmax=absmax, shape=torch.Size([n]), code=nf4.CODE, blocksize=g, quant_type="nf4",
        dtype=out.dtype,
    )  # fmt: skip
    runs["bitsandbytes dequantize_4bit"] = (lambda: bnb.dequantize_4bit(codes, state), plain)
    state2 = bnb.QuantState(
        absmax=nested.absmax, code=nf4.DYNAMIC_CODE, blocksize=nf4.SCALE_BLOCK, dtype=torch.float32
    )
    dq_state = bnb.QuantState(
        absmax=nested.codes, shape=torch.Size([n]), code=nf4.CODE, blocksize=g, quant_type="nf4",
        dtype=out.dtype, offset=torch.tensor(nested.offset), state2=state2,
    )  # fmt: skip
    runs["bitsandbytes dequantize_4bit, double quant"] = (
        lambda: bnb.dequantize_4bit(codes, dq_state),
        dq,
    )
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4M elements, 3 rounds: seconds (CI)")
    ap.add_argument("--numel", type=int, default=None, help="elements (default 64M; --quick 4M)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="default 5; --quick 3")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    n = args.numel or ((4 << 20) if args.quick else (64 << 20))
    g, rounds = args.group_size, args.rounds or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    results = os.environ.get("INFINITY_BENCH_RESULTS")  # tests/test_benchmarks.py's smoke runs
    out_path = args.out or (
        Path(results) / f"dequant{'-quick' if args.quick else ''}.json"
        if results
        else ROOT / "bench" / ("out/dequant-quick.json" if args.quick else "results/dequant.json")
    )

    codes, absmax = nf4.quantize(torch.randn(n) * 0.02, g)
    nested = nf4.quantize_scales(absmax)
    out = torch.empty(n, dtype=torch.bfloat16)
    moved = codes.numel() + 4 * absmax.numel() + 2 * n
    src = torch.empty(moved // 2, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    runs = {"bound: copy of the same bytes": ((lambda: dst.copy_(src)), 2 * src.numel()), **contenders(
        codes, absmax, nested, n, g, out, args.threads
    )}  # fmt: skip
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fn, _nbytes) in runs.items():
            seconds[name].append(timed(fn, 3))
    bound_nbytes = runs["bound: copy of the same bytes"][1]
    bound = seconds["bound: copy of the same bytes"]
    rows = {}
    for name, ts in seconds.items():
        nbytes = runs[name][1]
        ratios = [(nbytes / t) / (bound_nbytes / b) for b, t in zip(bound, ts, strict=True)]
        rows[name] = {
            "ms": statistics.median(ts) * 1e3,
            "bytes_moved": nbytes,
            "GB/s": nbytes / statistics.median(ts) / 1e9,
            "of bound": {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            },
        }
    result = {
        "benchmark": "nf4 dequantisation",
        "command": "python bench/dequant.py" + (" --quick" if args.quick else ""),
        "numel": n,
        "group_size": g,
        "out_dtype": "bfloat16",
        "bytes_moved": moved,
        "threads": args.threads,
        "rounds": rounds,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "isas": list(kernel.supported_isas()),
            "torch": torch.__version__,
            "loadavg_start": load,  # on a loaded machine the figures are not the kernel's
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
        "results": rows,
    }
    print(
        f"NF4 -> bf16, {n / 1e6:g}M elements, groups of {g}, {args.threads} threads, {rounds} rounds"
    )
    print("| contender | ms | GB/s | of the copy bound (median, min-max) |\n|---|---:|---:|---:|")
    for name, r in rows.items():
        b = r["of bound"]
        print(
            f"| {name} | {r['ms']:.2f} | {r['GB/s']:.2f} | "
            f"{b['median']:.2f} ({b['min']:.2f}-{b['max']:.2f}) |"
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
