"""Worker: an imported Megatron checkpoint, loaded with --load at the launch's TP, gives Megatron's logits.

Args: CKPT_DIR REFERENCE_NPZ OUT_JSON, then the model flags. Every rank builds its shard of the model with
the trainer's own build and Checkpointer.load (any saved layout), runs one forward on the reference's
token ids, and the real columns of the TP ranks' vocabulary shards are gathered; rank 0 writes the largest difference from
Megatron's logits (over Megatron's padded vocabulary) and the largest logit to OUT_JSON.
"""

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from tricorn.checkpoint.checkpointer import Checkpointer
from tricorn.parallel.state import destroy_parallel, init_parallel
from tricorn.training.logging import MetricsLogger
from tricorn.training.main import build_trainer, resolve_config

ckpt, ref_path, out_path, *flags = sys.argv[1:]
ref = np.load(ref_path)
tokens = torch.from_numpy(ref["tokens"])
cfg = resolve_config([*flags, "--device", "cpu", "--mock-data", "--load", ckpt, "--no-load-optim", "--no-load-rng"])
state = init_parallel(cfg)
trainer = build_trainer(cfg, state, MetricsLogger(cfg, state.rank, state.device), with_validation=False)
Checkpointer(cfg, state, lambda _: None).load(trainer)
model = trainer.chunks[0].eval()
with torch.no_grad():
    local = model(tokens)  # [b, s, padded vocab / TP]
# Each TP rank holds ceil(V / TP) rows of the vocabulary, real ones first, then its share of the padding.
chunk = -(-cfg.model.vocab_size // state.tp_size)
parts = [torch.empty_like(local) for _ in range(state.tp_size)]
dist.all_gather(parts, local.contiguous(), group=state.tp_group)
logits = torch.cat([p[..., :chunk] for p in parts], dim=-1)[..., : cfg.model.vocab_size]
theirs = torch.from_numpy(ref["logits"])
if state.rank == 0:
    err = (logits[..., : theirs.shape[-1]] - theirs).abs().max().item()
    with open(out_path, "w") as fh:
        json.dump({"err": err, "scale": theirs.abs().max().item(), "tp": state.tp_size}, fh)
trainer.optimizer.close()
destroy_parallel(clean_exit=True)
