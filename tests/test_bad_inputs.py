"""Every bad input of issue 16 is one `tricorn: error:` line, no traceback, nothing written.

Config and path cases run the real entry point in this process (tests/badinput.py); a few run
the real CLI as subprocesses to prove the same holds outside pytest.
"""

from __future__ import annotations

import io as iolib
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml
from badinput import assert_one_line, assert_refused, assert_torchrun_refused, run_main
from harness import BASE_FLAGS, ENTRY, ROOT, with_flag
from test_checkpoint_io import make_checkpoint

from tricorn import launch_errors
from tricorn.checkpoint import io
from tricorn.data import loader as data_loader
from tricorn.data.errors import DataError
from tricorn.data.indexed import IndexedDataset, write_index
from tricorn.data.loader import token_range
from tricorn.data.preprocess import preprocess

# (extra flags, text the error must contain). The base flags are valid; each case breaks one value.
FLAG_CASES = [
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be at least 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be at least 1, got 0"),
    (["--vocab-size", "-5"], "--vocab-size must be at least 1, got -5"),
    (["--lr=-0.001"], "--lr must be at least 0, got -0.001"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "1e39"], "--lr must be a finite number that fits in float32"),
    (["--init-method-std=-0.02"], "--init-method-std must be greater than 0"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1), got 1.5"),
    (["--adam-beta1", "2"], "--adam-beta1 must be in [0, 1), got 2.0"),
    (["--log-interval", "0"], "--log-interval must be at least 1, got 0"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be at least 1, got 0"),
    (["--hang-timeout-minutes", "0"], "--hang-timeout-minutes must be greater than 0, got 0.0"),
    (["--hang-timeout-minutes=-0.5"], "--hang-timeout-minutes must be greater than 0, got -0.5"),
    (
        ["--hang-timeout-minutes", "11"],
        "--hang-timeout-minutes 11 exceeds --distributed-timeout-minutes 10: the collectives would time out before",
    ),
    (["--weight-decay", "-1"], "--weight-decay must be at least 0, got -1.0"),
    (["--seed", "9" * 30], "--seed must be in [0, 4294967295]"),
    (["--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.001"),
    (["--num-layers", "two"], "argument --num-layers: invalid int value: 'two'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]


@pytest.mark.parametrize("extra,needle", FLAG_CASES, ids=[c[0][0].split("=")[0] + "-" + c[0][-1] for c in FLAG_CASES])
def test_bad_flag_value(tmp_path, extra, needle):
    argv = BASE_FLAGS + extra
    for flag in extra:  # a flag given twice: the later one wins in argparse, keep the base one out
        if flag.startswith("--") and "=" not in flag and flag in BASE_FLAGS and len(extra) == 2:
            argv = with_flag(BASE_FLAGS, flag, extra[1])
    assert_refused(argv, tmp_path, needle=needle)


YAML_CASES = [
    ({"training": {"lr": "fast"}}, "'training.lr' in cfg.yaml (the value of --lr) must be a number, got 'fast'"),
    ({"model": {"hidden_size": "64"}}, "'model.hidden_size' in cfg.yaml (the value of --hidden-size) must be an integer"),
    ({"parallel": {"tensor_model_parallel_size": [2]}}, "must be an integer, got [2]"),
    ({"model": {"normalization": "BatchNorm"}}, "one of RMSNorm, LayerNorm"),
    ({"training": {"bf16": "yes"}}, "must be true or false"),
    ({"training": {"rampup_batch_size": [1, 2]}}, "must be a list of 3 values"),
    ({"training": {"weight_decay": -1.0}}, "--weight-decay must be at least 0, got -1.0"),
    ({"model": {"num_layers": None}}, "needs a value"),
    ({"modle": {}}, "unknown section 'modle'"),
    ([1, 2], "must hold a mapping"),
]


@pytest.mark.parametrize("data,needle", YAML_CASES, ids=[str(i) for i in range(len(YAML_CASES))])
def test_bad_yaml_value(tmp_path, data, needle):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(data))
    assert_refused(["--config", "cfg.yaml"] + BASE_FLAGS, tmp_path, needle=needle)


def _paths(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()


PATH_CASES = [
    (["--save", "afile"], "--save afile is a file but must be a directory"),
    (["--save", "/proc/x"], "--save /proc/x: cannot write in /proc"),
    (["--save", "afile/sub"], "afile is a file, not a directory"),
    (["--tensorboard-dir", "afile"], "--tensorboard-dir afile is a file"),
    (["--log-dir", "afile"], "--log-dir afile is a file"),
    (["--data-cache-path", "afile"], "--data-cache-path afile is a file"),
    (["--metrics-file", "adir"], "--metrics-file adir is a directory but must be a file"),
    (["--load", "afile"], "--load afile is a file; it needs the checkpoint directory"),
]


@pytest.mark.parametrize("extra,needle", PATH_CASES, ids=[" ".join(c[0]) for c in PATH_CASES])
def test_output_paths_checked_before_launch(tmp_path, extra, needle):
    _paths(tmp_path)
    assert_refused(BASE_FLAGS + extra + ["--tensorboard-dir", "tb"] * (extra[0] != "--tensorboard-dir"), tmp_path, needle=needle)
    assert not (tmp_path / "tb").exists(), "nothing is created before the checks pass"


@pytest.mark.parametrize("flag", ["--data-cache-path", "--save", "--tensorboard-dir", "--log-dir", "--load"])
def test_file_for_a_directory_with_real_data(tmp_path, flag):
    """Real data is read before launch (vocabulary check, token-range cache): a file named where a directory
    is needed is refused before that, not as a FileExistsError from inside the data loader."""
    _paths(tmp_path)
    _write_pair(tmp_path / "data", np.arange(4096) % 400, [64] * 64)
    needle = f"{flag} afile is a file" + (
        "; it needs the checkpoint directory" if flag == "--load" else " but must be a directory"
    )
    assert_refused(DATA_FLAGS + ["--data-path", "data", flag, "afile"], tmp_path, needle=needle)


def test_directory_for_a_file_is_refused(tmp_path):
    _paths(tmp_path)
    _write_pair(tmp_path / "data", np.arange(4096) % 400, [64] * 64)
    flags = DATA_FLAGS + ["--data-path", "data", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "adir"]
    assert_refused(flags, tmp_path, needle="--tokenizer-model adir is a directory; name the .model file inside it")


def test_read_only_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        probe = ro / "probe"
        try:  # root ignores permissions: this case only means something for other users
            probe.write_text("")
            probe.unlink()
            pytest.skip("running as root: directory permissions are not enforced")
        except PermissionError:
            pass
        assert_refused(BASE_FLAGS + ["--save", "ro/ckpt"], tmp_path, needle="cannot write in")
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize(
    "extra,needle,rank",
    [
        (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be at least 1", "0"),
        (["--save", "afile"], "--save afile is a file", "0"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'", "0"),
        (["--lr", "fast"], None, "1"),
    ],
)
def test_real_cli_prints_one_line(tmp_path, extra, needle, rank):
    """The real command as rank `rank` of 2 (subprocess): exit 2, one line from rank 0 and none from the others."""
    _paths(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RANK": rank, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    flags = with_flag(BASE_FLAGS, "--global-batch-size", "4") + extra + ["--tensorboard-dir", "tb"]
    run = subprocess.run([sys.executable, str(ENTRY), *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    if needle is None:  # printed once, by rank 0
        assert lines == [], run.stderr
    else:
        assert len(lines) == 1 and lines[0].startswith("tricorn: error: ") and needle in lines[0], run.stderr
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("task", ["0", "1"])
def test_srun_prints_once_and_the_others_wait(tmp_path, monkeypatch, task):
    """Under srun (SLURM_PROCID, no RANK) only task 0 prints; the others wait for --kill-on-bad-exit first."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_PROCID", task)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # sbatch's export: no `scontrol show hostnames` to run
    slept, real_sleep = [], time.sleep

    def sleep(seconds: float) -> None:
        # The head start of launch_errors.fail only: time.sleep is patched for the whole process, and other code
        # sleeps too (subprocess's wait backoff in this thread, threads an earlier test left behind).
        called_from_fail = sys._getframe(1).f_globals.get("__name__") == launch_errors.__name__
        slept.append(seconds) if called_from_fail else real_sleep(seconds)

    monkeypatch.setattr(launch_errors.time, "sleep", sleep)
    code, stderr = run_main(BASE_FLAGS + ["--tensor-model-parallel-size", "0"], tmp_path)
    assert code == 2
    if task == "0":
        assert_one_line(code, stderr, needle="--tensor-model-parallel-size must be at least 1")
        assert slept == []
    else:
        assert stderr == "" and slept == [launch_errors.HEAD_START_S]


def test_error_file_is_what_torchrun_reads(tmp_path, monkeypatch):
    """The error file is in torchelastic's layout: its summary shows the line as the root cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    sandbox = tmp_path / "run"
    sandbox.mkdir()
    line = assert_refused(BASE_FLAGS + ["--lr", "nan"], sandbox, needle="--lr must be a finite number")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    summary = ChildFailedError("pretrain_gpt.py", {0: failure}).format_msg()
    assert f"  traceback : {line}\n" in summary and "exitcode  : 2" in summary, summary


def test_a_bug_reaches_torchruns_summary_as_its_traceback(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from tricorn.training import main as entry

    def bug(cfg):
        raise RuntimeError("boom")

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setattr(entry, "_prepare_vocab", bug)
    with pytest.raises(RuntimeError, match="boom"):
        entry.main(BASE_FLAGS)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "error.json"))
    callstack = failure.message["extraInfo"]["py_callstack"]
    assert callstack.startswith("Traceback (most recent call last):") and callstack.rstrip().endswith("RuntimeError: boom")


# ---------------------------------------------------------------- damaged checkpoints (exit 1, before launch)


def _checkpoint(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", 3)
    (ckpt / io.RNG_DIR).mkdir()
    for tp in range(2):
        io.atomic_write_text(ckpt / io.RNG_DIR / f"pp0-dp0-cp0-tp{tp}.json", io.encode_rng({"cpu": torch.get_rng_state()}))
    return ckpt


def _edit_meta(ckpt, change):
    meta = json.loads((ckpt / io.META_FILE).read_text())
    change(meta)
    (ckpt / io.META_FILE).write_text(json.dumps(meta))


def _write_dcp_metadata(ckpt, relative_path):
    md = io.read_dcp_metadata(ckpt)
    for info in md.storage_data.values():
        info.relative_path = relative_path
    (ckpt / io.DCP_METADATA).write_bytes(pickle.dumps(md))


DAMAGE = {
    "latest-superscript": (lambda c: (c.parent / io.LATEST_FILE).write_text("²\n"), "holds '²', not an iteration number"),
    "latest-5000-digits": (lambda c: (c.parent / io.LATEST_FILE).write_text("9" * 5000), "not an iteration number"),
    "meta-lacks-optimizer-step": (lambda c: _edit_meta(c, lambda m: m.pop("optimizer_step")), "lacks 'optimizer_step'"),
    "meta-iteration-twelve": (lambda c: _edit_meta(c, lambda m: m.update(iteration="twelve")), "iteration = 'twelve'"),
    "meta-negative-samples": (lambda c: _edit_meta(c, lambda m: m.update(consumed_train_samples=-4)), "consumed_train_samples"),
    "meta-negative-skipped": (lambda c: _edit_meta(c, lambda m: m.update(skipped_train_samples=-1)), "skipped_train_samples"),
    "meta-spiky-loss-list": (lambda c: _edit_meta(c, lambda m: m.update(spiky_loss=[1])), "spiky_loss = [1]"),
    "meta-not-json": (
        lambda c: (c / io.META_FILE).write_bytes(b"\xff\xfe{"),
        "meta.json cannot be read (not UTF-8 text); pick another iteration with --ckpt-step",
    ),
    "rng-truncated": (
        lambda c: (c / io.RNG_DIR / "pp0-dp0-cp0-tp1.json").write_text(
            (c / io.RNG_DIR / "pp0-dp0-cp0-tp1.json").read_text()[:99]
        ),
        "pp0-dp0-cp0-tp1.json cannot be read",
    ),
    "rng-wrong-size": (
        lambda c: (c / io.RNG_DIR / "pp0-dp0-cp0-tp0.json").write_text(io.encode_rng({"cpu": torch.zeros(8, dtype=torch.uint8)})),
        "no valid CPU RNG state",
    ),
    "path-traversal": (lambda c: _write_dcp_metadata(c, "../../outside.distcp"), "outside the checkpoint directory"),
    "absolute-path": (lambda c: _write_dcp_metadata(c, "/etc/passwd"), "outside the checkpoint directory"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_one_line_before_launch(tmp_path, case):
    damage, needle = DAMAGE[case]
    ckpt = _checkpoint(tmp_path)
    damage(ckpt)
    line = assert_refused(BASE_FLAGS + ["--load", "ckpt", "--tensorboard-dir", "tb"], tmp_path, expected_code=1, needle=needle)
    assert not (tmp_path / "tb").exists()
    assert "Traceback" not in line


def test_path_traversal_never_reads_outside(tmp_path):
    """A .metadata naming ../outside.distcp is refused even when that file exists and would load."""
    ckpt = _checkpoint(tmp_path)
    shard = next(ckpt.glob("*.distcp"))
    (tmp_path / "outside.distcp").write_bytes(shard.read_bytes())
    _write_dcp_metadata(ckpt, "../outside.distcp")
    with pytest.raises(io.CheckpointError, match="outside the checkpoint directory"):
        io.read_tensors(ckpt)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_malicious_shard_never_advises_weights_only_false(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _checkpoint(tmp_path)
    buf = iolib.BytesIO()
    torch.save({"x": _Exploit()}, buf)
    payload = buf.getvalue()
    md = io.read_dcp_metadata(ckpt)
    name = next(iter(md.storage_data.values())).relative_path
    (ckpt / name).write_bytes(payload)
    for info in md.storage_data.values():
        info.offset, info.length = 0, len(payload)
    (ckpt / io.DCP_METADATA).write_bytes(pickle.dumps(md))
    with pytest.raises(io.CheckpointError) as e:
        io.read_tensors(ckpt)
    message = str(e.value)
    assert "\n" not in message and "weights_only" not in message and "Re-running" not in message, message
    assert "refused" in message and not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- data (exit 2, before launch)

DATA_FLAGS = [f for f in BASE_FLAGS if f != "--mock-data"]


def _write_pair(prefix, tokens, lengths, dtype=np.uint16):
    """A .bin/.idx pair with exactly these tokens and sequence lengths (one document per sequence)."""
    np.asarray(tokens, dtype=dtype).tofile(str(prefix) + ".bin")
    write_index(str(prefix) + ".idx", dtype, lengths, np.arange(len(lengths) + 1))


def _tokens_with_a_bad_id_late(vocab: int = 500) -> np.ndarray:
    tokens = np.arange((1 << 20) + 4096, dtype=np.int64) % (vocab - 1)
    tokens[-10] = 9000  # past the first 2^20 tokens, past the padded vocabulary at TP 1 and 2
    return tokens


@pytest.mark.parametrize("tp", [1, 2])
def test_token_ids_past_the_vocabulary_anywhere_are_refused(tmp_path, monkeypatch, tp):
    tokens = _tokens_with_a_bad_id_late()
    _write_pair(tmp_path / "data", tokens, [4096] * (tokens.size // 4096))
    monkeypatch.setenv("WORLD_SIZE", str(tp))
    flags = DATA_FLAGS + ["--data-path", "data", "--tensor-model-parallel-size", str(tp), "--global-batch-size", "4"]
    # The padded vocabulary is 512 at TP 1 and 2 (500 rounded up to 128 x TP); the vocab-parallel embedding
    # at TP 2 would silently mask the id, so only this check stands between the data and a wrong run. The bound
    # is the real vocabulary, not the padded one: padding rows are never trained nor saved.
    assert_refused(flags, tmp_path, needle="data.bin holds token id 9000 outside the model's vocabulary [0, 500)")


def test_token_range_is_cached_beside_the_index_cache(tmp_path):
    tokens = _tokens_with_a_bad_id_late()
    _write_pair(tmp_path / "data", tokens, [4096] * (tokens.size // 4096))
    ds = IndexedDataset(str(tmp_path / "data"))
    assert token_range(ds, str(tmp_path / "cache")) == (0, 9000)
    cached = list((tmp_path / "cache").glob("*-TokenRange-all-range.npy"))
    assert len(cached) == 1 and np.load(cached[0]).tolist() == [0, 9000]
    np.save(cached[0], np.array([0, 7]))  # the cache is read, not recomputed
    assert token_range(ds, str(tmp_path / "cache")) == (0, 7)


def test_checks_before_launch_write_no_cache(tmp_path, monkeypatch):
    """The token range scanned before launch is cached only once the run starts, and scanned only once."""
    _write_pair(tmp_path / "data", np.arange(4096) % 400, [64] * 64)
    (tmp_path / "cache").mkdir()
    flags = DATA_FLAGS + ["--data-path", "data", "--data-cache-path", "cache", "--train-iters", "1"]
    assert_refused(
        flags + ["--tensor-model-parallel-size", "3"], tmp_path, needle="not divisible by --tensor-model-parallel-size 3"
    )
    assert not list((tmp_path / "cache").iterdir())
    monkeypatch.setattr(data_loader, "_unsaved_token_ranges", {})  # a fresh process: the refused run's scan is gone
    scans = []
    real_scan = IndexedDataset.token_range
    monkeypatch.setattr(IndexedDataset, "token_range", lambda self: scans.append(1) or real_scan(self))
    code, stderr = run_main(flags, tmp_path)
    assert code == 0, stderr[-2000:]
    cached = list((tmp_path / "cache").glob("*-TokenRange-all-range.npy"))
    assert len(cached) == 1 and np.load(cached[0]).tolist() == [0, 399] and scans == [1]


@pytest.mark.parametrize(
    "lengths,needle",
    [
        ([64, 64, -64, 192], "sequence 2 has length -64"),
        ([64, 64, 64, 64], None),
    ],
)
def test_negative_length_in_the_middle_is_refused(tmp_path, lengths, needle):
    tokens = np.arange(256) % 400
    _write_pair(tmp_path / "data", tokens, lengths)
    if needle is None:
        assert len(IndexedDataset(str(tmp_path / "data"))) == 4
        return
    assert_refused(DATA_FLAGS + ["--data-path", "data"], tmp_path, needle=needle)


def test_pointers_and_document_indices_are_checked(tmp_path):
    prefix = str(tmp_path / "data")
    _write_pair(prefix, np.arange(256) % 400, [64] * 4)
    raw = bytearray(open(prefix + ".idx", "rb").read())
    header = 9 + 8 + 1 + 8 + 8
    pointer2 = header + 4 * 4 + 2 * 8
    raw[pointer2 : pointer2 + 8] = np.int64(130).tobytes()
    open(prefix + ".idx", "wb").write(bytes(raw))
    with pytest.raises(DataError, match="sequence 2 starts at byte 130 but the lengths before it put it at 256"):
        IndexedDataset(prefix)
    write_index(prefix + ".idx", np.uint16, [64] * 4, [0, 3, 2, 4])
    with pytest.raises(DataError, match=r"document index 2 \(2\) is below the one before it \(3\)"):
        IndexedDataset(prefix)


def test_float_tokens_are_refused(tmp_path):
    _write_pair(tmp_path / "data", np.arange(256) + 0.5, [64] * 4, dtype=np.float32)
    assert_refused(DATA_FLAGS + ["--data-path", "data"], tmp_path, needle="holds float32 tokens")


def test_preprocess_says_why_no_document_was_usable(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2 600"}\n{"text": "3 700"}\n')
    with pytest.raises(DataError) as e:
        preprocess([str(src)], str(tmp_path / "out"), "NullTokenizer", vocab_size=500)
    assert "every line was skipped (2 cannot tokenize" in str(e.value)
    assert "token id 600 is outside the vocabulary [0, 500)" in str(e.value)
    assert not list(tmp_path.glob("out*"))


# ---------------------------------------------------------------- under a 2-rank torchrun (issue 33)


def _torchrun_data(run):
    tokens = _tokens_with_a_bad_id_late()
    _write_pair(run / "data", tokens, [4096] * (tokens.size // 4096))


def _torchrun_checkpoint(damage):
    def setup(run):
        ckpt = _checkpoint(run)
        damage(ckpt)

    return setup


TP2 = ["--tensor-model-parallel-size", "2"]
# name: (setup of the sandbox, flags replacing or added to the base flags, exit code, text of the line)
TORCHRUN_CASES = {
    "pp2-3-layers": (None, ["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers 3 is not divisible"),
    "batch-at-dp2": (None, ["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by --micro-batch-size x DP"),
    "timeout-0": (None, ["--distributed-timeout-minutes", "0"], 2, "--distributed-timeout-minutes must be at least 1, got 0"),
    "token-ids-tp2": (_torchrun_data, TP2 + ["--data-path", "data"], 2, "data.bin holds token id 9000 outside"),
    "rng-garbage-tp2": (
        _torchrun_checkpoint(lambda c: (c / io.RNG_DIR / "pp0-dp0-cp0-tp1.json").write_bytes(os.urandom(64))),
        TP2 + ["--load", "ckpt"],
        1,
        "pp0-dp0-cp0-tp1.json cannot be read",
    ),
    "rng-wrong-length-tp2": (
        _torchrun_checkpoint(DAMAGE["rng-wrong-size"][0]),
        TP2 + ["--load", "ckpt"],
        1,
        "no valid CPU RNG state",
    ),
}


@pytest.mark.parametrize("case", list(TORCHRUN_CASES))
def test_torchrun_ends_with_the_one_line(tmp_path, case):
    """What a user of `torchrun --nproc-per-node 2 pretrain_gpt.py ...` reads last: the line, then torchrun's
    summary naming it (with the worker's exit code) as the root cause."""
    setup, extra, code, needle = TORCHRUN_CASES[case]
    run = tmp_path / "run"
    run.mkdir()
    if setup is not None:
        setup(run)
    flags = DATA_FLAGS if "--data-path" in extra else BASE_FLAGS
    for name, value in zip(extra[::2], extra[1::2]):
        flags = with_flag(flags, name, value)
    flags = with_flag(flags, "--train-iters", "1")
    assert_torchrun_refused(flags, run, tmp_path / "tmp", code, needle)
