"""Bad inputs that need real processes: a damaged shard found by its checksum, and a stopped peer.

Split from test_bad_inputs.py (in-process, fast) because each case here starts training ranks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from harness import BASE_FLAGS, ROOT, free_port, run_layout, with_flag
from test_checkpoint_io import make_checkpoint

from tricorn.checkpoint import io

# ---------------------------------------------------------------- checksums (a real save and load)


def _tensor_data_offset(ckpt) -> tuple:
    """(shard file, an offset in the middle of its largest tensor's bytes)."""
    info = max(io.read_dcp_metadata(ckpt).storage_data.values(), key=lambda i: i.length)
    return ckpt / info.relative_path, info.offset + info.length // 2


def test_checksum_mismatch_is_one_line_and_no_verify_skips_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_layout(with_flag(BASE_FLAGS, "--train-iters", "2") + ["--save", str(ckpt)], 1, tmp_path / "save")
    saved = ckpt / io.iter_name(2)
    manifest = io.read_manifest(saved)
    on_disk = {str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file()} - {io.CHECKSUM_FILE}
    assert set(manifest) == on_disk, "every file of the checkpoint has a checksum"
    assert io.checksum_errors(saved, manifest, sorted(manifest)) == [], "the hash taken while writing is the file's"
    shard, offset = _tensor_data_offset(saved)
    with open(shard, "r+b") as fh:  # 64 bytes of zeros: valid floats, so only the checksum can tell
        fh.seek(offset)
        fh.write(bytes(64))
    flags = with_flag(BASE_FLAGS, "--train-iters", "3") + ["--lr-decay-iters", "2", "--load", str(ckpt)]  # the saved schedule
    run = run_layout(flags, 1, tmp_path / "load", check=False)
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 1 and len(errors) == 1, run.stderr[-2000:]
    assert errors[0].startswith(f"tricorn: error: checkpoint damaged: {shard} does not match its checksum"), errors[0]
    run = run_layout(flags + ["--no-verify-checkpoint"], 1, tmp_path / "skip")
    assert [r["iteration"] for r in run.records if "loss" in r] == [3]


def test_checkpoint_without_checksums_still_loads(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", 3)
    assert io.read_manifest(ckpt) is None
    (ckpt / io.CHECKSUM_FILE).write_text('{"algorithm": "xxh3_64", "files": {"../x": {"size": 1, "digest": "0"}}}')
    with pytest.raises(io.CheckpointError, match="is not a valid checksum list"):
        io.read_manifest(ckpt)


# ---------------------------------------------------------------- a dead or stopped peer


def test_stopped_peer_is_one_line_naming_rank_collective_and_timeout():
    """Rank 1 is SIGSTOPped; rank 0's all_reduce times out (3 s) and gloo's error becomes one line."""
    worker = ROOT / "tests" / "workers" / "dead_peer.py"
    env = {"PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, str(worker)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert out.strip() == (
        "rank 0: rank 1 did not answer in all_reduce within --distributed-timeout-minutes 0.05; "
        "it died or is stopped (see its log), resume from the last checkpoint with --load"
    ), out
