"""Write tests/fixtures/megatron_lr_schedule.json: megatron-core's own OptimizerParamScheduler over a grid of runs.

Run in the fixture environment (megatron-core 0.19.2 on Python 3.12, Megatron-LM's source at core_v0.19.0;
CPU only, no process group):

    PYTHONPATH=/tmp/Megatron-LM /tmp/mcore/bin/python scripts/make_lr_schedule_fixtures.py \
        --output tests/fixtures/megatron_lr_schedule.json

Each case is a Megatron command line. Its args go through Megatron-LM's own parse_args and validate_args,
the scheduler is built by megatron/training/training.py's get_optimizer_param_scheduler (the very code
pretrain_gpt.py runs: samples vs iterations, warm-up fraction, the weight-decay defaults) on a stand-in
optimizer holding Megatron's two param groups (wd_mult 1 and 0), and the training loop's protocol is
replayed: iteration i runs with the lr and weight decay in the param groups, then, unless the case skips
that iteration's optimizer step (an fp16 overflow: update_successful False), the scheduler steps by the
iteration's global batch size. Stored per iteration: the global batch size, the lr and weight decay the
step used, and the lr Megatron logs (read after the scheduler step). Each case also stores the
scheduler's state_dict after iteration `state_at` (what a checkpoint holds).

Ramp-up: megatron-core 0.19 accepts --rampup-batch-size but ignores it (it warns that the flag is deprecated)
and the classic ramp calculator is gone from it, so a ramp case gives the batch sizes of the classic ramp
(START + floor(consumed x n / SAMPLES) x INCREMENT, capped at the global batch; tricorn's
--rampup-batch-size, docs/pipeline.md) as the increments. What megatron-core decides there is the
scheduler's arithmetic on samples; tests/test_lr_schedule.py checks that tricorn's ramp gives the same
batch sizes.

The JSON floats are Python's repr, so every value round-trips exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MEGATRON_CORE_VERSION = "0.19.2"
MEGATRON_LM_TAG = "core_v0.19.0"  # its megatron.core says 0.19.1; optimizer_param_scheduler.py equals the 0.19.2 wheel's
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 2 --tokenizer-type NullTokenizer --vocab-size 100 --lr 1e-3"
).split()

# name -> (extra Megatron flags, iterations, iterations whose optimizer step is skipped, state_at, ramp-up or None)
CASES: dict[str, tuple[str, int, tuple[int, ...], int, object]] = {
    "linear_default": ("--global-batch-size 8 --train-iters 12", 14, (), 5, None),
    "constant_warmup": ("--global-batch-size 8 --train-iters 20 --lr-decay-style constant --lr-warmup-iters 4", 20, (), 3, None),
    "cosine_warmup_min": (
        "--global-batch-size 8 --train-iters 30 --lr-decay-style cosine --lr-warmup-iters 5 --min-lr 1e-4",
        32,
        (),
        7,
        None,
    ),
    "cosine_decay_short": (
        "--global-batch-size 4 --train-iters 30 --lr-decay-style cosine --lr-warmup-iters 3 --lr-decay-iters 20 --min-lr 3e-5",
        30,
        (),
        22,
        None,
    ),
    "linear_warmup_init": (
        "--global-batch-size 16 --train-iters 25 --lr-warmup-iters 6 --lr-warmup-init 1e-4 --min-lr 2e-5",
        25,
        (),
        4,
        None,
    ),
    "cosine_warmup_fraction": (
        "--global-batch-size 8 --train-iters 40 --lr-decay-style cosine --lr-warmup-fraction 0.13 --min-lr 1e-5",
        40,
        (),
        9,
        None,
    ),
    "inverse_sqrt": (
        "--global-batch-size 8 --train-iters 30 --lr-decay-style inverse-square-root --lr-warmup-iters 5 "
        "--lr-decay-iters 25 --min-lr 2e-4",
        30,
        (),
        11,
        None,
    ),
    "inverse_sqrt_no_warmup": (
        "--global-batch-size 2 --train-iters 20 --lr-decay-style inverse-square-root --min-lr 1e-5",
        20,
        (),
        6,
        None,
    ),
    **{
        f"wsd_{style}": (
            f"--global-batch-size 8 --train-iters 30 --lr-decay-style WSD --lr-wsd-decay-style {style} "
            "--lr-wsd-decay-iters 10 --lr-warmup-iters 4 --min-lr 1e-4",
            30,
            (),
            24,
            None,
        )
        for style in ("exponential", "linear", "cosine", "minus_sqrt")
    },
    "samples_cosine": (
        "--global-batch-size 8 --train-samples 200 --lr-decay-style cosine --lr-warmup-samples 36 "
        "--lr-decay-samples 180 --min-lr 1e-4",
        25,
        (),
        8,
        None,
    ),
    "samples_wsd_fraction": (
        "--global-batch-size 8 --train-samples 240 --lr-decay-style WSD --lr-wsd-decay-style cosine "
        "--lr-wsd-decay-samples 100 --lr-warmup-fraction 0.1",
        30,
        (),
        15,
        None,
    ),
    "wd_linear": (
        "--global-batch-size 8 --train-iters 20 --lr-decay-style cosine --lr-warmup-iters 2 "
        "--weight-decay-incr-style linear --start-weight-decay 0.01 --end-weight-decay 0.1",
        22,
        (),
        10,
        None,
    ),
    "wd_cosine_samples": (
        "--global-batch-size 4 --train-samples 80 --weight-decay-incr-style cosine --start-weight-decay 0.0 "
        "--end-weight-decay 0.05 --lr-warmup-samples 12",
        20,
        (),
        13,
        None,
    ),
    "rampup_iters": (
        "--global-batch-size 16 --train-iters 30 --lr-decay-style cosine --lr-warmup-iters 4 --min-lr 1e-4",
        30,
        (),
        6,
        (4, 4, 96),
    ),
    "rampup_samples": (
        "--global-batch-size 12 --train-samples 300 --lr-decay-style linear --lr-warmup-samples 40",
        30,
        (),
        12,
        (4, 2, 60),
    ),
    "skips_warmup_cosine": (
        "--global-batch-size 8 --train-iters 20 --lr-decay-style cosine --lr-warmup-iters 5 --min-lr 1e-4",
        20,
        (1, 2, 6, 11, 12, 13),
        9,
        None,
    ),
    "skips_rampup_wsd": (
        "--global-batch-size 16 --train-iters 30 --lr-decay-style WSD --lr-wsd-decay-style linear "
        "--lr-wsd-decay-iters 12 --lr-warmup-iters 3",
        30,
        (3, 4, 9, 20, 29),
        10,
        (4, 4, 96),
    ),
}


def classic_ramp(start: int, increment: int, samples: int, global_batch_size: int, consumed: int) -> int:
    """The global batch size of Megatron's classic --rampup-batch-size after `consumed` samples."""
    steps = (global_batch_size - start) // increment
    return min(global_batch_size, start + (consumed * steps // samples) * increment)


class StandInOptimizer:
    """What the scheduler touches: Megatron's param groups (weight-decayed and not)."""

    def __init__(self) -> None:
        self.param_groups = [{"wd_mult": 1.0, "default_config": True}, {"wd_mult": 0.0, "default_config": True}]


def run_case(extra: str, iterations: int, skips: tuple[int, ...], state_at: int, ramp) -> dict:
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import get_optimizer_param_scheduler

    flags = BASE + extra.split() + (["--rampup-batch-size", *map(str, ramp)] if ramp else [])
    sys.argv = ["pretrain_gpt.py", *flags]
    args = parse_args()
    args.rank, args.world_size = 0, 1
    validate_args(args)
    global_vars.set_args(args)
    opt = StandInOptimizer()
    scheduler = get_optimizer_param_scheduler(opt)  # also sets train_iters from --train-samples
    out: dict = {"flags": flags, "iterations": iterations, "skips": list(skips), "state_at": state_at, "ramp": ramp}
    gbs, lr, wd, logged = [], [], [], []
    consumed = 0
    for it in range(1, iterations + 1):
        batch = classic_ramp(*ramp, args.global_batch_size, consumed) if ramp else args.global_batch_size
        gbs.append(batch)
        lr.append(opt.param_groups[0]["lr"])
        wd.append(opt.param_groups[0]["weight_decay"])
        assert opt.param_groups[1]["weight_decay"] == 0.0
        if it not in skips:
            scheduler.step(increment=batch)
        logged.append(opt.param_groups[0]["lr"])
        consumed += batch
        if it == state_at:
            out["state"] = scheduler.state_dict()
    out.update(global_batch_size=gbs, lr=lr, weight_decay=wd, logged_lr=logged, train_iters=args.train_iters)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    import megatron.core

    version = getattr(megatron.core, "__version__", MEGATRON_CORE_VERSION)
    cases = {name: run_case(*spec) for name, spec in CASES.items()}
    lines = [f" {json.dumps(name)}: {json.dumps(case)}" for name, case in cases.items()]  # one case a line
    args.output.write_text(
        f'{{"megatron_lm": "{MEGATRON_LM_TAG}", "megatron_core": {json.dumps(version)}, "cases": {{\n'
        + ",\n".join(lines)
        + "\n}}\n"
    )
    print(f"wrote {len(cases)} cases to {args.output}")


if __name__ == "__main__":
    main()
