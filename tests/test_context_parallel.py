"""Context parallelism: load-balanced sequence chunks, all-gathered k/v, equal to one process."""

import json
from pathlib import Path

import pytest
import torch
from harness import BASE_FLAGS, assert_equivalent, run_script

from tricorn.parallel.context import COMM_TYPES, local_positions

GQA = ["--num-query-groups", "2", "--group-query-attention"]
WORKERS = Path(__file__).parent / "workers"


def test_chunks_cover_the_sequence_once_and_balance_causal_work():
    cp, s = 4, 64
    kept = [local_positions(s, r, cp) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(kept)).values, torch.arange(s))
    # Causal work of a rank = sum over its queries of (position + 1): equal for all ranks.
    work = {int((k + 1).sum()) for k in kept}
    assert len(work) == 1


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_comm_type_matches_torch_in_float64_without_a_squared_tensor(nproc):
    """p2p, a2a and allgather, MHA and GQA, forward and backward, within 1e-12 in float64; the largest storage any
    operator returns during each stays below s_local x s (the worker's control, the old masked call, reaches it)."""
    result = json.loads(run_script(WORKERS / "cp_attention.py", nproc).strip().splitlines()[-1])
    assert result["ok"] and set(result["largest"]) == {f"{c}/{g}" for c in COMM_TYPES for g in (4, 2)}
    assert max(result["largest"].values()) < result["squared"], result


def test_cp2_equals_single_process(tmp_path):
    assert_equivalent(BASE_FLAGS + GQA, 2, tmp_path, ["--context-parallel-size", "2"])


def test_cp2_tp2_sp_equals_single_process(tmp_path):
    assert_equivalent(
        BASE_FLAGS + GQA,
        4,
        tmp_path,
        ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    )
