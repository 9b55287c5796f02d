"""The model chunks of one pipeline rank: one ``GPTModel`` per virtual stage it holds.

Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * pp + r`` and holds the global
layers ``layout_from_config(cfg).layers(r, c)``. Only virtual stage 0 embeds the tokens
(``pre_process``) and only the last virtual stage has the final norm, the head and the
loss (``post_process``). Parameters are named by global layer index and initialised from
those names, so every split starts from the same weights as one process. With tied
embeddings and PP > 1 the last stage's head is its own parameter initialised from the
embedding's name; ``grads.reduce_tied_embedding_grads`` keeps the two copies equal.

No collectives; memory: this rank's layers only (nothing with ``hollow``) (plus the embedding / head where held).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tricorn.config import Config
from tricorn.model.init import hollow_parameters
from tricorn.model.spec import LayerSpec
from tricorn.model.transformer import GPTModel
from tricorn.parallel.pipeline.schedules import is_first_stage, is_last_stage
from tricorn.parallel.pipeline.stages import layout_from_config


def build_model_chunks(
    cfg: Config, spec: LayerSpec, pp_rank: int, tp_size: int, device: torch.device, hollow: bool = False
) -> list[nn.Module]:
    """Initialised model chunks of pipeline rank ``pp_rank``, chunk 0 first (one chunk without PP).

    With ``hollow`` the chunks are built on the meta device and come back with hollow parameters (no
    memory; model/init.py): the DP buckets materialise them, only this rank's shard under ZeRO-3.
    """
    layout = layout_from_config(cfg)
    chunks: list[nn.Module] = []
    for c in range(layout.vpp):
        with torch.device("meta") if hollow else contextlib.nullcontext():
            model = GPTModel(
                cfg.model,
                spec,
                layer_ids=layout.layers(pp_rank, c),
                pre_process=is_first_stage(pp_rank, c),
                post_process=is_last_stage(pp_rank, c, layout.pp, layout.vpp, layout.placement),
                padded_vocab_size=cfg.model.padded_vocab_size(tp_size),
            )
        if hollow:
            hollow_parameters(model, device)
        else:
            model.to(device).init_weights(cfg.training.seed)
        chunks.append(model)
    return chunks
