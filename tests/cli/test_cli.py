"""The `infinity` command: registration, `bench aio`, `tune nvme` (its config read back by the runtime), `doctor`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from infinity.aio import AioConfig, AioHandle
from infinity.cli import main as cli_main

ENGINES = ("io_uring", "threads")


def run_cli(capsys, *argv: str) -> str:
    assert cli_main.main(list(argv)) == 0
    return capsys.readouterr().out


def test_commands_are_registered_in_one_list():
    parser = cli_main.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    names = [cmd.NAME for cmd in cli_main.COMMANDS]
    assert list(sub.choices) == names and len(set(names)) == len(names)
    assert {"demo", "bench", "tune", "estimate", "doctor", "export"} <= set(names)
    for cmd in cli_main.COMMANDS:
        assert callable(cmd.add_arguments) and callable(cmd.run) and cmd.HELP


def test_console_script_is_declared_and_runs():
    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "infinity"]
    assert ep.value == "infinity.cli.main:main"
    r = subprocess.run(
        [sys.executable, "-m", "infinity.cli.main", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "bench" in r.stdout and "doctor" in r.stdout


@pytest.mark.parametrize("engine", ENGINES)
def test_bench_aio_table_json_and_plot(capsys, nvme_dir, tmp_path, engine):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    out = run_cli(
        capsys, "bench", "aio", "--path", str(nvme_dir), "--size", "8M", "--block-sizes", "64K,1M",
        "--queue-depths", "4", "--threads", "1,2", "--engine", engine, "--json", str(out_json),
        "--plot", str(out_png), "--quiet",
    )  # fmt: skip
    assert "page cache: bypassed: every run uses O_DIRECT" in out
    assert f"engine: {engine}" in out
    for label in ("64K qd4 t1", "64K qd4 t2", "1M qd4 t1", "1M qd4 t2"):
        assert re.search(rf"^{label}\s+\d+\.\d\d\s+\d+\.\d\d$", out, re.M), out
    assert re.search(
        r"^best: \S+ qd4 t[12] \(read \d+\.\d\d GB/s, write \d+\.\d\d GB/s\)$", out, re.M
    )
    record = json.loads(out_json.read_text())
    assert record["file_nbytes"] == 8 << 20
    assert {(r["block_size"], r["thread_count"], r["op"]) for r in record["results"]} == {
        (bs, tc, op) for bs in (64 << 10, 1 << 20) for tc in (1, 2) for op in ("read", "write")
    }
    assert all(r["engine"] == engine and r["gbps"]["median"] > 0 for r in record["results"])
    assert record["machine"]["filesystem"]["type"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (nvme_dir / "infinity-bench-aio.dat").exists(), (
        "the test file is removed unless --keep"
    )


@pytest.mark.skipif(
    shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)"
)
def test_bench_aio_vs_fio_reports_ratios(capsys, nvme_dir, tmp_path):
    out_json = tmp_path / "r.json"
    out = run_cli(
        capsys, "bench", "aio", "--path", str(nvme_dir), "--size", "8M", "--block-sizes", "1M",
        "--queue-depths", "4", "--threads", "1", "--read", "--vs-fio", "--repeat", "2", "--json", str(out_json), "--quiet",
    )  # fmt: skip
    assert "fio: io_uring, direct=1" in out
    assert re.search(
        r"^1M qd4 t1\s+\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)\s+\d+\.\d\d\s+\d+\.\d\d$", out, re.M
    ), out
    (row,) = json.loads(out_json.read_text())["results"]
    assert row["op"] == "read" and len(row["gbps"]["runs"]) == len(row["fio_gbps"]["runs"]) == 2
    assert row["ratio"] > 0


@pytest.mark.skipif(
    shutil.which("fio") is None, reason="fio is not installed (apt-get install fio)"
)
def test_bench_aio_over_several_paths_measures_each_and_the_stripe(capsys, nvme_dir, tmp_path):
    a, b = nvme_dir / "a", nvme_dir / "b"
    out_json = tmp_path / "r.json"
    out = run_cli(
        capsys, "bench", "aio", "--path", str(a), str(b), "--size", "8M", "--block-sizes", "1M",
        "--queue-depths", "4", "--threads", "1", "--vs-fio", "--repeat", "1", "--json", str(out_json), "--quiet",
    )  # fmt: skip
    assert (
        "2 paths, each alone and the stripe over all (8M per path; stripe unit = block size)" in out
    )
    assert f"note: {a} and {b} are on one file system: the stripe shares its bandwidth" in out
    for target in (str(a), str(b), "stripe"):
        assert re.search(rf"^{re.escape(target)}\s+1M qd4 t1(\s+\d+\.\d\d){{6}}$", out, re.M), out
    assert re.search(
        r"^best \(stripe\): 1M qd4 t1 \(read \d+\.\d\d GB/s, write \d+\.\d\d GB/s\)$", out, re.M
    )
    record = json.loads(out_json.read_text())
    assert sorted((r["target"], r["op"]) for r in record["results"]) == sorted(
        (t, op) for t in (str(a), str(b), "stripe") for op in ("read", "write")
    )
    assert all(r["fio_gbps"]["median"] > 0 for r in record["results"])
    assert (
        record["machine"]["path"] == [str(a), str(b)] and len(record["machine"]["filesystem"]) == 2
    )
    assert not list(a.iterdir()) and not list(b.iterdir()), (
        "the test files are removed unless --keep"
    )


def test_bench_aio_refuses_a_path_listed_twice(capsys, nvme_dir):
    (nvme_dir / "link").symlink_to(nvme_dir)
    with pytest.raises(
        SystemExit,
        match=(
            rf"^--path lists the same directory twice \({nvme_dir} and {nvme_dir / 'link'}\); list each drive once$"
        ),
    ):
        cli_main.main(
            ["bench", "aio", "--path", str(nvme_dir), str(nvme_dir / "link"), "--size", "4M"]
        )
    assert not list(nvme_dir.glob("*.dat")), "refused before any test file is written"


def test_bench_aio_names_a_bad_size(capsys):
    with pytest.raises(SystemExit):
        cli_main.main(["bench", "aio", "--size", "lots"])
    assert "not a size: 'lots' (examples: 4096, 128K, 1M, 2G)" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ENGINES)
def test_tune_nvme_writes_what_the_runtime_reads(capsys, nvme_dir, tmp_path, engine):
    cfg = tmp_path / "ds_config.json"
    out = run_cli(
        capsys, "tune", "nvme", "--path", str(nvme_dir), "--out", str(cfg), "--size", "8M",
        "--block-sizes", "64K,128K", "--queue-depths", "2,8", "--threads", "1", "--engines", engine,
        "--finalists", "2", "--quiet",
    )  # fmt: skip
    aio = json.loads(cfg.read_text())["aio"]
    assert set(aio) <= set(AioConfig.KEYS), "only keys the runtime reads"
    assert set(aio) == {
        "block_size",
        "queue_depth",
        "intra_op_parallelism",
        "single_submit",
        "overlap_events",
        "engine",
    }
    assert aio["block_size"] in (64 << 10, 128 << 10) and aio["queue_depth"] in (2, 8)
    assert aio["engine"] == ("threads" if engine == "threads" else "auto")
    assert isinstance(aio["single_submit"], bool) and isinstance(aio["overlap_events"], bool)
    with AioHandle.from_config(AioConfig.from_dict(aio)) as h:
        c = h.config
        assert (c.block_size, c.queue_depth, c.thread_count) == (
            aio["block_size"],
            aio["queue_depth"],
            aio["intra_op_parallelism"],
        )
        assert (c.single_submit, c.overlap_events) == (aio["single_submit"], aio["overlap_events"])
        assert h.engine == engine
    assert f"wrote the aio section of {cfg}" in out


def test_tune_nvme_over_several_paths_tunes_the_stripe_and_measures_each_path(
    capsys, nvme_dir, tmp_path
):
    a, b = nvme_dir / "a", nvme_dir / "b"
    cfg = tmp_path / "ds_config.json"
    out = run_cli(
        capsys, "tune", "nvme", "--path", str(a), str(b), "--out", str(cfg), "--size", "8M",
        "--block-sizes", "64K,1M", "--queue-depths", "4", "--threads", "1", "--finalists", "2", "--quiet",
    )  # fmt: skip
    aio = json.loads(cfg.read_text())["aio"]
    assert aio["block_size"] in (64 << 10, 1 << 20) and aio["queue_depth"] == 4
    best = next(k for k, v in (("64K", 64 << 10), ("1M", 1 << 20)) if v == aio["block_size"])
    assert "the stripe over 2 paths (8M each), then each alone" in out
    assert (
        len(re.findall(r"^stripe\s+(64K|1M) qd4 t1 ", out, re.M)) == 2
    )  # the finalists, on the stripe
    for path in (a, b):  # the winner, on each path alone
        assert re.search(rf"^{re.escape(str(path))}\s+{best} qd4 t1 ", out, re.M), out
    assert re.search(rf"^best: {best} qd4 t1 on \S+ \(stripe\): read ", out, re.M)
    assert re.search(
        r"^stripe: read \d+\.\d\d GB/s = \d+\.\d\dx the fastest path alone, \d+% of the paths' sum",
        out,
        re.M,
    )
    assert f'"nvme_path": ["{a}", "{b}"]' in out
    assert not list(a.iterdir()) and not list(b.iterdir())


def test_tune_nvme_merges_into_an_existing_config(capsys, nvme_dir, tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(
        """{
          // DeepSpeed reads comments and trailing commas; so does the merge
          "train_batch_size": 8,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
          "aio": {"thread_count": 8, "num_threads": 4, "single_submit": "false", "use_gds": false,},
        }"""
    )
    out = run_cli(
        capsys, "tune", "nvme", "--path", str(nvme_dir), "--out", str(cfg), "--size", "4M",
        "--block-sizes", "64K", "--queue-depths", "4", "--threads", "2", "--finalists", "1", "--quiet",
    )  # fmt: skip
    config = json.loads(cfg.read_text())
    assert config["train_batch_size"] == 8 and config["zero_optimization"]["stage"] == 3
    assert config["aio"]["use_gds"] is False  # kept: the runtime reads it
    assert "num_threads" not in config["aio"] and "thread_count" not in config["aio"]
    assert config["aio"]["intra_op_parallelism"] == 2 and config["aio"]["single_submit"] is False
    assert (
        "removed from the old aio section (the runtime does not read them): num_threads, thread_count"
        in out
    )
    AioConfig.from_dict(config["aio"])


def test_doctor(capsys, nvme_dir):
    out = run_cli(capsys, "doctor", "--path", str(nvme_dir / "not" / "yet"))
    assert re.search(r"^ok  io_uring: usable$|^NO  io_uring: not usable: .+$", out, re.M), out
    assert re.search(
        r"^ok  engines built: (io_uring, threads|threads \(liburing was not found at build time\))$",
        out,
        re.M,
    )
    assert f"O_DIRECT: supported at {nvme_dir}" in out, (
        "an absent path is checked at its nearest existing parent"
    )
    # an absent path is refused by initialize: doctor says so with initialize's own message
    missing = nvme_dir / "not" / "yet"
    assert re.search(rf"^NO  path: {missing} \(ext4 on .*\), .* free of .*$", out, re.M), out
    assert f"      fix: nvme_path '{missing}' does not exist; create it (mkdir -p {missing})" in out
    assert re.search(
        r"^NO  path: .* GiB free of .* GiB$", out, re.M
    )  # memory and space in GiB, as everywhere
    assert not re.search(r"\d GB\b", out), out
    here = run_cli(capsys, "doctor", "--path", str(nvme_dir))
    assert re.search(rf"^ok  path: {nvme_dir} .* GiB free of .* GiB$", here, re.M), here
    assert re.search(r"^ok  memory: .* GiB available of .* GiB;", here, re.M)
    assert re.search(r"^ok  cpu: .*; SIMD .*; crc32c in hardware: (yes|no)$", out, re.M)
    assert re.search(r"^ok  torch \d+\.\d+", out, re.M)
    report = json.loads(run_cli(capsys, "doctor", "--path", str(nvme_dir), "--json"))
    assert report["path"]["o_direct"] is True and report["path"]["free_bytes"] > 0
    assert report["path"]["usable"] is True and report["path"]["refused"] is None
    report = json.loads(run_cli(capsys, "doctor", "--path", str(missing), "--json"))
    assert report["path"]["usable"] is False and "does not exist" in report["path"]["refused"]
    assert set(report) >= {"io_uring", "engines_built", "path", "memory", "cpu", "torch"}


def test_doctor_says_why_io_uring_is_not_usable(capsys, monkeypatch, nvme_dir):
    monkeypatch.setenv("INFINITY_AIO_IO_URING_REFUSE", "EPERM")
    out = run_cli(capsys, "doctor", "--path", str(nvme_dir))
    assert (
        "NO  io_uring: not usable: io_uring_setup: Operation not permitted (simulated by INFINITY_AIO_IO_URING_REFUSE)"
        in out
    )
    assert "fix: in Docker, io_uring is blocked by the default seccomp profile" in out


def test_doctor_says_when_o_direct_is_refused(capsys, monkeypatch, nvme_dir):
    monkeypatch.setenv("INFINITY_AIO_O_DIRECT_REFUSE", "1")
    out = run_cli(capsys, "doctor", "--path", str(nvme_dir))
    assert "NO  O_DIRECT: the file system refuses O_DIRECT; I/O there is buffered" in out
