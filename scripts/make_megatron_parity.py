"""Write tests/fixtures/megatron_parity/: Megatron-LM's own training runs, their per-iteration figures and checkpoints.

Run in the fixture environment (megatron-core 0.19.2 on Python 3.12, Megatron-LM's source at core_v0.19.0, and
sentencepiece, which Megatron's SentencePieceTokenizer needs):

    /tmp/mcore/bin/python -m pip install --target /tmp/extra sentencepiece==0.2.3
    PYTHONPATH=/tmp/extra /tmp/mcore/bin/python scripts/make_megatron_parity.py --megatron-lm /tmp/Megatron-LM

Each case is Megatron-LM's `pretrain_gpt.py`, unmodified, started on CPU ranks with gloo (the monkeypatches of
make_megatron_checkpoints.cpu_patches, plus pretrain_patches below: none changes the math), on a real corpus:
a tiny SentencePiece tokenizer with a <pad> piece and a `.bin/.idx` corpus (written by megatron-core's
IndexedDatasetBuilder) whose documents carry pad tokens, which GPTDataset leaves out of the loss. The cases
cover a Llama-like model (RMSNorm, SwiGLU, RoPE, GQA, untied) at DP1 and a GPT-like model (LayerNorm, GeLU,
learned positions, tied, biases) at DP2, with gradient accumulation, warm-up then cosine decay, weight decay and
clipping that triggers (checked here), and every optimizer checkpoint format: the FP32 optimizer and the
distributed optimizer's dp_reshardable (Megatron's default) and fully_reshardable torch_dist states, and legacy
torch with `model_optim_rng.pt` and `distrib_optim.pt`, one bucketed with --overlap-grad-reduce.

Stored per case `CASE/`: `megatron/` (Megatron's --save directory, holding iteration K only) and `run.json`:
Megatron's argv (paths relative to this directory, so the fixtures move with the checkout), and per iteration
the lm loss and grad norm Megatron logged, the lr the iteration's optimizer step used (`lr`) and the lr Megatron
logged (`lr_logged`: after its scheduler step, the next iteration's), and each evaluation's validation loss
(`validation`, empty where the case does not evaluate). Cases marked `iteration0` also save the
initial weights, before iteration 1, as `CASE/iteration0/` (Megatron's save_checkpoint at iteration 0 with
--no-save-optim semantics: model only, no optimizer or scheduler state).
tests/test_megatron_parity.py imports these checkpoints and trains on in tricorn, without importing megatron.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_megatron_checkpoints import MEGATRON_CORE_VERSION, cpu_patches  # noqa: E402

SAVE_ITERATION = 5  # K: the checkpoint every case keeps
TRAIN_ITERS = 10  # N
VOCAB = 40  # SentencePiece pieces: <unk> <s> </s> <pad> and 36 characters
PAD_ID, EOD_ID = 3, 2
CORPUS = "corpus_text_document"
TOKENIZER = "tokenizer.model"
# megatron-core 0.19.2's GPTDataset caches the loss mask of the first sample a process reads *after* zeroing that
# sample's pad labels in place, so every later sample inherits those zeros (a bug tricorn does not copy). With
# this corpus seed the samples each rank reads first hold no pad label, so Megatron's masks are each sample's own;
# `pretrain_patches` checks it during every run.
CORPUS_SEED = 28
CLIP_GRAD = 1.2  # between the runs' grad norms: some iterations are clipped, some not

COMMON = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--train-iters", str(TRAIN_ITERS), "--save-interval", str(SAVE_ITERATION), "--save", "megatron",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", str(CLIP_GRAD),
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--seed", "1234",
    "--data-path", CORPUS, "--split", "90,8,2", "--tokenizer-type", "SentencePieceTokenizer",
    "--tokenizer-model", TOKENIZER, "--make-vocab-size-divisible-by", "16",
    "--eval-interval", "1000", "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-rope-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--distributed-backend", "gloo",
]  # fmt: skip
LLAMA = [
    "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2",
    "--micro-batch-size", "1", "--global-batch-size", "4",  # 4 microbatches on one rank
]  # fmt: skip
GPT = [
    "--normalization", "LayerNorm", "--ffn-hidden-size", "64", "--position-embedding-type", "learned_absolute",
    "--micro-batch-size", "2", "--global-batch-size", "8",  # 2 microbatches on each of 2 DP ranks (4 at PP2)
]  # fmt: skip
DISTOPT = ["--use-distributed-optimizer"]

# name -> (world size, flags, save the iteration-0 weights)
CASES: dict[str, tuple[int, list[str], bool]] = {
    "llama_dp1": (1, LLAMA + ["--ckpt-format", "torch_dist"], True),
    "llama_dp1_distopt": (1, LLAMA + DISTOPT, False),  # torch_dist, dp_reshardable: Megatron's defaults
    "llama_dp1_fully": (1, LLAMA + DISTOPT + ["--dist-ckpt-optim-fully-reshardable"], False),
    "llama_dp1_torch": (1, LLAMA + ["--ckpt-format", "torch"], False),
    # Evaluation at iterations 5 and 10 and after training (3 batches each): Megatron's validation losses, over
    # batches whose pad tokens make their valid-token counts differ.
    "llama_dp1_eval": (1, LLAMA + ["--ckpt-format", "torch_dist", "--eval-interval", "5", "--eval-iters", "3"], True),
    "llama_dp1_torch_distopt": (1, LLAMA + DISTOPT + ["--ckpt-format", "torch"], False),
    "gpt_dp2": (2, GPT, True),
    # several buckets per buffer: --overlap-grad-reduce closes a bucket once it holds 3000 elements
    "gpt_dp2_distopt_buckets": (2, GPT + DISTOPT + ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"], False),
    "gpt_dp2_torch_distopt": (
        2,
        GPT + DISTOPT + ["--ckpt-format", "torch", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"],
        False,
    ),
    # Pipeline stages: with tied embeddings each stage's copy of the word embeddings has a bucket of its own, and
    # stages after the first have one bucket whatever the bucket size; TP x PP numbers the dp_group_idx objects.
    "gpt_pp2_distopt_buckets": (
        2,
        GPT + DISTOPT + ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"],
        False,
    ),
    "llama_tp2_pp2_distopt": (
        4,
        LLAMA + DISTOPT + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        False,
    ),
}


# ---------------------------------------------------------------- the corpus and the tokenizer


def write_tokenizer(out: Path) -> None:
    """A SentencePiece character model: <unk> 0, <s> 1, </s> 2 (eod), <pad> 3, then a-z and 0-9."""
    import io

    import sentencepiece as spm

    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    rng = np.random.default_rng(11)
    lines = ["".join(rng.choice(list(chars), size=40)) for _ in range(200)] + [chars]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="char",
        vocab_size=VOCAB,
        pad_id=PAD_ID,
        character_coverage=1.0,
        normalization_rule_name="identity",  # no normalisation table: the model stays a few KB
        num_threads=1,
        minloglevel=2,
    )
    (out / TOKENIZER).write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=str(out / TOKENIZER))
    assert (sp.get_piece_size(), sp.eos_id(), sp.pad_id()) == (VOCAB, EOD_ID, PAD_ID), "the tokenizer's specials moved"


def write_corpus(out: Path) -> None:
    """300 documents of 2-30 ids, about a third padded with 1-6 pad tokens before their eod (as a padded export would be)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(CORPUS_SEED)
    builder = IndexedDatasetBuilder(str(out / f"{CORPUS}.bin"), dtype=np.uint16)
    for _ in range(300):
        doc = list(rng.integers(PAD_ID + 1, VOCAB, size=int(rng.integers(2, 31))))
        if rng.random() < 1 / 3:
            doc += [PAD_ID] * int(rng.integers(1, 7))
        doc.append(EOD_ID)
        builder.add_document(np.array(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(str(out / f"{CORPUS}.idx"))


# ---------------------------------------------------------------- Megatron-LM's pretrain_gpt.py on a CPU


@contextlib.contextmanager
def pretrain_patches():
    """What pretrain_gpt.py needs on a CPU beyond cpu_patches: none of it changes the math.

    initialize_megatron asserts CUDA (so it is reported present, with one device); the JIT fusion warm-up runs
    CUDA kernels (skipped: every fusion is off); the C++ dataset helpers are the wheel's prebuilt ones (no
    `make`); batches are not pinned; torch.optim's CUDA-graph capture check is skipped. And a check: the loss
    mask GPTDataset caches holds no pad zeros (CORPUS_SEED)."""
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.training as training
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.optim.Optimizer._accelerator_graph_capture_health_check = lambda self: None
    dataset_utils.compile_helpers = lambda: None
    training.set_jit_fusion_options = lambda *a, **k: None
    getitem = GPTDataset.__getitem__

    def checked_getitem(self, idx):
        sample = getitem(self, idx)
        cached = getattr(self, "cached_loss_mask", None)
        assert cached is None or bool(cached.all()), "GPTDataset cached a loss mask with pad zeros: pick another CORPUS_SEED"
        return sample

    GPTDataset.__getitem__ = checked_getitem
    with cpu_patches():
        yield


@contextlib.contextmanager
def recorder(iterations: list[dict], iteration0: str, validations: list[dict]):
    """Record each iteration's lm loss, grad norm and lr (used, and logged) through Megatron's own train_step and
    training_log, and each evaluation's lm loss (after the last logged iteration) through its evaluate; save the
    initial weights as iteration 0 (model only) when `iteration0` names a directory."""
    import megatron.training.training as training
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import get_args

    train, train_step, training_log = training.train, training.train_step, training.training_log
    evaluate = training.evaluate
    used: list[float] = []

    def evaluate_wrapper(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        losses = result[0]
        if losses and "lm loss" in losses:  # the last pipeline stage's figure
            after = iterations[-1]["iteration"] if iterations else 0
            validations.append({"iteration": after, "loss": float(losses["lm loss"])})
        return result

    def train_wrapper(forward_step_func, model, optimizer, scheduler, *rest, **kwargs):
        if iteration0:
            args = get_args()
            saved = (args.save, args.no_save_optim)
            args.save, args.no_save_optim = iteration0, True
            save_checkpoint(0, model, None, None, 0)
            args.save, args.no_save_optim = saved
        return train(forward_step_func, model, optimizer, scheduler, *rest, **kwargs)

    def train_step_wrapper(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs):
        used.append(float(optimizer.param_groups[0]["lr"]))
        return train_step(forward_step_func, data_iterator, model, optimizer, *rest, **kwargs)

    def training_log_wrapper(
        loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, memory, skipped, grad_norm, *rest, **kw
    ):
        loss = loss_dict.get("lm loss")
        iterations.append(
            {
                "iteration": int(iteration),
                "loss": float(loss) if loss is not None else None,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "lr": used[-1],
                "lr_logged": float(learning_rate),
                "skipped": int(skipped),
            }
        )
        return training_log(
            loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, memory, skipped, grad_norm, *rest, **kw
        )

    training.train, training.train_step, training.training_log = train_wrapper, train_step_wrapper, training_log_wrapper
    training.evaluate = evaluate_wrapper
    try:
        yield
    finally:
        training.train, training.train_step, training.training_log = train, train_step, training_log
        training.evaluate = evaluate


def _rank(rank: int, world: int, argv: list[str], workdir: str, port: int, megatron_lm: str, record: str, iteration0: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1")
    os.chdir(workdir)  # argv's paths are relative to the case's directory
    sys.path.append(megatron_lm)  # after site-packages: megatron.core is the 0.19.2 wheel, the scripts Megatron-LM's
    log = open(Path(workdir) / f"rank{rank}.log", "w")
    sys.stdout = sys.stderr = log
    iterations: list[dict] = []
    validations: list[dict] = []
    with pretrain_patches(), recorder(iterations, iteration0, validations):
        sys.argv = ["pretrain_gpt.py", *argv]
        runpy.run_path(str(Path(megatron_lm) / "pretrain_gpt.py"), run_name="__main__")
    Path(f"{record}.{rank}").write_text(json.dumps(iterations))  # the loss is known on the last pipeline stage
    Path(f"{record}.valid.{rank}").write_text(json.dumps(validations))


def run_case(name: str, out: Path, megatron_lm: Path) -> None:
    import torch
    import torch.multiprocessing as mp

    world, flags, with_iteration0 = CASES[name]
    argv = COMMON + flags
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out))
    for shared in (f"{CORPUS}.bin", f"{CORPUS}.idx", TOKENIZER):
        os.symlink(out / shared, work / shared)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = work / "iterations.json"
    iteration0 = str(work / "iteration0") if with_iteration0 else ""
    try:
        mp.start_processes(
            _rank,
            args=(world, argv, str(work), port, str(megatron_lm), str(record), iteration0),
            nprocs=world,
            start_method="spawn",
        )
    except Exception:
        print(f"{name} failed; its logs: {work}/rank*.log")
        raise
    ranks = [json.loads(Path(f"{record}.{r}").read_text()) for r in range(world)]
    iterations = next(r for r in ranks if all(i["loss"] is not None for i in r))
    validation = max((json.loads(Path(f"{record}.valid.{r}").read_text()) for r in range(world)), key=len)
    assert [r["iteration"] for r in iterations] == list(range(1, TRAIN_ITERS + 1)), iterations
    assert not any(r["skipped"] for r in iterations), "megatron skipped a step"
    clipped = [r["iteration"] for r in iterations if r["grad_norm"] > CLIP_GRAD]
    assert 0 < len(clipped) < len(iterations), f"clipped at {clipped}: pick a --clip-grad that clips some iterations only"
    # Keep iteration K only: the checkpoint tricorn resumes from (Megatron also saved at N).
    save = work / "megatron"
    for it in save.glob("iter_*"):
        if it.name != f"iter_{SAVE_ITERATION:07d}":
            shutil.rmtree(it)
    (save / "latest_checkpointed_iteration.txt").write_text(str(SAVE_ITERATION))
    run = {
        "megatron_core": MEGATRON_CORE_VERSION,
        "torch": torch.__version__,
        "world_size": world,
        "argv": argv,
        "save_iteration": SAVE_ITERATION,
        "clipped_iterations": clipped,
        "iterations": iterations,
        "validation": validation,  # each evaluation's lm loss, after the iteration it follows
    }
    (work / "run.json").write_text(json.dumps(run, indent=1))
    shutil.rmtree(work / CORPUS, ignore_errors=True)  # Megatron's dataset index cache, CORPUS/cache
    for junk in [
        *work.glob("rank*.log"),
        *(work / s for s in (f"{CORPUS}.bin", f"{CORPUS}.idx", TOKENIZER)),
        *work.glob("iterations.json.*"),
    ]:
        junk.unlink()
    final = out / name
    shutil.rmtree(final, ignore_errors=True)
    shutil.move(str(work), final)
    size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    print(f"wrote {final} ({size / 1024:.0f} KB): losses {[round(r['loss'], 4) for r in iterations]}, clipped at {clipped}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("tests/fixtures/megatron_parity"))
    parser.add_argument("--megatron-lm", type=Path, default=Path("/tmp/Megatron-LM"), help="Megatron-LM's source (core_v0.19.0)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    import megatron.core

    assert megatron.core.__version__ == MEGATRON_CORE_VERSION, megatron.core.__version__
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not (out / TOKENIZER).exists() or not (out / f"{CORPUS}.idx").exists():
        write_tokenizer(out)
        write_corpus(out)
    for name in args.cases:
        run_case(name, out, args.megatron_lm.resolve())
    return 0


if __name__ == "__main__":  # spawned ranks import this file: only the parent runs main
    sys.exit(main())
