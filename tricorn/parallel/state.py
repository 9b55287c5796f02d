"""The process grid: who talks to whom.

World ranks form a DeviceMesh of shape (pp, dp, cp, tp) with TP innermost, so
the ranks of one TP group are neighbours (one node, NVLink). From it come the
groups every other module receives explicitly (no module globals):

    tp_group     ranks that split each layer's matrices
    cp_group     ranks that split each sample's sequence
    dp_group     ranks that see different samples
    dp_cp_group  gradient reduction group (DP and CP both hold full replicas)
    pp_group     pipeline neighbours
    mp_group     TP x PP: every rank that holds a different part of one replica
    ep_group, expert_dp_group  with --expert-model-parallel-size EP: EP consecutive ranks of each
                 DP x CP group split the MoE experts; the DP x CP / EP ranks holding the same
                 experts reduce their gradients (Megatron's expert-DP)

Launch: torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or srun's SLURM_PROCID/
SLURM_NTASKS/SLURM_LOCALID with MASTER_ADDR from the first host of the node
list (an srun task ignores a RANK/WORLD_SIZE it inherited: launch_errors.srun_task). A single `python pretrain_gpt.py` becomes a world of one. Backend: gloo
on cpu, nccl on cuda. Building the mesh creates the groups (one collective per
group at start-up); no memory effect beyond the communicators.

Every group gets --distributed-timeout-minutes: torch's new_group() (and so
DeviceMesh) falls back to the backend default (10 min on NCCL, 30 on gloo), not
to the world group's timeout, so each group is created with it explicitly
(`group_options`, `flatten`); `group_timeout` reads it back for the tests.
"""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tricorn.config import Config
from tricorn.launch_errors import srun_task


@dataclass
class ParallelState:
    mesh: DeviceMesh
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup
    # First and last pipeline stage of this rank's pipeline (tied embedding copies); None without PP.
    embedding_group: Optional[dist.ProcessGroup] = None
    # Expert parallelism (expert.py): the ep ranks that split the experts, and the expert-DP ranks that hold the
    # same experts (DP x CP / EP of them), which reduce the experts' gradients. Both None without EP.
    ep_group: Optional[dist.ProcessGroup] = None
    expert_dp_group: Optional[dist.ProcessGroup] = None
    # Native FP8 (fp8.py): CP x TP of this stage, over which tensorwise amaxes are reduced; None without it.
    cp_tp_group: Optional[dist.ProcessGroup] = None
    # TP x DP x CP: every rank of this pipeline stage, over which whole-parameter amaxes are reduced (fp16 moments,
    # precision.py; FP8 primary weights, fp8_params.py); None without them.
    stage_group: Optional[dist.ProcessGroup] = None

    def size(self, dim: str) -> int:
        return self.mesh.size(self.mesh.mesh_dim_names.index(dim))

    def coord(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.coord("tp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def cp_size(self) -> int:
        return self.size("cp")

    @property
    def cp_rank(self) -> int:
        return self.coord("cp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def pp_global_rank(self, pp_rank: int) -> int:
        """World rank of the pipeline peer at `pp_rank` in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, pp_rank % self.pp_size)

    def replica_group(self, expert: bool) -> dist.ProcessGroup:
        """The ranks holding the same copy of a parameter, which reduce its gradient: the expert-DP group for a
        MoE expert under EP, DP x CP for everything else."""
        return self.expert_dp_group if expert and self.expert_dp_group is not None else self.dp_cp_group

    def grid_name(self) -> str:
        return f"pp{self.pp_rank}_dp{self.dp_rank}_cp{self.cp_rank}_tp{self.tp_rank}"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list, via scontrol when present, else by parsing 'node[01-04,07]'."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"([^\[,]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def launch_env() -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from torchrun, srun, or a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env and not srun_task(env):  # an srun task's identity is SLURM's alone
        return {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k in env}
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job = int(env.get("SLURM_JOB_ID", "0"))
        return {
            "RANK": env["SLURM_PROCID"],
            "WORLD_SIZE": env["SLURM_NTASKS"],
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_ADDR": env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
            "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + job % 20000),
        }
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_env() -> int:
    return int(launch_env()["WORLD_SIZE"])


def init_parallel(cfg: Config, init_method: Optional[str] = None) -> ParallelState:
    """Create the process group and the mesh. Call after the config is validated."""
    env = launch_env()
    os.environ.update(env)
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # Over-subscribed cores make CPU runs 2-4x slower; the user's OMP_NUM_THREADS wins.
        if world > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
    configure_tf32(cfg, device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cfg.device == "cuda" else "gloo",
            init_method=init_method or "env://",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
        )
    p = cfg.parallel
    shape = (p.pipeline_model_parallel_size, cfg.data_parallel_size, p.context_parallel_size, p.tensor_model_parallel_size)
    names = ("pp", "dp", "cp", "tp")
    override = {name: opts for name, size in zip(names, shape) if (opts := group_options(size)) is not None}
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names, backend_override=override)
    return ParallelState(
        embedding_group=_embedding_group(mesh, rank),
        mesh=mesh,
        device=device,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        tp_group=mesh.get_group("tp"),
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        cp_group=mesh.get_group("cp"),
        dp_cp_group=flatten(mesh, ("dp", "cp")),
        mp_group=flatten(mesh, ("pp", "tp")),
        **_expert_groups(mesh, rank, cfg.parallel.expert_model_parallel_size),
        cp_tp_group=flatten(mesh, ("cp", "tp")) if cfg.training.fp8_format and cfg.model.transformer_impl == "local" else None,
        stage_group=flatten(mesh, ("dp", "cp", "tp")) if _parameter_amaxes(cfg) else None,
    )


def _parameter_amaxes(cfg: Config) -> bool:
    """Whether the optimizer reduces amaxes of whole parameters: fp16 moments, or native FP8 primary weights."""
    t = cfg.training
    fp16_moments = t.use_precision_aware_optimizer and "fp16" in (t.exp_avg_dtype, t.exp_avg_sq_dtype)
    return fp16_moments or (t.fp8_param_gather and cfg.model.transformer_impl == "local")


def configure_tf32(cfg: Config, device: torch.device) -> bool:
    """TF32 tensor cores for fp32 matmuls and cuDNN convolutions on CUDA, unless --no-tf32; returns whether on.

    torch leaves matmuls at IEEE fp32 by default (8x slower than TF32 on an H100), so an fp32 run would be
    measured against a TF32 peak it never uses. bf16/fp16 runs keep torch's defaults: their few fp32 matmuls
    (router, logits) are fp32 on purpose. `allow_tf32` is the flag pair torch 2.13 still honours without a
    warning (it maps onto the newer `fp32_precision` settings); on CPU nothing changes (no TF32 there)."""
    if device.type != "cuda" or cfg.param_dtype_name != "fp32":
        return False
    torch.backends.cuda.matmul.allow_tf32 = cfg.training.tf32
    torch.backends.cudnn.allow_tf32 = cfg.training.tf32
    return cfg.training.tf32


def world_timeout() -> Optional[timedelta]:
    """The world group's timeout: --distributed-timeout-minutes, which init_parallel gave it (None under the fake
    backend of `tricorn simulate`, which waits on nothing)."""
    return group_timeout(dist.group.WORLD)


def group_timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    """A group's collective timeout, as its backend holds it. torch 2.13 exposes no public getter; both
    ProcessGroupGloo and ProcessGroupNCCL keep it in `.options._timeout` (the field distributed_c10d's
    _new_process_group_helper sets from new_group's timeout), reached through ProcessGroup._get_backend."""
    device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
    options = group._get_backend(device).options
    return None if options is None else options._timeout  # the fake backend (tricorn simulate) has no options


def group_options(size: int) -> Optional[C10dBackend.Options]:
    """Backend options carrying the world's timeout for a DeviceMesh dimension (or flattened dimensions) of
    `size` ranks; None where DeviceMesh reuses the world group itself, which already has it.

    DeviceMesh._init_one_process_group (torch 2.13) passes `pg_options._timeout` on to new_group/split_group
    and otherwise lets them use the backend default. It reuses the world group for a dimension spanning every
    rank only without an override, and only when it does not build a fresh group there (a gloo world on a
    machine with CUDA); skipping the override in that case keeps one communicator instead of two."""
    timeout = world_timeout()
    backend = dist.get_backend()
    if timeout is None or (size == dist.get_world_size() and not (backend == "gloo" and torch.cuda.is_available())):
        return None
    if backend == "nccl":
        # new_group asserts NCCL options are ProcessGroupNCCL.Options; normal priority as its own default.
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
    else:
        opts = C10dBackend.Options(backend)
    opts._timeout = timeout
    return opts


def flatten(mesh: DeviceMesh, dims: tuple[str, ...]) -> dist.ProcessGroup:
    """The group of `dims` of `mesh` flattened into one dimension, with the world's timeout. A collective."""
    size = 1
    for dim in dims:
        size *= mesh.size(mesh.mesh_dim_names.index(dim))
    return mesh[dims]._flatten("_".join(dims), backend_override=group_options(size)).get_group()


def expert_rank_grid(mesh: DeviceMesh, ep: int) -> torch.Tensor:
    """World ranks as [pp x tp, expert-DP, ep]: each DP x CP replica set (cp fastest) cut into runs of ep."""
    return mesh.mesh.permute(0, 3, 1, 2).reshape(-1, mesh.mesh.shape[1] * mesh.mesh.shape[2] // ep, ep)


def _expert_groups(mesh: DeviceMesh, rank: int, ep: int) -> dict[str, dist.ProcessGroup]:
    """ep and expert-DP groups: each DP x CP group (cp fastest) cut into runs of `ep` consecutive ranks; every rank
    creates every group, in the same order (Megatron's convention: expert-DP = DP x CP / EP)."""
    if ep == 1:
        return {}
    out: dict[str, dist.ProcessGroup] = {}
    for cut in expert_rank_grid(mesh, ep):  # [expert-DP, ep] per (pp, tp)
        for kind, groups in (("ep_group", cut.tolist()), ("expert_dp_group", cut.t().tolist())):
            for members in groups:
                group = dist.new_group(members, timeout=world_timeout())
                if rank in members:
                    out[kind] = group
    return out


def _embedding_group(mesh: DeviceMesh, rank: int) -> Optional[dist.ProcessGroup]:
    """Groups of {first, last} pipeline stage per pipeline; every rank creates all of them, in order."""
    ranks = mesh.mesh  # [pp, dp, cp, tp] world ranks
    if ranks.shape[0] == 1:
        return None
    mine = None
    for pipeline in ranks.flatten(1).t().tolist():
        group = dist.new_group([pipeline[0], pipeline[-1]], timeout=world_timeout())
        if rank in (pipeline[0], pipeline[-1]):
            mine = group
    return mine


def destroy_parallel(clean_exit: bool = False) -> None:
    """Tear down the groups, in order, while the interpreter is fully alive.

    After a clean run every rank first meets at a barrier (gloo can abort a rank whose peer is still
    finishing its last collective); after an error nobody waits, so the failing rank exits at once and
    its peers see closed connections instead of hanging. Then every group is destroyed and the garbage
    collector runs: objects in reference cycles (model hooks, buckets) hold ProcessGroup handles, and a
    gloo group whose last handle is dropped during interpreter finalization can destroy its worker
    threads, or release tensors, when no thread may take the GIL any more - the process then dies with
    "terminate called without an active exception" after a finished run. Callers drop their own
    references first (main() keeps the trainer inside a function that has returned)."""
    if dist.is_initialized():
        if clean_exit:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
