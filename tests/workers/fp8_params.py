"""Worker: FP8 primary weights (--fp8-param-gather) on WORLD_SIZE gloo ranks (DP = WORLD_SIZE), ZeRO-1, 2 and 3, and
ZeRO-1 and 3 with --optimizer-cpu-offload (under the pinned-memory stand-in, the branches CUDA takes).

After two training iterations, for every FP8 weight: the FP8 bytes each rank holds after the gather (ZeRO-1: the
full weight; ZeRO-3: inside gathered_params) equal, byte for byte, the cast one process makes of the whole fp32
master (assembled here from every rank's owned range): quantize(master, scale_for(amax(master))), and the scale
the rank holds is that one. The weight's 16-bit parameter holds no storage, its bucket 1 byte per element.
Every rank asserts; rank 0 prints "ok".
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from dist_opt import make_trainer  # noqa: E402
from harness import BASE_FLAGS  # noqa: E402

from tricorn.parallel.fp8 import quantize, scale_for  # noqa: E402
from tricorn.pinned import stand_in  # noqa: E402

E4M3 = torch.float8_e4m3fn


def full_masters(opt) -> dict[int, torch.Tensor]:
    """id(weight) -> the whole fp32 master, summed from every rank's owned range (zeros elsewhere)."""
    out = {}
    for ps in opt.sharded_param_state():
        if getattr(ps.param, "fp8_primary", False):
            full = torch.zeros(ps.param.numel())
            full[ps.start : ps.stop] = ps.master
            out[id(ps.param)] = full
    weights = [p for p in opt.params if getattr(p, "fp8_primary", False)]
    for p in weights:  # every rank owns part of every weight at DP 2 (buckets are split in halves)
        full = out.setdefault(id(p), torch.zeros(p.numel()))
        dist.all_reduce(full)
    return {id(p): out[id(p)].view(p.shape) for p in weights}


def check(extra: list[str]) -> None:
    flags = BASE_FLAGS + ["--bf16", "--fp8-format", "e4m3", "--fp8-param-gather", "--train-iters", "2"] + extra
    trainer = make_trainer(flags)
    trainer.run_iteration()
    trainer.run_iteration()
    opt = trainer.optimizer
    masters = full_masters(opt)
    assert len(masters) == 8, f"{extra}: {len(masters)} FP8 weights, expected 4 linears x 2 layers"
    with opt.gathered_params():
        for p in opt.params:
            if id(p) not in masters:
                continue
            master = masters[id(p)]
            scale = scale_for(master.abs().amax(), E4M3)
            expected = quantize(master, scale, E4M3)
            where = f"{extra} rank {dist.get_rank()} weight {tuple(p.shape)}"
            assert torch.equal(p.fp8_scale, scale), f"{where}: scale {p.fp8_scale} vs one process's {scale}"
            assert torch.equal(p.fp8_data.view(torch.uint8), expected.view(torch.uint8)), f"{where}: FP8 bytes differ"
            assert p.untyped_storage().nbytes() == 0, f"{where}: the 16-bit parameter holds storage"
    fp8_buckets = [b for dp in opt.data_parallel for b in dp.buckets if b.dtype == torch.uint8]
    assert fp8_buckets and all(b.param_flat.element_size() == 1 for b in fp8_buckets)


if __name__ == "__main__":
    for extra in (["--use-distributed-optimizer"], ["--zero-stage", "2"], ["--zero-stage", "3"]):
        check(extra)
    # --optimizer-cpu-offload with the CPU standing in for CUDA: the masters on the host, cast there with scales
    # copied over once, and each bucket's bytes sent back from its pinned staging buffer (fp8_params.cast_shard).
    with stand_in():
        for extra in (["--use-distributed-optimizer"], ["--zero-stage", "3"]):
            check(extra + ["--optimizer-cpu-offload"])
    if dist.get_rank() == 0:
        print("ok")
