"""A Megatron-LM run continues in tricorn on Megatron's own curve (issue 38), checked against Megatron's own training.

tests/fixtures/megatron_parity/ holds runs of Megatron-LM's pretrain_gpt.py itself (core_v0.19.0 with megatron-core
0.19.2 on CPU ranks over gloo: scripts/make_megatron_parity.py): a Llama-like model at DP1 and a GPT-like one at DP2
(and at PP2, and TP2 x PP2), gradient accumulation, warm-up then cosine decay, weight decay, clipping that
triggers, on a SentencePiece-tokenized corpus whose pad tokens Megatron leaves out of the loss; each run's loss,
grad norm and lr per iteration, its checkpoint at iteration K in every optimizer format Megatron writes, and the
initial weights. Each checkpoint is imported with `tricorn import-megatron` and trained on to iteration N in
tricorn (tests/megatron_parity.py), on its own layout or another. megatron is not imported here.

Tolerances: the loss and grad norm are held to FP32_RTOL (tests/harness.py): tricorn and Megatron run the same fp32
math through different kernels (SDPA against Megatron's baddbmm softmax, one fused QKV GEMM against its own), so
only the order of fp32 sums differs, which is what FP32_RTOL bounds. The lr is compared with ==: both compute
megatron-core's OptimizerParamScheduler in Python floats, op for op.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from harness import FP32_RTOL, run_layout
from megatron_parity import (
    FIXTURES,
    FROM_ITERATION0,
    RESUMES,
    cases,
    continue_in_tricorn,
    differences,
    import_case,
    megatron_run,
    validation_differences,
    workdir,
)

from tricorn.checkpoint.interop.hf_mapping import ConvertError
from tricorn.checkpoint.interop.megatron import import_megatron, read_megatron
from tricorn.checkpoint.io import read_meta, read_tensors

CASES = cases()
K = 5  # every case's checkpoint
N = 10  # Megatron's last iteration
LLAMA_FORMATS = ("llama_dp1", "llama_dp1_distopt", "llama_dp1_fully", "llama_dp1_torch", "llama_dp1_torch_distopt")


def assert_follows_megatron(run, case: str, first: int) -> None:
    diffs = differences(run.records, megatron_run(case))
    assert [d.iteration for d in diffs] == list(range(first, N + 1)), run.stdout[-3000:]
    for d in diffs:
        assert d.loss <= FP32_RTOL, f"{case}: iteration {d.iteration}'s loss is {d.loss:.3g} (relative) off Megatron's"
        assert d.grad_norm <= FP32_RTOL, f"{case}: iteration {d.iteration}'s grad norm is {d.grad_norm:.3g} off"
        assert d.lr_equal, f"{case}: iteration {d.iteration} logs lr {d.lr!r}, Megatron {d.megatron_lr!r}"


def test_fixtures_are_megatrons_runs_of_what_the_issue_asks():
    """Llama- and GPT-like, DP1 and DP2, accumulation, warm-up then cosine decay, weight decay, clipping that
    triggers in some iterations only, masked tokens, and every optimizer format; read from the runs themselves."""
    seen = set()
    for case in CASES:
        run = megatron_run(case)
        args = read_megatron(FIXTURES / case / "megatron").args
        dp, gbs, mbs = args["data_parallel_size"], args["global_batch_size"], args["micro_batch_size"]
        seen |= {("model", "llama" if args["swiglu"] else "gpt"), ("dp", dp), ("fmt", args["ckpt_format"])}
        seen |= {("distopt", args["use_distributed_optimizer"]), ("fully", bool(args.get("dist_ckpt_optim_fully_reshardable")))}
        seen |= {("pp", args["pipeline_model_parallel_size"]), ("buckets", bool(args["overlap_grad_reduce"]))}
        assert gbs // (mbs * dp) > 1, f"{case}: no gradient accumulation"
        assert args["lr_warmup_iters"] > 0 and args["lr_decay_style"] == "cosine" and args["weight_decay"] > 0
        clipped = [r["iteration"] for r in run["iterations"] if r["grad_norm"] > args["clip_grad"]]
        assert 0 < len(clipped) < N, f"{case}: clipped at {clipped}"
        assert run["megatron_core"] == "0.19.2" and len(run["iterations"]) == N and run["save_iteration"] == K
    want = {("model", "llama"), ("model", "gpt"), ("dp", 1), ("dp", 2), ("fmt", "torch"), ("fmt", "torch_dist")}
    want |= {("distopt", True), ("distopt", False), ("fully", True), ("pp", 2), ("buckets", True)}
    assert want <= seen, want - seen
    corpus = np.fromfile(FIXTURES / "corpus_text_document.bin", dtype=np.uint16)
    assert (corpus == 3).mean() > 0.02, "too few pad tokens (id 3) to exercise the loss normalisation"
    total = sum(f.stat().st_size for f in FIXTURES.rglob("*") if f.is_file())
    assert total < 8 * 2**20, f"fixtures grew to {total / 2**20:.1f} MiB"


def test_every_optimizer_format_imports_the_same_state(tmp_path):
    """Megatron's runs of one model differ only in how they save (their curves are equal bit for bit): the FP32
    optimizer's torch_dist and legacy state, the distributed optimizer's dp_reshardable (bucketed or not),
    fully_reshardable and distrib_optim.pt import to the same tensors, bit for bit, with the same progress."""
    for group in (LLAMA_FORMATS, ("gpt_dp2_distopt_buckets", "gpt_dp2_torch_distopt")):
        first = [megatron_run(c)["iterations"] for c in group]
        assert all(r == first[0] for r in first), f"{group}: Megatron's own curves differ"
        ref = None
        for case in group:
            ckpt = sorted(import_case(case, tmp_path).glob("iter_*"))[0]
            tensors, meta = read_tensors(ckpt), read_meta(ckpt)
            progress = {k: meta[k] for k in ("iteration", "consumed_train_samples", "optimizer_step", "lr")}
            assert progress["iteration"] == K and progress["optimizer_step"] == K, (case, progress)
            if ref is None:
                ref = (case, tensors, progress)
                continue
            assert progress == ref[2], (case, progress, ref[0], ref[2])
            assert tensors.keys() == ref[1].keys(), (case, ref[0])
            for key, value in tensors.items():
                assert torch.equal(value, ref[1][key]), f"{case}: {key} differs from {ref[0]}'s"
        assert any(k.endswith(".exp_avg_sq") for k in ref[1]) and ref[1]["optim.norm.weight.exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("case, nproc, flags", RESUMES, ids=[r[0] for r in RESUMES])
def test_resumed_from_iteration_k_tricorn_follows_megatrons_curve(tmp_path, case, nproc, flags):
    """Imported at iteration K (model, Adam moments and step, data position, lr schedule; data flags from
    megatron.yaml), tricorn's iterations K+1..N equal Megatron's: loss, grad norm and lr."""
    run = continue_in_tricorn(case, tmp_path, nproc, flags)
    assert f"resuming after iteration {K}" in run.stdout
    assert_follows_megatron(run, case, K + 1)


@pytest.mark.parametrize("case, nproc", FROM_ITERATION0)
def test_from_megatrons_initial_weights_tricorn_follows_megatrons_curve(tmp_path, case, nproc):
    """Imported from Megatron's iteration-0 weights (saved without optimizer or scheduler state: the schedule is
    rebuilt from the args at sample 0), tricorn's iterations 1..N equal Megatron's, warm-up included."""
    run = continue_in_tricorn(case, tmp_path, nproc, source="iteration0")
    assert_follows_megatron(run, case, 1)


def test_validation_losses_are_megatrons(tmp_path):
    """Megatron evaluates at iterations 5 and 10 (3 batches each, the validation iterator running on) and divides
    the evaluation's summed token losses by its summed valid tokens; the corpus's pad tokens give the batches
    different valid counts, so a mean of the batches' means is another figure. From Megatron's initial weights
    (eval flags carried by megatron.yaml), tricorn's validation losses equal Megatron's. Megatron's two evaluations
    after training (the validation split again, then the test split) tricorn does not run (docs/megatron.md)."""
    case = "llama_dp1_eval"
    run = continue_in_tricorn(case, tmp_path, source="iteration0")
    assert_follows_megatron(run, case, 1)
    assert [v["iteration"] for v in megatron_run(case)["validation"]] == [5, 10, 10, 10]
    diffs = validation_differences(run.records, megatron_run(case))
    assert [(i, j) for i, j, _ in diffs] == [(5, 5), (10, 10)], diffs
    for i, _, diff in diffs:
        assert diff <= FP32_RTOL, f"iteration {i}'s validation loss is {diff:.3g} (relative) off Megatron's"


def test_megatrons_command_line_trains_unchanged(tmp_path):
    """The Megatron command line of a fixture run (fusion switches, --use-cpu-initialization, --distributed-backend
    gloo, its data and tokenizer flags, ...) trains in tricorn as it is, after one line naming the no-ops: from
    Megatron's initial weights (the one flag added, --load), on Megatron's own curve, and saves where it said."""
    run = continue_in_tricorn("llama_dp1", tmp_path, source="iteration0", megatron_argv=True)
    notice = next(line for line in run.stdout.splitlines() if line.startswith("tricorn: "))
    assert "--use-cpu-initialization" in notice and "--no-rope-fusion" in notice, notice
    assert_follows_megatron(run, "llama_dp1", 1)
    work = tmp_path / "run-llama_dp1-iteration0-1-0"  # continue_in_tricorn's run directory: Megatron's --save megatron
    assert (work / "megatron" / "latest_checkpointed_iteration.txt").read_text().strip() == str(N)


def test_a_default_megatron_save_reads_safely():
    """Every pickled item of every fixture (common state with the rerun state machine's enums, the per-rank rerun
    and RNG objects, the distributed optimizer's objects, legacy .pt files, distrib_optim.pt) loads through the
    allow-list: a default Megatron 0.19 save holds nothing else."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from tricorn.checkpoint.interop.megatron import _dist_object
    from tricorn.checkpoint.interop.megatron_pickle import safe_load

    read = 0
    for root in (FIXTURES, FIXTURES.parent / "megatron_ckpt"):
        for it in root.glob("*/**/iter_*"):
            if (it / ".metadata").is_file():
                md = read_megatron(it).md
                for key, item in md.state_dict_metadata.items():
                    if isinstance(item, BytesStorageMetadata):
                        _dist_object(it, md, key)
                        read += 1
            for file in it.rglob("*.pt"):
                safe_load(file, str(file))
                read += 1
    assert read > 100, read
    common = read_megatron(FIXTURES / "llama_dp1" / "megatron").common
    assert common["rerun_state_machine"]["mode"] == "RerunMode.VALIDATE_RESULTS", common["rerun_state_machine"]


def test_bucket_sizes_that_disagree_with_the_args_are_refused(tmp_path, capsys):
    """The distributed optimizer's bucket layout is derived from the args and checked against what was saved:
    a disagreement is one line naming the bucket, never a guess."""
    ck = read_megatron(FIXTURES / "gpt_dp2_distopt_buckets" / "megatron")
    ck.args["ddp_bucket_size"] = 2000
    with pytest.raises(
        ConvertError,
        match=r"bucket 0 of the distributed optimizer's buffer of TP rank 0, PP rank 0 holds \d+ elements, the args \(--overlap-grad-reduce --ddp-bucket-size 2000 DP 2\) imply \d+",
    ):
        ck.distopt()
    # legacy distrib_optim.pt saves no bucket sizes: its buffer's total, then every fp32 master against its weight.
    # Args of Transformer Engine layers (whose fused norms register first) put the parameters elsewhere.
    from tricorn.checkpoint.interop.megatron_pickle import safe_load
    from tricorn.cli import main as cli

    src = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "gpt_dp2_torch_distopt" / "megatron", src)
    for file in (src / f"iter_{K:07d}").glob("mp_rank_*/model_optim_rng.pt"):
        state = safe_load(file, str(file))
        state["args"].transformer_impl = "transformer_engine"
        torch.save(state, file)
    assert cli(["import-megatron", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tricorn: error: ") and "\n" not in err and "master weights of" in err, err
    assert "tricorn does not guess" in err, err
    assert not (tmp_path / "out").exists()


def test_bucket_layout_at_every_saved_layout():
    """The layout tricorn derives gives the bucket sizes Megatron saved on every model-parallel rank: TP2 (the
    checkpoint fixtures), PP2 with a shared embedding's own buckets, TP2 x PP2, DP1 and DP2."""
    for path in (
        FIXTURES.parent / "megatron_ckpt" / "gpt_tp2_dist_dpresh",
        *(FIXTURES / c / "megatron" for c in ("gpt_pp2_distopt_buckets", "llama_tp2_pp2_distopt", "gpt_dp2_distopt_buckets")),
    ):
        ck = read_megatron(path)
        state = ck.distopt()  # raises on any disagreement
        tp, pp = ck.args["tensor_model_parallel_size"], ck.args["pipeline_model_parallel_size"]
        assert {(s.tp, s.pp) for slots in state.slots.values() for s in slots} == {(t, p) for t in range(tp) for p in range(pp)}


def test_without_megatrons_scheduler_state(tmp_path):
    """No scheduler state: a checkpoint saved with --no-save-optim has its schedule rebuilt from its args at its
    consumed samples, and one line says so and what it assumed; import --no-load-optim is Megatron's
    --no-load-optim, whose schedule starts again at sample 0 while the iteration goes on."""
    from tricorn.checkpoint.io import SCHEDULER_STATE

    lines: list[str] = []
    ckpt = sorted(import_case("llama_dp1", tmp_path, "iteration0", console=lines.append).glob("iter_*"))[0]
    assert read_meta(ckpt)[SCHEDULER_STATE]["num_steps"] == 0
    assert any(
        "holds no lr scheduler state (saved with --no-save-optim): the lr schedule is rebuilt from its args at 0 samples" in line
        for line in lines
    ), lines
    lines.clear()  # a later iteration: Megatron's llama_pp2_torch, re-saved model only after 1 iteration of 2 samples
    out = tmp_path / "resaved"
    import_megatron(FIXTURES.parent / "megatron_ckpt" / "llama_pp2_torch", out, console=lines.append)
    assert read_meta(sorted(out.glob("iter_*"))[0])[SCHEDULER_STATE]["num_steps"] == 2
    said = next(line for line in lines if "holds no lr scheduler state" in line)
    assert "at 2 samples, its consumed samples (assumed: every optimizer step succeeded" in said and "\n" not in said, said
    lines.clear()
    imported = import_case("llama_dp1", tmp_path, load_optim=False, console=lines.append)
    assert read_meta(sorted(imported.glob("iter_*"))[0])[SCHEDULER_STATE] is None
    assert any(line.startswith("--no-load-optim, as Megatron's: no optimizer or lr scheduler state") for line in lines), lines
    # trained on one iteration: K+1 runs at sample 0's lr and logs the lr after one step, Megatron's iteration 1's
    flags = [
        "--config",
        str(imported / "megatron.yaml"),
        "--load",
        str(imported),
        "--log-interval",
        "1",
        "--train-iters",
        str(K + 1),
    ]
    run = run_layout(flags, 1, workdir(tmp_path / "run"))
    (record,) = [r for r in run.records if "loss" in r]
    assert record["iteration"] == K + 1 and record["lr"] == megatron_run("llama_dp1")["iterations"][0]["lr_logged"], record
