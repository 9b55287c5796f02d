"""Checkpoint files in one process: finding the checkpoint, each damage case as one line, safe
unpickling, retention, RNG encoding and the exit conditions (no process group needed)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import BASE_FLAGS, with_flag

from tricorn.checkpoint import io
from tricorn.checkpoint.io import CheckpointError
from tricorn.config import dump_yaml
from tricorn.config_args import config_from_args
from tricorn.training.signals import ExitConditions

CFG = config_from_args(BASE_FLAGS, world_size=1)


def make_checkpoint(root: Path, iteration: int, cfg=CFG, tensors=None) -> Path:
    """A small complete checkpoint as the trainer lays it out (DCP files, meta.json, config.yaml, latest)."""
    path = root / io.iter_name(iteration)
    path.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            tensors or {"model.w": torch.arange(12.0).view(3, 4), "model.b": torch.ones(5)}, checkpoint_id=str(path), no_dist=True
        )
    (path / io.META_FILE).write_text(json.dumps(full_meta(iteration)))
    (path / io.CONFIG_FILE).write_text(dump_yaml(cfg))
    io.atomic_write_text(root / io.LATEST_FILE, f"{iteration}\n")
    return path


def full_meta(iteration: int) -> dict:
    """meta.json as the trainer writes it (every key read_meta checks)."""
    layout = {"tp": 1, "pp": 1, "vpp": 1, "cp": 1, "dp": 1, "world": 1, "distributed_optimizer": False, "zero_stage": 1}
    return {
        "format_version": io.FORMAT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": 4 * iteration,
        "consumed_valid_samples": 0,
        "optimizer_step": float(iteration),
        "optimizer_iteration": iteration,
        "loss_scaler": None,
        "lr": 1e-3,
        "layout": {**layout, "params_dtype": "fp32"},
        "saved_at": 0.0,
    }


def one_line_error(fn, *args) -> str:
    with pytest.raises(CheckpointError) as e:
        fn(*args)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_fresh_start_when_nothing_to_load(tmp_path):
    assert io.find_checkpoint(tmp_path / "absent", None)[0] is None
    assert io.find_checkpoint(tmp_path, None)[0] is None
    (tmp_path / "iter_0000005.tmp-dead").mkdir()  # a save that never completed is never loaded
    assert io.find_checkpoint(tmp_path, None)[0] is None


def test_latest_and_ckpt_step(tmp_path):
    make_checkpoint(tmp_path, 2)
    newest = make_checkpoint(tmp_path, 4)
    assert io.find_checkpoint(tmp_path, None)[0] == newest
    assert io.find_checkpoint(tmp_path, 2)[0] == tmp_path / "iter_0000002"
    assert "--ckpt-step 3" in one_line_error(io.find_checkpoint, tmp_path, 3)
    (tmp_path / io.LATEST_FILE).unlink()  # a crash between the rename and `latest`: the newest complete one
    assert io.find_checkpoint(tmp_path, None)[0] == newest


def test_latest_pointing_to_missing_dir(tmp_path):
    make_checkpoint(tmp_path, 2)
    io.atomic_write_text(tmp_path / io.LATEST_FILE, "7\n")
    message = one_line_error(io.find_checkpoint, tmp_path, None)
    assert str(tmp_path / io.LATEST_FILE) in message and "iter_0000007" in message
    io.atomic_write_text(tmp_path / io.LATEST_FILE, "garbage\n")
    assert str(tmp_path / io.LATEST_FILE) in one_line_error(io.find_checkpoint, tmp_path, None)


def test_missing_and_truncated_shard(tmp_path):
    path = make_checkpoint(tmp_path, 3)
    io.verify_checkpoint(path, CFG.model)
    shard = next(path.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    message = one_line_error(io.verify_checkpoint, path, CFG.model)
    assert str(shard) in message and "truncated" in message
    shard.unlink()
    message = one_line_error(io.verify_checkpoint, path, CFG.model)
    assert str(shard) in message and "missing" in message


def test_garbage_shard_content_is_one_line(tmp_path):
    path = make_checkpoint(tmp_path, 3)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(b"\0" * shard.stat().st_size)  # right size, wrong bytes: found when reading
    io.verify_checkpoint(path, CFG.model)
    message = one_line_error(io.read_tensors, path)
    assert message.startswith(f"checkpoint damaged: reading {path} failed")


def test_model_shape_mismatch_names_config(tmp_path):
    path = make_checkpoint(tmp_path, 3)
    other = config_from_args(with_flag(BASE_FLAGS, "--hidden-size", "128"), world_size=1)
    message = one_line_error(io.verify_checkpoint, path, other.model)
    assert str(path / io.CONFIG_FILE) in message and "hidden_size 64 (checkpoint) vs 128 (this run)" in message
    # Layout and training flags are free to change.
    io.verify_checkpoint(path, config_from_args(with_flag(BASE_FLAGS, "--lr", "3e-4"), world_size=1).model)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_is_unpickled_through_an_allowlist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = make_checkpoint(tmp_path, 3)
    assert "model.w" in io.read_dcp_metadata(path).state_dict_metadata
    (path / io.DCP_METADATA).write_bytes(pickle.dumps(_Exploit()))
    message = one_line_error(io.read_dcp_metadata, path)
    assert str(path / io.DCP_METADATA) in message and ("posix.system" in message or "os.system" in message)
    assert not (tmp_path / "pwned").exists()
    (path / io.DCP_METADATA).write_bytes(b"\x80\x04")  # truncated
    assert str(path / io.DCP_METADATA) in one_line_error(io.read_dcp_metadata, path)


def test_pickled_objects_in_a_checkpoint_are_refused(tmp_path):
    path = make_checkpoint(tmp_path, 3, tensors={"model.w": torch.ones(2), "note": "hello"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert "pickled object" in one_line_error(io.dcp_load, {"note": ""}, path, None, True)
    assert torch.equal(io.read_tensors(path)["model.w"], torch.ones(2))


def test_retention_and_stale_temp_dirs(tmp_path):
    for it in (1, 2, 3, 4):
        make_checkpoint(tmp_path, it)
    (tmp_path / "iter_0000005.tmp-abc").mkdir()
    assert [p.name for p in io.prune(tmp_path, 2, newest=4)] == ["iter_0000001", "iter_0000002"]
    assert [it for it, _ in io.complete_checkpoints(tmp_path)] == [3, 4]
    io.remove_stale_tmp(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([io.LATEST_FILE, "iter_0000003", "iter_0000004"])


def test_rng_states_round_trip(tmp_path):
    states = {"cpu": torch.get_rng_state(), "tracker.tensor-parallel": torch.Generator().manual_seed(3).get_state()}
    (tmp_path / "r.json").write_text(io.encode_rng(states))
    back = io.decode_rng(tmp_path / "r.json")
    assert back.keys() == states.keys() and all(torch.equal(back[k], v) for k, v in states.items())


def test_exit_conditions():
    assert ExitConditions(config_from_args(BASE_FLAGS + ["--exit-interval", "3"], world_size=1)).check(3) == "--exit-interval 3"
    assert ExitConditions(config_from_args(BASE_FLAGS + ["--exit-interval", "3"], world_size=1)).check(4) is None
    late = ExitConditions(config_from_args(BASE_FLAGS + ["--exit-duration-in-mins", "0.0001"], world_size=1))
    time.sleep(0.01)
    assert "--exit-duration-in-mins" in late.check(1)
    flags = BASE_FLAGS + ["--exit-signal-handler", "--exit-signal", "SIGUSR1"]
    exits = ExitConditions(config_from_args(flags, world_size=1))
    try:
        assert exits.check(1) is None
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without the handler
        assert exits.check(2) == "received SIGUSR1"
    finally:
        exits.restore()
