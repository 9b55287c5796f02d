"""Weights & Biases (tricorn/training/wandb_sink.py), offline, read back from the files wandb 0.31 itself wrote.

A 2-rank run (DP 2: only rank 0 logs) with --wandb-project and TensorBoard, then a resume from its checkpoint:
the offline run's history equals the TensorBoard scalars (same names, same iterations, same values), the
config is the run's, and the resumed run has the same id. The run file (run-<id>.wandb) is wandb's record log:
a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of records, each a 7-byte header (CRC32-C,
little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of a protobuf `Record` - parsed here
with wandb's own protobuf classes (wandb.proto.wandb_internal_pb2).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from harness import BASE_FLAGS, run_layout, with_flag

from tricorn.config_args import config_from_args
from tricorn.training import wandb_sink

_BLOCK, _HEADER = 32768, 7


def read_records(path: Path) -> list:
    """Every protobuf Record of a wandb run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos + _HEADER : pos + _HEADER + length], pos + _HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(records: list) -> dict[int, dict[str, float]]:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            out[int(row.pop("_step"))] = {k: v for k, v in row.items() if not k.startswith("_")}
    return out


def tensorboard_scalars(tb: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        if tag.endswith(" vs tokens"):  # TensorBoard's second x axis; W&B has consumed-tokens instead
            continue
        for e in acc.Scalars(tag):
            out.setdefault(e.step, {})[tag] = e.value
    return out


def test_offline_run_logs_the_tensorboard_scalars_and_a_resume_continues_it(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    save, wdir = tmp_path / "ckpt", tmp_path / "wandb"
    flags = BASE_FLAGS + ["--wandb-project", "tricorn-test", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(wdir)]
    flags += ["--save", str(save), "--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1", "--timing-log-level", "1"]
    flags += ["--lr-decay-iters", "3"]  # the same schedule in both runs: a resume checks it
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    run_layout(with_flag(flags, "--train-iters", "2") + ["--tensorboard-dir", str(tmp_path / "tb1")], 2, tmp_path / "a", env=env)
    run_layout(
        with_flag(flags, "--train-iters", "3") + ["--tensorboard-dir", str(tmp_path / "tb2"), "--load", str(save)],
        2,
        tmp_path / "b",
        env=env,
    )
    first, resumed = sorted((wdir / "wandb").glob("offline-run-*"))  # one directory per process that logged: rank 0's
    files = [next(d.glob("run-*.wandb")) for d in (first, resumed)]
    runs = [read_records(f) for f in files]
    ids = {r.run.run_id for records in runs for r in records if r.WhichOneof("record_type") == "run"}
    assert len(ids) == 1 and first.name.endswith(ids.pop()), (first, resumed)  # the resume continues the same run
    for records, tb, steps in zip(runs, ("tb1", "tb2"), ([1, 2], [3])):
        logged, expected = history(records), tensorboard_scalars(tmp_path / tb)
        assert sorted(logged) == sorted(expected) == steps, (sorted(logged), sorted(expected))
        for step, values in expected.items():
            got = logged[step]
            assert got.pop("consumed-tokens") == 4 * 64 * step  # 4 samples of 64 tokens per iteration
            assert sorted(got) == sorted(values), (step, sorted(set(got) ^ set(values)))
            for tag, v in values.items():  # TensorBoard stores float32: equal to that precision
                assert math.isclose(got[tag], v, rel_tol=1e-6, abs_tol=1e-30), (step, tag, got[tag], v)
    assert "lm loss validation" in history(runs[0])[2]  # --eval-interval 2: TensorBoard's validation scalars too
    config = {}
    for r in runs[0]:
        if r.WhichOneof("record_type") == "run":
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
    assert config["model"]["num_layers"] == 2 and config["logging"]["wandb_project"] == "tricorn-test"


def test_missing_package_and_missing_login_are_one_line_before_launch(tmp_path: Path, monkeypatch) -> None:
    cfg = config_from_args(BASE_FLAGS + ["--wandb-project", "p"])
    netrc = tmp_path / "netrc"
    env = {"NETRC": str(netrc), "HOME": str(tmp_path)}
    (line,) = wandb_sink.wandb_errors(cfg, env)
    assert line.startswith("--wandb-project: no W&B login on this machine (no WANDB_API_KEY, no api.wandb.ai entry"), line
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789012345678901234567890123456789\n")
    assert wandb_sink.wandb_errors(cfg, env) == []
    assert wandb_sink.wandb_errors(cfg, {"WANDB_MODE": "offline"}) == []
    monkeypatch.setattr(wandb_sink.importlib.util, "find_spec", lambda name: None)  # wandb not installed
    assert wandb_sink.wandb_errors(cfg, {"WANDB_MODE": "offline"}) == [
        "--wandb-project needs the wandb package: pip install 'tricorn[wandb]' (or pip install wandb)"
    ]
    assert wandb_sink.wandb_errors(config_from_args(BASE_FLAGS + ["--wandb-exp-name", "x"])) == [
        "--wandb-exp-name needs --wandb-project"
    ]
