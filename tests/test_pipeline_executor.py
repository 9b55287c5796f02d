"""The pipeline executor on real chunks: equal to one process, in the simulator's order, with its memory and bytes.

The multi-rank checks live in workers/pp_executor.py (1F1B, GPipe, interleaved and
forward-only on pipelines of 2 and 4 ranks, tied and untied); here are also the
single-process pieces: stage boundary shapes and the chunk split.
"""

from pathlib import Path

import pytest
import torch
from harness import run_script

from tricorn.config_args import config_from_args
from tricorn.parallel.pipeline.build import build_model_chunks
from tricorn.parallel.pipeline.p2p import activation_shape, wire_dtype

WORKERS = Path(__file__).parent / "workers"
BASE = "--device cpu --mock-data --vocab-size 97 --num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16"


def _cfg(extra: str, world_size: int):
    return config_from_args((BASE + " " + extra).split(), world_size=world_size)


@pytest.mark.parametrize("nproc", [2, 4])
def test_executor_equals_one_process_and_follows_the_simulator(nproc):
    assert "ok" in run_script(WORKERS / "pp_executor.py", nproc)


def test_stage_boundary_shape_follows_cp_and_sequence_parallel():
    """[local sequence, micro batch, hidden]: hidden states are sequence-first."""
    pp2 = "--pipeline-model-parallel-size 2 --micro-batch-size 3"
    assert activation_shape(_cfg(pp2, 2)) == (16, 3, 32)
    assert activation_shape(_cfg(pp2 + " --context-parallel-size 2", 4)) == (8, 3, 32)
    assert activation_shape(_cfg(pp2 + " --tensor-model-parallel-size 2", 4)) == (16, 3, 32)
    sp = pp2 + " --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2"
    assert activation_shape(_cfg(sp, 8)) == (4, 3, 32)
    assert wire_dtype(_cfg(pp2, 2)) is torch.float32
    assert wire_dtype(_cfg(pp2 + " --bf16", 2)) is torch.bfloat16


def test_chunks_hold_their_virtual_stages_layers_embedding_and_head():
    cfg = _cfg("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 2)
    rank0 = build_model_chunks(cfg, None, 0, 1, torch.device("cpu"))
    rank1 = build_model_chunks(cfg, None, 1, 1, torch.device("cpu"))
    assert [list(c.layers) for c in rank0] == [["0", "1"], ["4", "5"]]
    assert [list(c.layers) for c in rank1] == [["2", "3"], ["6", "7"]]
    # Embedding only on virtual stage 0, final norm and head only on the last one.
    assert [c.pre_process for c in rank0 + rank1] == [True, False, False, False]
    assert [c.post_process for c in rank0 + rank1] == [False, False, False, True]
    # The tied head copy starts equal to the embedding (initialised from its name).
    # Bitwise: both copies come from the same seeded fill of the same name.
    torch.testing.assert_close(rank1[1].output.weight, rank0[0].tok_embeddings.weight, rtol=0, atol=0)
