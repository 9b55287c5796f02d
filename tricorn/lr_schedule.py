"""The learning-rate and weight-decay schedule: megatron-core's OptimizerParamScheduler, counted in samples.

Megatron's scheduler counts `num_steps` in samples and steps after every successful optimizer step by that
iteration's global batch size (training.py: `opt_param_scheduler.step(increment=...)` when update_successful),
so iteration i runs at lr(samples of the successful steps before it): lr((i - 1) x global batch) without
skips and ramp-up, and iteration 1 of a warm-up runs at --lr-warmup-init. Megatron logs the lr read after
that step, the next iteration's.

    warm-up   n <= warmup:  init + (max - init) x n / warmup           (warmup > 0)
    constant                max
    n > decay               min
    linear / cosine         min + coeff x (max - min), ratio = (n - warmup) / (decay - warmup)
    inverse-square-root     max(min, max x sqrt(max(warmup, 1)) / sqrt(max(n, 1)))
    WSD                     1 until decay - wsd_decay, then linear/cosine/exponential/minus_sqrt over wsd_decay
    weight decay            start + coeff x (end - start) over wd_incr_steps (constant: end)

`LRSchedule` is that class's arithmetic, op for op in Python floats, so its values are Megatron's bit for bit
(tests/test_lr_schedule.py against megatron-core's own values, tests/fixtures/megatron_lr_schedule.json).
`schedule_from_config` builds it as megatron/training/training.py's get_optimizer_param_scheduler does from
the args (iterations x global batch, or samples with --train-samples), `schedule_from_megatron` from a Megatron
checkpoint's args and saved `opt_param_scheduler` state (import-megatron). The state (`state_dict`) has
Megatron's keys, so a tricorn checkpoint's scheduler is Megatron's; `load_state_dict` checks the flags against
it as Megatron does (--override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler).

Stepping it on the host would need each step's skip flag on the host; training/lr_step.py drives it without
a device read. Pure Python: no torch, no collectives, no memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Optional

from tricorn.config import TrainingConfig

# Megatron's state keys and, for the keys that moved, the names older Megatron versions saved them under (in the
# order its load_state_dict looks for them, before today's).
_LEGACY_KEYS = {
    "max_lr": ("start_lr",),
    "lr_warmup_steps": ("warmup_iter", "warmup_steps"),
    "lr_decay_steps": ("end_iter", "decay_steps"),
    "lr_decay_style": ("decay_style",),
    "num_steps": ("num_iters",),
}
# What each checked value is, for the mismatch message, and the flags it comes from.
_WHAT = {
    "max_lr": ("max lr", "--lr"),
    "min_lr": ("min lr", "--min-lr"),
    "lr_warmup_steps": ("warm-up samples", "--lr-warmup-iters/-samples/-fraction"),
    "lr_decay_steps": ("decay samples", "--lr-decay-iters/-samples, or --train-iters/-samples"),
    "lr_decay_style": ("decay style", "--lr-decay-style"),
    "start_wd": ("start weight decay", "--start-weight-decay / --weight-decay"),
    "end_wd": ("end weight decay", "--end-weight-decay / --weight-decay"),
    "wd_incr_steps": ("weight-decay samples", "--train-iters/-samples"),
    "wd_incr_style": ("weight-decay style", "--weight-decay-incr-style"),
    "init_lr": ("warm-up initial lr", "--lr-warmup-init"),
    "wsd_decay_steps": ("WSD anneal samples", "--lr-wsd-decay-iters/-samples"),
    "lr_wsd_decay_style": ("WSD anneal style", "--lr-wsd-decay-style"),
}


class ScheduleMismatch(ValueError):
    """The flags' schedule differs from a checkpoint's; the message is one line naming every difference."""


def _wsd_coeff(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return (2.0 * math.pow(0.5, ratio)) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown --lr-wsd-decay-style {style!r}")


@dataclass
class LRSchedule:
    """megatron-core's OptimizerParamScheduler. Steps (`num_steps`, warm-up, decay) are samples; the warm-up
    is a float with --lr-warmup-fraction, as Megatron's."""

    init_lr: float
    max_lr: float
    min_lr: float
    lr_warmup_steps: float
    lr_decay_steps: int
    lr_decay_style: str
    start_wd: float
    end_wd: float
    wd_incr_steps: int
    wd_incr_style: str
    wsd_decay_steps: Optional[int] = None
    lr_wsd_decay_style: str = "exponential"
    num_steps: int = 0

    def lr(self, num_steps: Optional[int] = None) -> float:
        """Megatron's get_lr after `num_steps` samples (default: the schedule's own count)."""
        n = self.num_steps if num_steps is None else num_steps
        max_lr, min_lr = self.max_lr, self.min_lr
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps))
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup_steps = max(self.lr_warmup_steps, 1)
            steps = max(n, 1)
            return max(min_lr, max_lr * warmup_steps**0.5 / (steps**0.5))
        decay_ratio = float(n - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.lr_decay_style == "WSD":
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                coeff = _wsd_coeff(self.lr_wsd_decay_style, float(n - anneal_start) / float(self.wsd_decay_steps))
        else:
            raise ValueError(f"unknown --lr-decay-style {self.lr_decay_style!r}")
        return min_lr + coeff * delta_lr

    def weight_decay(self) -> float:
        """Megatron's get_wd: the weight decay of the decayed parameters (the others have none)."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = incr_ratio
        elif self.wd_incr_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        else:
            raise ValueError(f"unknown --weight-decay-incr-style {self.wd_incr_style!r}")
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int) -> None:
        """After a successful optimizer step: `increment` samples (that iteration's global batch size)."""
        self.num_steps += increment

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Megatron's keys (its opt_param_scheduler state) plus the three it takes from the args on resume."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any], override: bool = False, use_checkpoint: bool = False) -> list[str]:
        """Take a checkpoint's scheduler as Megatron's load_state_dict does: its count always; its settings with
        --use-checkpoint-opt-param-scheduler, the flags' with --override-opt-param-scheduler, and with neither the
        two must agree (ScheduleMismatch naming each difference). Older Megatron key names are read too.
        Returns a line per setting where the checkpoint's value replaced the flags' (to print)."""
        saved = _saved_values(state)
        settings = {k: v for k, v in saved.items() if k != "num_steps" and v is not None}  # Megatron's lack three
        theirs = replace(self, **settings)
        changed, mismatched = [], []
        for key, value in settings.items():
            ours = getattr(self, key)
            if value == ours or override:
                continue
            matters = self._matters(key) or theirs._matters(key)
            what, flags = _WHAT[key]
            if use_checkpoint:
                changed += [f"{what} {value} from the checkpoint (the flags say {ours})"] if matters else []
            elif matters:
                mismatched.append(f"{what}: {value} in the checkpoint, {ours} from {flags}")
        if mismatched:
            raise ScheduleMismatch(
                f"the checkpoint's lr schedule differs from the flags' ({'; '.join(mismatched)}); pass "
                "--use-checkpoint-opt-param-scheduler to keep the checkpoint's or --override-opt-param-scheduler "
                "to use the flags'"
            )
        if use_checkpoint:
            for key, value in settings.items():
                setattr(self, key, value)
        self.num_steps = int(saved["num_steps"])
        return changed

    def _matters(self, key: str) -> bool:
        """Whether a setting changes any lr or weight decay of this schedule: Megatron compares them all, tricorn
        not those that cannot matter (a decay length when the lr is constant, the weight-decay length when the
        weight decay is, ...), so that a longer --train-iters alone needs no flag."""
        if key in ("lr_decay_steps", "min_lr"):
            return self.lr_decay_style != "constant"
        if key in ("wsd_decay_steps", "lr_wsd_decay_style"):
            return self.lr_decay_style == "WSD"
        if key in ("wd_incr_steps", "start_wd"):
            return self.wd_incr_style != "constant"
        if key == "init_lr":
            return self.lr_warmup_steps > 0
        return True


def _saved_values(state: dict[str, Any]) -> dict[str, Any]:
    """Every setting a saved scheduler state holds, under today's names (None: not saved)."""
    out: dict[str, Any] = {}
    for f in fields(LRSchedule):
        names = (*_LEGACY_KEYS.get(f.name, ()), f.name)
        out[f.name] = next((state[n] for n in names if n in state), None)
    if out["num_steps"] is None:
        raise ValueError("the scheduler state has no num_steps (or num_iters)")
    return out


# ---------------------------------------------------------------- building one


def schedule_steps(t: TrainingConfig) -> dict[str, Any]:
    """Megatron's get_optimizer_param_scheduler: warm-up, decay, WSD and weight-decay lengths in samples."""
    gbs = int(t.global_batch_size)
    if t.train_samples is None:  # iteration-based: iterations x the (final) global batch size
        decay = (t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters) * gbs
        wd_steps = t.train_iters * gbs
        wsd = t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters is not None else None
        warmup = t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None else t.lr_warmup_iters * gbs
    else:
        decay = t.lr_decay_samples if t.lr_decay_samples is not None else t.train_samples
        wd_steps = t.train_samples
        wsd = t.lr_wsd_decay_samples
        warmup = t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None else t.lr_warmup_samples
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": wd_steps, "wsd_decay_steps": wsd}


def schedule_from_config(t: TrainingConfig) -> LRSchedule:
    """The schedule of a run's flags at num_steps 0, as pretrain_gpt.py's Megatron builds it."""
    constant_wd = t.weight_decay_incr_style == "constant"
    return LRSchedule(
        init_lr=float(t.lr_warmup_init),
        max_lr=float(t.lr),
        min_lr=float(t.min_lr),
        lr_decay_style=t.lr_decay_style,
        start_wd=float(t.weight_decay if constant_wd or t.start_weight_decay is None else t.start_weight_decay),
        end_wd=float(t.weight_decay if constant_wd or t.end_weight_decay is None else t.end_weight_decay),
        wd_incr_style=t.weight_decay_incr_style,
        lr_wsd_decay_style=t.lr_wsd_decay_style,
        **schedule_steps(t),
    )


# The args Megatron's get_optimizer_param_scheduler reads (tricorn's fields of the same names).
SCHEDULE_ARGS = (
    "lr", "min_lr", "lr_warmup_init", "lr_decay_style", "lr_wsd_decay_style", "lr_decay_iters", "lr_decay_samples",
    "lr_wsd_decay_iters", "lr_wsd_decay_samples", "lr_warmup_fraction", "lr_warmup_iters", "lr_warmup_samples",
    "train_iters", "train_samples", "global_batch_size", "weight_decay", "start_weight_decay", "end_weight_decay",
    "weight_decay_incr_style",
)  # fmt: skip


def schedule_from_megatron(args: dict[str, Any], state: Optional[dict[str, Any]]) -> LRSchedule:
    """A Megatron run's schedule from its saved args and its `opt_param_scheduler` state: the state's settings and
    count (Megatron's --use-checkpoint-opt-param-scheduler), and from the args what Megatron takes from them on
    resume (warm-up init, WSD). `state` None (a checkpoint saved with --no-save-optim): rebuilt from the args at
    the consumed samples, which is Megatron's count unless a step was skipped."""
    t = TrainingConfig(**{k: args[k] for k in SCHEDULE_ARGS if args.get(k) is not None})
    schedule = schedule_from_config(t)
    if state is None:
        schedule.num_steps = int(args.get("consumed_train_samples") or 0)
        return schedule
    schedule.load_state_dict(state, use_checkpoint=True)
    return schedule


# ---------------------------------------------------------------- checks before launch


def steps_can_be_skipped(t: TrainingConfig) -> bool:
    """Whether an optimizer step can be skipped (an fp16 overflow, --loss-scale's inf check, a loss spike)."""
    return bool(t.fp16 or t.loss_scale or t.check_for_spiky_loss)


def schedule_errors(t: TrainingConfig) -> list[str]:
    """Megatron's checks of the schedule flags (its asserts in validate_args and the scheduler), one line each."""
    errs: list[str] = []
    samples = t.train_samples is not None
    wrong = (
        ("--lr-decay-iters", t.lr_decay_iters, "--lr-decay-samples"),
        ("--lr-warmup-iters", t.lr_warmup_iters or None, "--lr-warmup-samples"),
        ("--lr-wsd-decay-iters", t.lr_wsd_decay_iters, "--lr-wsd-decay-samples"),
    )
    wrong_samples = (
        ("--lr-decay-samples", t.lr_decay_samples, "--lr-decay-iters"),
        ("--lr-warmup-samples", t.lr_warmup_samples or None, "--lr-warmup-iters"),
        ("--lr-wsd-decay-samples", t.lr_wsd_decay_samples, "--lr-wsd-decay-iters"),
    )
    for flag, value, other in wrong if samples else wrong_samples:
        if value is not None:
            need = "iteration-based training (--train-iters)" if samples else "sample-based training (--train-samples)"
            errs.append(f"{flag} {value} needs {need}; use {other}")
    if t.lr_warmup_fraction is not None and (t.lr_warmup_iters or t.lr_warmup_samples):
        errs.append("--lr-warmup-fraction and --lr-warmup-iters/-samples are exclusive; give one")
    if samples and t.global_batch_size and t.train_samples < t.global_batch_size:
        errs.append(f"--train-samples {t.train_samples} is less than one --global-batch-size {t.global_batch_size}")
    if t.lr_warmup_init > t.lr:
        errs.append(f"--lr-warmup-init {t.lr_warmup_init} is above --lr {t.lr}")
    if t.lr_decay_style == "WSD" and (t.lr_wsd_decay_samples if samples else t.lr_wsd_decay_iters) is None:
        errs.append(f"--lr-decay-style WSD needs {'--lr-wsd-decay-samples' if samples else '--lr-wsd-decay-iters'}")
    if t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler:
        errs.append("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive; give one")
    errs += _weight_decay_errors(t)
    if not errs and t.global_batch_size:
        steps = schedule_steps(t)
        if not steps["lr_warmup_steps"] < steps["lr_decay_steps"]:
            errs.append(
                f"the warm-up ({steps['lr_warmup_steps']} samples) must end before the decay does "
                f"({steps['lr_decay_steps']} samples); shorten the warm-up or lengthen --lr-decay-iters/-samples"
            )
    return errs


def _weight_decay_errors(t: TrainingConfig) -> list[str]:
    if t.weight_decay_incr_style == "constant":
        # Megatron takes both from --weight-decay then; a different value given here would be ignored.
        given = [(f, v) for f, v in (("--start-weight-decay", t.start_weight_decay), ("--end-weight-decay", t.end_weight_decay))]
        return [
            f"{flag} {value} needs --weight-decay-incr-style linear or cosine (a constant weight decay is --weight-decay)"
            for flag, value in given
            if value is not None and value != t.weight_decay
        ]
    errs = []
    if t.start_weight_decay is None or t.end_weight_decay is None:
        errs.append(f"--weight-decay-incr-style {t.weight_decay_incr_style} needs --start-weight-decay and --end-weight-decay")
    elif t.end_weight_decay < t.start_weight_decay:
        errs.append(f"--end-weight-decay {t.end_weight_decay} is below --start-weight-decay {t.start_weight_decay}")
    if steps_can_be_skipped(t):
        errs.append(
            f"--weight-decay-incr-style {t.weight_decay_incr_style} with steps that can be skipped (--fp16, --loss-scale "
            "or --check-for-spiky-loss) is not supported: the weight decay of the step after a skipped one would need "
            "the skip on the host (tricorn decides it on the device); use --bf16, or a constant weight decay"
        )
    return errs
