"""Context parallelism: load-balanced chunks; ring (p2p), all-to-all and all-gather attention, equal to one process.

Layer level (tests/workers/cp_attention.py): every comm type, MHA and GQA, CP2 and CP4, forward and backward, with
and without attention dropout, in float64 against one device's causal SDPA; no operator returns a storage of
s_local x s elements. Trainer level (tests/harness.py): each comm type in a few layouts chosen so that every comm
type meets MHA or GQA, and CP4, TP2+SP and recompute are each met by one; the saved-tensor probe equals the
activation estimate of each comm type to the byte. The comm type changes only the attention core, so DP and PP
do not meet it: the default p2p runs CP2 x DP2 with the distributed optimizer (test_equivalence_gaps.py), CP2 x
PP2 (test_pipeline_parallel.py), TP2+SP with dropout (test_dropout.py), checkpoints and --torch-compile. (The
suite's time budget leaves one launch per row here.)
"""

import json
from pathlib import Path

import pytest
import torch
from badinput import assert_refused
from harness import BASE_FLAGS, assert_equivalent, run_script, with_flag

from tricorn.attention_kernels import EFFICIENT, FLASH, AttentionCall, cp_block_call, cuda_sdpa_kernel
from tricorn.config_args import config_from_args
from tricorn.parallel.context import COMM_TYPES, local_positions
from tricorn.planning.activations import layout_layer_bytes
from tricorn.planning.layout import Layout

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


def _comm(kind: str) -> list[str]:
    return ["--cp-comm-type", kind]


CP2 = ["--context-parallel-size", "2"]
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
SELECTIVE = "--recompute-granularity selective --recompute-modules core_attn".split()
# name: (ranks, GQA or not, flags beyond the base)
LAYOUTS = {
    "p2p-mha-full-recompute": (2, False, CP2 + _comm("p2p") + FULL),
    "a2a-gqa-selective-recompute": (2, True, CP2 + _comm("a2a") + SELECTIVE),
    "allgather-mha": (2, False, CP2 + _comm("allgather")),
    "a2a-gqa-cp4": (4, True, ["--context-parallel-size", "4"] + _comm("a2a")),  # 2 groups < CP 4: replicated
    # a2a with TP: each TP rank's 2 query heads split over CP, its 1 key/value group replicated.
    "a2a-gqa-tp2-sp": (4, True, CP2 + _comm("a2a") + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}
PROBED = ("p2p-mha-full-recompute", "a2a-gqa-selective-recompute", "allgather-mha")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_comm_type_equals_single_process(tmp_path, name):
    nproc, gqa, extra = LAYOUTS[name]
    flags = BASE_FLAGS + (GQA if gqa else [])
    report = ["--tensorboard-dir", str(tmp_path / "tb")] if name in PROBED else []
    assert_equivalent(flags, nproc, tmp_path, extra + report)
    if report:  # iteration 1's saved-tensor probe on every rank == this comm type's activation estimate
        cfg = config_from_args(flags + extra, world_size=nproc)
        layout = Layout.from_config(cfg)
        expected = layout_layer_bytes(cfg.model, layout)
        if layout.recompute == "full":  # the chunk's first checkpoint also keeps the int64 position ids (8 s bytes)
            expected += 8 * (cfg.model.seq_length // layout.cp) / cfg.model.num_layers
        measured = [e["activation_bytes_per_layer"] for e in json.loads((tmp_path / "tb" / "memory_report.json").read_text())]
        assert measured == [expected] * nproc, (measured, expected)


@pytest.mark.parametrize(
    "extra, world, needle",
    [
        (CP2 + ["--seq-length", "62", "--max-position-embeddings", "62"], 2, "divisible by 2 x CP = 4"),
        (["--context-parallel-size", "8"] + _comm("a2a") + ["--seq-length", "64"], 8, "--cp-comm-type a2a needs"),
    ],
)
def test_bad_cp_input_is_one_line(tmp_path, monkeypatch, extra, world, needle):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = BASE_FLAGS
    for flag, value in zip(extra[::2], extra[1::2]):
        argv = with_flag(argv, flag, value)
    assert_refused(argv, tmp_path, needle=needle)


def _block(dtype, heads=(8, 2), s=(128, 256), d=64, causal=False) -> AttentionCall:
    shapes = ((2, heads[0], s[0], d), (2, heads[1], s[1], d), (2, heads[1], s[1], d))
    return AttentionCall(*shapes, (dtype,) * 3, (1, 1, 1), (0, 0, 0), is_causal=causal, enable_gqa=heads[0] != heads[1])


@pytest.mark.parametrize(
    "call, kernel",
    [
        (_block(torch.bfloat16), FLASH),  # a ring step's unmasked block, GQA native
        (_block(torch.bfloat16, s=(128, 128), causal=True), FLASH),  # step 0: square causal
        (_block(torch.float32), EFFICIENT),  # fp32: the efficient op on k, v repeated to q's heads
        (_block(torch.bfloat16, d=512), EFFICIENT),  # head dim over flash's 256
    ],
)
def test_cuda_block_calls_are_fused(call, kernel):
    """The call blocks.py makes on CUDA for one CP block (attention_kernels.cp_block_call) runs a fused kernel."""
    assert cuda_sdpa_kernel(cp_block_call(call)) == kernel


def test_planner_considers_cp_from_16k_with_each_comm_type():
    from tricorn.config import ModelConfig
    from tricorn.planning.planner import cp_comm_types, valid_cps
    from tricorn.presets import PRESETS

    model = ModelConfig(**{**PRESETS["llama3-8b"], "seq_length": 8192})
    assert valid_cps(model) == [1]
    model = ModelConfig(**{**PRESETS["llama3-8b"], "seq_length": 16384, "max_position_embeddings": 16384})
    assert 8 in valid_cps(model)
    assert cp_comm_types(model, tp=2, cp=8) == COMM_TYPES  # 16 query heads per TP rank divide over CP 8
    assert cp_comm_types(model, tp=8, cp=8) == ("p2p", "allgather")  # 4 per TP rank do not: no a2a
