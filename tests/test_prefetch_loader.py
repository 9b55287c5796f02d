"""--num-workers: worker processes prefetch batches; the samples (and so the losses) are bitwise those of
0 workers, with batch-size ramp-up and across a resume."""

import torch
from harness import BASE_FLAGS, run_layout, with_flag

from tricorn.data.base import GlobalBatchLoader, MockSamples
from tricorn.data.prefetch import PrefetchingBatchLoader


def _ramp(consumed: int) -> int:  # 4, 4, 8, 8, ...: the sampler must follow a changing global batch size
    return 4 if consumed < 8 else 8


def _batches(loader, n):
    out = []
    for _ in range(n):
        b = loader.next(_ramp(loader.consumed_samples))
        out.append((b.tokens, b.labels, b.loss_mask, b.sample_ids))
    return out


def _same(a, b):
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p[:3], q[:3])) and p[3] == q[3] for p, q in zip(a, b))


def test_workers_give_the_same_batches_in_the_same_order_and_resume():
    source = MockSamples(500, 32, seed=7)
    for dp_rank in (0, 1):
        plain = _batches(GlobalBatchLoader(source, dp_rank, 2), 6)
        prefetched = PrefetchingBatchLoader(GlobalBatchLoader(source, dp_rank, 2), 2, _ramp)
        assert _same(_batches(prefetched, 3), plain[:3])
        prefetched.load_state_dict({"consumed_samples": 8})  # a resume: back to global batch 3
        assert _same(_batches(prefetched, 4), plain[2:])
        prefetched.close()


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
