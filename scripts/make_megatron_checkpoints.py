"""Write tests/fixtures/megatron_ckpt/: tiny Megatron-LM checkpoints saved by megatron-core itself, with its logits.

Run in the fixture environment of scripts/make_megatron_fixtures.py (megatron-core 0.19.2 on Python 3.12):

    /tmp/mcore/bin/pip install psutil   # megatron's dist-checkpointing saver needs it
    /tmp/mcore/bin/python scripts/make_megatron_checkpoints.py --output tests/fixtures/megatron_ckpt

The committed fixtures were written with megatron-core 0.19.2 and torch 2.14.1 (the wheel pip resolved for
megatron-core on Python 3.12), on a CPU.

Each case trains one iteration with megatron's own GPTModel (local layer spec), DDP, optimizer and
lr scheduler, saves with megatron.training.checkpointing.save_checkpoint, and stores beside the
checkpoint `reference.npz`: fixed token ids and megatron's fp32 logits for them (all vocabulary columns,
padding included, gathered over TP). tests/test_megatron_checkpoint.py compares tricorn's import against
them without importing megatron.

`--check-export DIR --case NAME` goes the other way: it builds the case's model in megatron, loads the
tricorn-exported Megatron checkpoint DIR with megatron's own loader and asserts the logits equal the
case's reference (docs/megatron.md shows the command).

megatron-core targets CUDA; on a CPU box it runs with gloo and five monkeypatches (cpu_patches), an
explicit causal mask, and every fusion off. Each case runs in fresh processes (torch.multiprocessing
spawn, one per rank), because megatron keeps its process groups and arguments in globals.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

MEGATRON_CORE_VERSION = "0.19.2"
SEQ = 16
TOKENS_SEED = 7

COMMON = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", str(SEQ), "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "10",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--init-method-std", "0.05",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--make-vocab-size-divisible-by", "32",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-rope-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--seed", "1234", "--distributed-backend", "gloo",
    "--no-save-rng", "--mock-data", "--save-interval", "1",
]  # fmt: skip
LLAMA = [
    "--normalization", "RMSNorm", "--swiglu", "--ffn-hidden-size", "64", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--rotary-base", "10000", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2", "--norm-epsilon", "1e-5",
]  # fmt: skip
GPT = ["--normalization", "LayerNorm", "--ffn-hidden-size", "64", "--position-embedding-type", "learned_absolute"]
DISTOPT = ["--use-distributed-optimizer"]
FULLY = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]

# name -> (world size, megatron flags). Together: Llama-like and GPT-like, TP1 and TP2, torch_dist and
# legacy torch, the FP32 optimizer and the distributed optimizer (fully_reshardable and dp_reshardable). Every
# other flag is Megatron's default (--rerun-mode validate_results included). (Pipeline-parallel training runs
# in scripts/make_megatron_parity.py, through pretrain_gpt.py.)
CASES: dict[str, tuple[int, list[str]]] = {
    "llama_tp1_dist": (1, LLAMA + ["--ckpt-format", "torch_dist"]),
    "llama_tp2_dist_fully": (2, LLAMA + FULLY + ["--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2"]),
    "llama_tp2_torch_distopt": (2, LLAMA + DISTOPT + ["--ckpt-format", "torch", "--tensor-model-parallel-size", "2"]),
    "gpt_tp1_torch": (1, GPT + ["--ckpt-format", "torch"]),
    "gpt_tp2_dist_dpresh": (2, GPT + DISTOPT + ["--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2"]),
}

# name -> (case it is re-saved from, world size, megatron flags): megatron-core loads the source case's torch_dist
# checkpoint at another layout and saves it again in the legacy format (model only, iteration 1); the weights are
# the source's, so the source's logits are this checkpoint's. Covers the legacy format's pipeline stages.
RESAVED: dict[str, tuple[str, int, list[str]]] = {
    "llama_pp2_torch": ("llama_tp1_dist", 2, LLAMA + ["--pipeline-model-parallel-size", "2"]),
}


def fixed_tokens(vocab: int = 60) -> np.ndarray:
    return np.random.default_rng(TOKENS_SEED).integers(0, vocab, size=(2, SEQ)).astype(np.int64)


# ---------------------------------------------------------------- megatron on a CPU


def cpu_patches() -> contextlib.ExitStack:
    """The five monkeypatches megatron-core 0.19.2 needs to build, train and save on a CPU with gloo."""
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.training.arguments as margs
    import torch
    from torch.overrides import TorchFunctionMode

    torch.cuda.current_device = lambda: "cpu"  # 1. RoPE inv_freq, DDP buffers, the dist-checkpointing saver
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # 2. CUDA RNG -> the CPU generator
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed, *a, **k: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda *a, **k: None  # torch.manual_seed calls it: seeding the CPU again would recurse
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    class _Stream:
        def synchronize(self):
            pass

        def wait_stream(self, other):
            pass

        def record_event(self, *a):
            return None

    torch.cuda.synchronize = lambda *a, **k: None  # 3.
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.Stream = lambda *a, **k: _Stream()  # get_model builds DDP "on a side stream"
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    margs.get_device_arch_version = lambda: 10  # 5. validate_args at TP > 1

    class CudaIsCpu(TorchFunctionMode):  # 4. DDP and the optimizer allocate on "cuda" and check Tensor.type()
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            dev = kwargs.get("device")
            if dev is not None and "cuda" in str(dev):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda or func is torch.Tensor.to and args and _is_cuda_arg(args[1:], kwargs):
                if func is torch.Tensor.cuda:
                    return args[0]
                args = tuple(a for a in args if not _is_cuda(a))
                kwargs.pop("device", None)
                if len(args) == 1 and not kwargs:
                    return args[0]
            result = func(*args, **kwargs)
            if func is torch.Tensor.type and len(args) == 1 and isinstance(result, str):
                return result.replace("torch.", "torch.cuda.", 1) if "cuda" not in result else result
            return result

    stack = contextlib.ExitStack()
    stack.enter_context(CudaIsCpu())
    return stack


def _is_cuda(a) -> bool:
    return (isinstance(a, str) and a.startswith("cuda")) or (hasattr(a, "type") and getattr(a, "type", None) == "cuda")


def _is_cuda_arg(args, kwargs) -> bool:
    return any(_is_cuda(a) for a in args) or _is_cuda(kwargs.get("device"))


def causal_mask():
    import torch

    return torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked


def _init_rerun_state_machine(args) -> None:
    """As megatron.training.initialize does: the rerun state machine in --rerun-mode (validate_results by default),
    whose state a torch_dist save stores in its common state."""
    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import (
        RerunDiagnostic,
        RerunErrorInjector,
        RerunMode,
        initialize_rerun_state_machine,
    )

    def state_save_func():
        return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def state_restore_func(state_dict):
        if state_dict["rng_tracker_states"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(state_dict["rng_tracker_states"])

    initialize_rerun_state_machine(
        state_save_func=state_save_func,
        state_restore_func=state_restore_func,
        mode=RerunMode(args.rerun_mode),
        error_injector=RerunErrorInjector(
            error_injection_rate=args.error_injection_rate,
            error_injection_type=RerunDiagnostic(args.error_injection_type),
        ),
        result_rejected_tracker_filename=args.result_rejected_tracker_filename,
    )


def build(argv: list[str]):
    """Megatron's args, GPTModel (DDP-wrapped), optimizer and scheduler, as pretrain_gpt.py builds them."""
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import setup_model_and_optimizer

    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=True)
    _init_rerun_state_machine(args)
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        cfg = core_transformer_config_from_args(args)
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=False)
        return GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
        )

    model, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder, provider)
    return args, model, optimizer, scheduler


def logits(model, tokens) -> np.ndarray:
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    inner = model[0].module
    inner.eval()
    ids = torch.from_numpy(tokens)
    pos = torch.arange(SEQ).expand_as(ids)
    with torch.no_grad():
        out = inner(ids, pos, causal_mask())  # [b, s, vocab / TP]
        out = gather_from_tensor_model_parallel_region(out)
    inner.train()
    return out.float().numpy()


def train_one_iteration(args, model, optimizer, scheduler) -> None:
    """One iteration on fixed_tokens as Megatron's train_step runs it: forward-backward and the DP gradient sync
    inside the rerun state machine's loop (whose --rerun-mode validate_results checks the gradients there)."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    ids = torch.from_numpy(fixed_tokens())
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(SEQ).expand_as(ids)
    rerun = get_rerun_state_machine()
    while rerun.should_run_forward_backward(None):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model[0](ids, pos, causal_mask(), labels=labels).float().mean()
        loss.backward()
        for chunk in model:
            chunk.finish_grad_sync()
    rerun.should_checkpoint_and_exit()
    ok, _, _ = optimizer.step()
    assert ok, "megatron skipped the step"
    scheduler.step(increment=args.global_batch_size)
    args.consumed_train_samples = args.global_batch_size


def _worker(rank: int, world: int, name: str, argv: list[str], out: str, port: int, check: str, imported: str = "") -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), CUDA_DEVICE_MAX_CONNECTIONS="1")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    with cpu_patches():
        if imported:
            _check_import(argv, Path(out), Path(check), Path(imported))
        elif check:
            _check_export(name, argv, Path(out), Path(check))
        elif name in RESAVED:
            _resave_case(name, argv, Path(out))
        else:
            _write_case(name, argv, Path(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _write_case(name: str, argv: list[str], out: Path) -> None:
    import torch
    from megatron.training.checkpointing import save_checkpoint

    args, model, optimizer, scheduler = build(argv + ["--save", str(out)])
    train_one_iteration(args, model, optimizer, scheduler)
    tokens = fixed_tokens()
    ref = logits(model, tokens)
    save_checkpoint(1, model, optimizer, scheduler, 0)
    if torch.distributed.get_rank() == 0:
        np.savez(out / "reference.npz", tokens=tokens, logits=ref)
        (out / "megatron_flags.json").write_text(
            json.dumps({"version": MEGATRON_CORE_VERSION, "torch": torch.__version__, "argv": argv}, indent=1)
        )


def _resave_case(name: str, argv: list[str], out: Path) -> None:
    import torch
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    args, model, optimizer, scheduler = build(argv)  # the source's torch_dist --load, from _launch
    source = Path(args.load)
    load_checkpoint(model, None, None, strict=True)
    args.ckpt_format, args.use_dist_ckpt, args.save, args.no_save_optim = "torch", False, str(out), True
    args.consumed_train_samples = args.global_batch_size
    save_checkpoint(1, model, None, None, 0)
    if torch.distributed.get_rank() == 0:
        shutil.copyfile(source / "reference.npz", out / "reference.npz")
        flags = {"version": MEGATRON_CORE_VERSION, "torch": torch.__version__, "resaved_from": source.name, "argv": argv}
        (out / "megatron_flags.json").write_text(json.dumps(flags, indent=1))


def _check_export(name: str, argv: list[str], ref_dir: Path, exported: Path) -> None:
    import torch
    from megatron.training.checkpointing import load_checkpoint

    fmt = (
        "torch"
        if (exported / "latest_checkpointed_iteration.txt").read_text().strip() and any(exported.glob("iter_*/mp_rank_*"))
        else "torch_dist"
    )
    flags = [a for a in argv if a not in ("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")]
    i = flags.index("--ckpt-format")
    flags[i + 1] = fmt
    args, model, optimizer, scheduler = build(flags + ["--load", str(exported), "--no-load-optim", "--no-load-rng"])
    load_checkpoint(model, None, None, strict=True)
    ref = np.load(ref_dir / "reference.npz")
    got = logits(model, ref["tokens"])
    err = float(np.abs(got - ref["logits"]).max())
    if torch.distributed.get_rank() == 0:
        print(f"{name}: megatron-core {MEGATRON_CORE_VERSION} loaded {exported} ({fmt}); max |logits diff| {err:.3g}")
    assert err <= 1e-5 * float(np.abs(ref["logits"]).max()), err


def _megatron_state(optimizer, p) -> dict:
    """Megatron's fp32 master and Adam moments of model parameter p (its TP piece), every DP shard gathered."""
    import torch
    from megatron.core import parallel_state

    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    if not hasattr(inner, "_get_main_param_and_optimizer_states"):  # the FP32 optimizer: torch's state of p itself
        state = inner.optimizer.state[p]
        return {"param": p.detach().float(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    full = {f: torch.zeros(p.numel(), dtype=torch.float32) for f in ("param", "exp_avg", "exp_avg_sq")}
    try:  # the part of p this DP rank owns, if any
        owned = inner._get_model_param_range_map(p)["param"]
        tensors = inner._get_main_param_and_optimizer_states(p)
        for f, t in full.items():
            t[owned.start : owned.end] = tensors[f].detach().view(-1)
    except KeyError:
        pass
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for t in full.values():  # each element is owned by one rank: x + 0 = x, exactly
        torch.distributed.all_reduce(t, group=group)
    return {f: t.view(p.shape) for f, t in full.items()}


def _check_import(argv: list[str], workdir: Path, source: Path, imported: Path) -> None:
    """Megatron's own load_checkpoint of `source` at its saved layout against tricorn's import of it: every
    parameter's fp32 master and Adam moments, TP piece by TP piece, bit for bit; the step too; and the
    parameters' registration order tricorn's distributed-optimizer import derives (megatron_distopt.stage_params)."""
    import torch
    from megatron.core import parallel_state
    from megatron.training.checkpointing import load_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tricorn: its mapping and its checkpoint reader
    from tricorn.checkpoint.interop.megatron import read_megatron
    from tricorn.checkpoint.interop.megatron_distopt import stage_params
    from tricorn.checkpoint.interop.megatron_mapping import model_config_from_args, split_tp, tensor_map, to_megatron
    from tricorn.checkpoint.io import find_checkpoint, read_meta, read_tensors

    os.chdir(workdir)  # the recorded argv's relative paths
    args, model, optimizer, scheduler = build(argv + ["--no-load-rng"])
    # Megatron's load_checkpoint, as a resume runs it. Without Apex or Transformer Engine (a CPU box) the distributed
    # optimizer's state_dict asserts a step that a fresh optimizer has not taken yet: Megatron's own dummy state
    # first (every value is then overwritten by the load).
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
        inner._init_optimizer_states_with_dummy_values()
        # Its loaders copy every key of a parameter's state, and torch's Adam keeps a per-parameter `step` that the
        # saved buffers do not hold (Apex's and TE's fused Adam keep it in the param groups): left to the param groups.
        cls = type(inner)
        setter = cls._set_main_param_and_optimizer_states
        cls._set_main_param_and_optimizer_states = lambda self, p, tensors: setter(self, p, {"step": None, **tensors})
    args.load = str(source)
    with torch.no_grad():  # the load copies into the fp32 parameters' views
        load_checkpoint(model, optimizer, scheduler, strict=True)
    saved = read_megatron(source).args
    m = model_config_from_args(saved, str(source))
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    expected = stage_params(saved, m, tensor_map(m), pp, str(source))
    named = [(n, p) for n, p in model[0].module.named_parameters() if p.requires_grad]
    assert [n for n, _ in named] == [q.name for q in expected], ([n for n, _ in named], [q.name for q in expected])
    ckpt, _ = find_checkpoint(imported, None)
    ours, meta = read_tensors(ckpt), read_meta(ckpt)
    compared = 0
    for (name, p), q in zip(named, expected):
        theirs = _megatron_state(optimizer, p)
        if q.entry is None:  # the last stage's copy of tied embeddings: the first stage's state is imported
            continue
        e = q.entry
        master = ours[f"model.{e.name}"] if f"optim.{e.name}.master" not in ours else ours[f"optim.{e.name}.master"]
        for field, t in (
            ("param", master),
            ("exp_avg", ours[f"optim.{e.name}.exp_avg"]),
            ("exp_avg_sq", ours[f"optim.{e.name}.exp_avg_sq"]),
        ):
            piece = split_tp(e, to_megatron(e.kind, t.float()), args.tensor_model_parallel_size)[tp]
            assert torch.equal(piece, theirs[field]), (name, field, float((piece - theirs[field]).abs().max()))
            compared += 1
    steps = [g.get("step") for g in inner.optimizer.param_groups] + [st.get("step") for st in inner.optimizer.state.values()]
    step = next((float(x) for x in steps if x is not None), None)  # param groups (Apex/TE, torch_dist) or torch's state
    assert step is None or step == float(meta["optimizer_step"]), (step, meta["optimizer_step"])
    total = torch.tensor(compared if parallel_state.get_data_parallel_rank() == 0 else 0)  # DP replicas compare the same
    torch.distributed.all_reduce(total)
    if torch.distributed.get_rank() == 0:
        print(
            f"check-import: megatron-core {MEGATRON_CORE_VERSION}'s load_checkpoint of {source} (TP {args.tensor_model_parallel_size} "
            f"PP {args.pipeline_model_parallel_size} DP {args.data_parallel_size}): {int(total)} masters and moments equal "
            f"tricorn's import {ckpt}, bit for bit; step "
            + (f"{step:g} equal" if step is not None else "not held by Megatron after this load")
        )


def _recorded_argv(source: Path) -> tuple[list[str], Path, int]:
    """The Megatron argv a fixture was made with, the directory its relative paths start from, and its world size."""
    for where in (source, source.parent):
        for name in ("megatron_flags.json", "run.json"):
            if (where / name).is_file():
                rec = json.loads((where / name).read_text())
                world = rec.get("world_size") or (CASES[where.name][0] if where.name in CASES else RESAVED[where.name][1])
                # a parity run's relative paths (corpus, tokenizer) name files of the directory above its case
                return [a for a in rec["argv"] if a], where.parent if name == "run.json" else where, int(world)
    raise SystemExit(f"{source}: no megatron_flags.json or run.json beside it: which Megatron flags made it?")


def _launch(name: str, out: Path, check: str = "", source: Path = Path()) -> None:
    import socket

    import torch.multiprocessing as mp

    world, flags = CASES[name] if name in CASES else RESAVED[name][1:]
    if name in RESAVED and not check:
        flags = flags + ["--ckpt-format", "torch_dist", "--load", str(source / RESAVED[name][0]), "--no-load-rng"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, name, COMMON + flags, str(out), port, check), nprocs=world, start_method="spawn")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("tests/fixtures/megatron_ckpt"))
    parser.add_argument("--cases", nargs="+", default=[*CASES, *RESAVED], choices=[*CASES, *RESAVED])
    parser.add_argument("--check-export", type=Path, help="a tricorn-exported Megatron checkpoint to load in megatron")
    parser.add_argument("--case", choices=list(CASES), help="with --check-export: the case whose model and logits to use")
    parser.add_argument(
        "--check-import", type=Path, metavar="IMPORTED", help="a tricorn import (import-megatron OUT) of --source to check"
    )
    parser.add_argument("--source", type=Path, help="with --check-import: the Megatron checkpoint (a fixture) it imported")
    args = parser.parse_args()
    import megatron.core

    assert megatron.core.__version__ == MEGATRON_CORE_VERSION, megatron.core.__version__
    if args.check_import:
        import socket

        import torch.multiprocessing as mp

        argv, workdir, world = _recorded_argv(args.source.resolve())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = (world, "", argv, str(workdir), port, str(args.source.resolve()), str(args.check_import.resolve()))
        mp.start_processes(_worker, args=spec, nprocs=world, start_method="spawn")
        return 0
    if args.check_export:
        _launch(args.case, args.output / args.case, str(args.check_export.resolve()))
        return 0
    for name in args.cases:
        final = args.output / name
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=args.output.parent if args.output.exists() else None))
        _launch(name, tmp, source=args.output.resolve())
        shutil.rmtree(final, ignore_errors=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp), final)
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        print(f"wrote {final} ({size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":  # the checkpoint saver spawns a multiprocessing Manager: importing must not run this
    sys.exit(main())
