"""The lr schedule is megatron-core's OptimizerParamScheduler (issue 38, item 2), checked against its own values.

tests/fixtures/megatron_lr_schedule.json was written by scripts/make_lr_schedule_fixtures.py with Megatron-LM's
parse_args / validate_args / get_optimizer_param_scheduler and megatron-core's class, over a grid of Megatron
command lines (every decay style and WSD anneal, warm-up by iterations, samples and fraction, --lr-warmup-init,
sample-based training, batch ramp-up, weight-decay schedules, skipped steps). The same command line goes through
tricorn's parser; every lr and weight decay is compared with == (the same float operations in the same order
give the same bits: no tolerance), so is the state a checkpoint stores.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import BASE_FLAGS, run_layout, with_flag

from tricorn.config_args import config_from_args
from tricorn.lr_schedule import LRSchedule, ScheduleMismatch, schedule_from_config, schedule_from_megatron
from tricorn.parallel.batch_schedule import MicrobatchCalculator
from tricorn.training.lr_step import ScheduleDriver
from tricorn.validation import validate

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "megatron_lr_schedule.json").read_text())
CASES = FIXTURE["cases"]


def tricorn_config(case: dict):
    cfg = config_from_args([*case["flags"], "--device", "cpu", "--mock-data"], world_size=1)
    assert validate(cfg) == []
    return cfg


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_lr_and_weight_decay_is_megatrons(name):
    case = CASES[name]
    cfg = tricorn_config(case)
    assert cfg.training.train_iters == case["train_iters"]
    schedule = schedule_from_config(cfg.training)
    batches = MicrobatchCalculator.from_config(cfg)
    consumed = 0
    for i, gbs in enumerate(case["global_batch_size"]):
        it = i + 1
        assert batches.get(consumed)[0] == gbs, f"iteration {it}: tricorn's ramp-up gives another global batch"
        assert schedule.lr() == case["lr"][i], f"iteration {it}"
        assert schedule.weight_decay() == case["weight_decay"][i], f"iteration {it}"
        if it not in case["skips"]:
            schedule.step(gbs)
        assert schedule.lr() == case["logged_lr"][i], f"iteration {it}: the lr Megatron logs"
        consumed += gbs
        if it == case["state_at"]:
            ours = schedule.state_dict()
            assert {k: ours[k] for k in case["state"]} == case["state"]


@pytest.mark.parametrize("name", ["skips_warmup_cosine", "skips_rampup_wsd"])
@pytest.mark.parametrize("log_interval", [1, 4, 100])
def test_skipped_steps_on_the_device_give_megatrons_lr(name, log_interval):
    """A run whose steps can be skipped: the lr is picked on the device (no read) and is Megatron's float; the host
    learns the skips at each log line only."""
    case = CASES[name]
    driver = ScheduleDriver(schedule_from_config(tricorn_config(case).training), torch.device("cpu"), skippable=True)
    for i, gbs in enumerate(case["global_batch_size"]):
        it = i + 1
        lr, wd = driver.for_step()
        assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64 and lr.item() == case["lr"][i], f"iteration {it}"
        assert wd == case["weight_decay"][i]
        driver.after_step(gbs, torch.tensor(it in case["skips"]))
        if it % log_interval == 0:  # the log line's one read
            driver.settle(driver.pending().item())
            assert driver.current_lr() == case["logged_lr"][i]
    assert driver.current_lr() == case["logged_lr"][-1]


def test_a_tensor_lr_steps_fused_adamw_bit_for_bit_as_the_float():
    """The skippable path hands fused AdamW a 0-dim tensor; on the CPU its step equals the float lr's bit for bit."""
    out = []
    for lr in (3.0000000000000003e-4, torch.tensor(3.0000000000000003e-4, dtype=torch.float64)):
        torch.manual_seed(0)
        p, grad, m, v = torch.randn(257), torch.randn(257), torch.rand(257), torch.rand(257)
        # torch.optim.AdamW(fused=True).step()'s kernel, called directly (its constructor imports dynamo: 5 s)
        torch._fused_adamw_([p], [grad], [m], [v], [], [torch.tensor(3.0)], lr=lr, beta1=0.9, beta2=0.999,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip
        out.append(p)
    assert torch.equal(*out)


def test_resume_takes_the_checkpoints_count_and_checks_its_settings():
    case = CASES["cosine_warmup_min"]
    flags = tricorn_config(case).training
    saved = LRSchedule(**schedule_from_config(flags).state_dict())
    saved.step(56)
    state = json.loads(json.dumps(saved.state_dict()))  # as meta.json holds it
    fresh = schedule_from_config(flags)
    assert fresh.load_state_dict(state) == [] and fresh.num_steps == 56 and fresh.lr() == saved.lr()
    flags.lr, flags.lr_decay_iters = 2e-3, 40
    with pytest.raises(ScheduleMismatch, match=r"max lr: 0.001 in the checkpoint, 0.002 from --lr.*decay samples: 240"):
        schedule_from_config(flags).load_state_dict(state)
    theirs = schedule_from_config(flags)
    assert len(theirs.load_state_dict(state, use_checkpoint=True)) == 2 and theirs.max_lr == 1e-3
    ours = schedule_from_config(flags)
    assert ours.load_state_dict(state, override=True) == [] and ours.max_lr == 2e-3 and ours.num_steps == 56
    # A longer run alone changes only what cannot matter here (the weight-decay length of a constant weight decay).
    flags.lr, flags.lr_decay_iters, flags.train_iters = 1e-3, None, 90
    longer = schedule_from_config(flags)
    longer.lr_decay_steps = saved.lr_decay_steps
    assert longer.load_state_dict(state) == []


def test_megatrons_older_key_names_are_read():
    old = {"start_lr": 1e-3, "warmup_iter": 16, "end_iter": 160, "decay_style": "cosine", "num_iters": 40, "min_lr": 1e-4}
    ours = LRSchedule(0.0, 1e-3, 1e-4, 16, 160, "cosine", 0.01, 0.01, 160, "constant")
    ours.load_state_dict(old)
    assert ours.num_steps == 40


def test_import_builds_the_schedule_from_megatrons_state():
    args = {"lr": 1e-3, "min_lr": 1e-4, "lr_decay_style": "cosine", "lr_warmup_iters": 2, "train_iters": 10}
    args.update(global_batch_size=2, weight_decay=0.1, lr_warmup_init=0.0, consumed_train_samples=2)
    state = {"max_lr": 1e-3, "lr_warmup_steps": 4, "num_steps": 2, "lr_decay_style": "cosine", "lr_decay_steps": 20}
    state.update(min_lr=1e-4, start_wd=0.1, end_wd=0.1, wd_incr_style="constant", wd_incr_steps=20)
    schedule = schedule_from_megatron(args, state)
    assert schedule.num_steps == 2 and schedule.lr() == 5e-4  # halfway through the 4-sample warm-up
    assert schedule_from_megatron(args, None).num_steps == 2  # --no-save-optim: rebuilt at the consumed samples


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--train-samples", "64", "--lr-warmup-iters", "2"], "--lr-warmup-iters 2 needs iteration-based training"),
        (["--lr-decay-samples", "64"], "--lr-decay-samples 64 needs sample-based training (--train-samples)"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], "are exclusive"),
        (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        (["--lr-warmup-iters", "10"], "the warm-up (40 samples) must end before the decay does (40 samples)"),
        (["--weight-decay-incr-style", "linear"], "needs --start-weight-decay and --end-weight-decay"),
        (["--start-weight-decay", "0.1"], "--start-weight-decay 0.1 needs --weight-decay-incr-style linear or cosine"),
        (
            ["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0", "--end-weight-decay", "0.1", "--fp16"],
            "with steps that can be skipped",
        ),
        (["--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"], "are exclusive"),
        (["--lr-warmup-init", "0.1"], "--lr-warmup-init 0.1 is above --lr 0.001"),
    ],
)
def test_schedule_flags_megatron_refuses_get_one_line(flags, needle):
    base = "--device cpu --mock-data --vocab-size 64 --global-batch-size 4 --lr 1e-3".split()
    length = [] if "--train-samples" in flags else ["--train-iters", "10"]
    errors = validate(config_from_args(base + length + flags, world_size=1))
    assert any(needle in e for e in errors), errors


def test_train_samples_and_train_iters_are_exclusive():
    from tricorn.config import ConfigError

    with pytest.raises(ConfigError, match="--train-samples and --train-iters are exclusive"):
        config_from_args("--device cpu --train-samples 64 --train-iters 3".split(), world_size=1)


# ---------------------------------------------------------------- in training: the log, checkpoints, resumes

GBS = 4  # BASE_FLAGS' global batch
SCHEDULE = ["--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--lr-decay-iters", "5"]


def _expected(first_count: int, iterations: range, flags: list[str] = SCHEDULE, skips=()) -> list[float]:
    """The lr Megatron logs after each of `iterations` (its scheduler stepped after each successful step)."""
    schedule = schedule_from_config(config_from_args([*BASE_FLAGS, *flags], world_size=1).training)
    schedule.num_steps = first_count
    out = []
    for it in iterations:
        if it not in skips:
            schedule.step(GBS)
        out.append(schedule.lr())
    return out


def _lrs(run) -> list[float]:
    return [r["lr"] for r in run.records if "lr" in r]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Iterations 1-4 of a warm-up then cosine run, saved at 2 and 4."""
    tmp = tmp_path_factory.mktemp("schedule")
    flags = with_flag(BASE_FLAGS, "--train-iters", "4") + SCHEDULE + ["--save", str(tmp / "ckpt"), "--save-interval", "2"]
    return tmp, run_layout(flags, 1, tmp / "run")


def test_training_logs_megatrons_lr_and_a_resume_continues_it_bitwise(saved, tmp_path):
    tmp, run = saved
    assert _lrs(run) == _expected(0, range(1, 5))  # after iteration 1 of the warm-up: lr(4 samples) = lr / 2
    resumed = run_layout(
        with_flag(BASE_FLAGS, "--train-iters", "4") + SCHEDULE + ["--load", str(tmp / "ckpt"), "--ckpt-step", "2"], 1, tmp_path
    )
    assert _lrs(resumed) == _lrs(run)[2:] and resumed.losses == run.losses[2:]  # bitwise: the same ops in order


def _old_checkpoint(saved, tmp_path: Path) -> Path:
    """Iteration 2 of `saved` as tricorn wrote it before its schedule was Megatron's: no scheduler state."""
    from tricorn.checkpoint.checksums import file_checksum
    from tricorn.checkpoint.io import CHECKSUM_FILE, LATEST_FILE, META_FILE, SCHEDULER_STATE, iter_name

    tmp, _ = saved
    old = tmp_path / "old"
    shutil.copytree(tmp / "ckpt" / iter_name(2), old / iter_name(2))
    (old / LATEST_FILE).write_text("2")
    meta_file = old / iter_name(2) / META_FILE
    meta = json.loads(meta_file.read_text())
    del meta[SCHEDULER_STATE]
    meta_file.write_text(json.dumps(meta))
    sums_file = old / iter_name(2) / CHECKSUM_FILE
    sums = json.loads(sums_file.read_text())
    sums["files"][META_FILE] = file_checksum(meta_file)
    sums_file.write_text(json.dumps(sums))
    return old


def test_a_checkpoint_from_before_keeps_its_schedule_and_says_so(saved, tmp_path):
    """Its iteration i ran at the lr of i global batches: it resumes at 3 x GBS samples, so iteration 3 runs at
    the old schedule's lr(3) (no jump), with one line saying so."""
    old = _old_checkpoint(saved, tmp_path)
    run = run_layout(with_flag(BASE_FLAGS, "--train-iters", "4") + SCHEDULE + ["--load", str(old)], 1, tmp_path / "run")
    assert "saved before tricorn's lr schedule was Megatron's" in run.stdout
    assert _lrs(run) == _expected(3 * GBS, range(3, 5))


def test_no_load_optim_starts_the_schedule_again_as_megatrons_does(saved, tmp_path):
    tmp, _ = saved
    flags = with_flag(BASE_FLAGS, "--train-iters", "4") + SCHEDULE + ["--load", str(tmp / "ckpt"), "--ckpt-step", "2"]
    run = run_layout([*flags, "--no-load-optim"], 1, tmp_path)
    assert "the lr schedule starts again at sample 0" in run.stdout
    assert _lrs(run) == _expected(0, range(3, 5))  # iteration 3 ran at --lr-warmup-init, as a first iteration


def test_flags_that_change_the_saved_schedule_are_one_line_unless_told_which_wins(saved, tmp_path):
    tmp, run = saved
    flags = with_flag(with_flag(BASE_FLAGS, "--train-iters", "4"), "--lr", "2e-3") + SCHEDULE
    flags += ["--load", str(tmp / "ckpt"), "--ckpt-step", "2"]
    refused = run_layout(flags, 1, tmp_path / "refused", check=False)
    errors = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 1 and len(errors) == 1 and "max lr: 0.001 in the checkpoint, 0.002 from --lr" in errors[0]
    theirs = run_layout([*flags, "--use-checkpoint-opt-param-scheduler"], 1, tmp_path / "theirs")
    assert _lrs(theirs) == _lrs(run)[2:] and "max lr 0.001 from the checkpoint" in theirs.stdout
    ours = run_layout([*flags, "--override-opt_param-scheduler"], 1, tmp_path / "ours")
    assert _lrs(ours) == _expected(2 * GBS, range(3, 5), [*SCHEDULE, "--lr", "2e-3"])  # the flags', from the count


def test_fp16_skips_leave_the_schedule_where_it_was(tmp_path):
    """An overflow at iteration 2 (the scaler's skip, decided on the device): the lr is picked on the device and
    the scheduler does not step, as Megatron's does not after an unsuccessful step; the log line reads it."""
    flags = with_flag(BASE_FLAGS, "--train-iters", "4") + [*SCHEDULE, "--fp16", "--log-interval", "2"]
    run = run_layout(flags, 1, tmp_path, env={"TRICORN_TEST_INJECT_INF_AT_ITER": "2"})
    assert [r["skipped"] for r in run.records] == [True, False] and _lrs(run) == _expected(0, (1, 2, 3, 4), skips=(2,))[1::2]


def test_the_checkpoints_settings_are_taken_whole_and_a_style_change_is_compared_on_both_schedules():
    """A constant lr's decay length does not matter, a cosine's does: a checkpoint saved cosine, resumed with
    --lr-decay-style constant, differs in the style and in the decay that the checkpoint's schedule used."""
    saved = LRSchedule(0.0, 1e-3, 1e-4, 16, 160, "cosine", 0.01, 0.01, 160, "constant", num_steps=40)
    flags = LRSchedule(0.0, 1e-3, 2e-4, 16, 320, "constant", 0.01, 0.01, 320, "constant")
    with pytest.raises(ScheduleMismatch, match="min lr: 0.0001 in the checkpoint.*decay samples: 160.*decay style: cosine"):
        replace(flags).load_state_dict(saved.state_dict())
    theirs = replace(flags)
    theirs.load_state_dict(saved.state_dict(), use_checkpoint=True)
    assert theirs == saved
