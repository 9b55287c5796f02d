"""--num-workers: worker processes prefetch batches; the samples (and so the losses) are bitwise those of
0 workers, with batch-size ramp-up and across a resume."""

from pathlib import Path

import torch
from harness import BASE_FLAGS, run_layout, run_script, with_flag

from tricorn.data.prefetch import PrefetchingBatchLoader


def test_workers_give_the_same_batches_in_the_same_order_and_resume():
    assert run_script(Path(__file__).parent / "workers" / "prefetch_order.py", 1, timeout=120).strip() == "ok"


def test_losses_with_two_workers_are_bitwise_those_of_none_and_resume_bitwise(tmp_path):
    flags = with_flag(BASE_FLAGS, "--train-iters", "4")
    plain = run_layout(flags, 1, tmp_path / "w0")
    ckpt = tmp_path / "ckpt"
    workers = flags + ["--num-workers", "2"]
    two = run_layout(workers + ["--save", str(ckpt), "--save-interval", "2"], 1, tmp_path / "w2")
    assert two.losses == plain.losses and two.grad_norms == plain.grad_norms  # bitwise: same samples, same order
    resumed = run_layout(workers + ["--load", str(ckpt), "--ckpt-step", "2"], 1, tmp_path / "resume")
    assert resumed.losses == plain.losses[2:]


def test_num_workers_builds_the_prefetching_loader():
    from types import SimpleNamespace

    from tricorn.training.main import build_loaders, resolve_config

    cfg = resolve_config(BASE_FLAGS + ["--num-workers", "2"])
    train, _ = build_loaders(cfg, SimpleNamespace(dp_rank=0, dp_size=1, device=torch.device("cpu")))
    assert isinstance(train, PrefetchingBatchLoader) and train.num_workers == 2 and not train.pin_memory
