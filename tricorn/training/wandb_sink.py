"""Weights & Biases: rank 0 logs what TensorBoard gets, under the same names at the same iterations.

``--wandb-project`` (Megatron's flags: ``--wandb-exp-name``, ``--wandb-save-dir``, ``--wandb-entity``). Every
scalar MetricsLogger writes to TensorBoard at an iteration goes to ``run.log(values, step=iteration)`` with the
same tag; TensorBoard's "<tag> vs tokens" copies (a second x axis, which a W&B step cannot be) become one
``consumed-tokens`` value per log line, to plot against. The resolved config is the run's config.

The run id is chosen before the run starts and saved in every checkpoint's meta.json (checkpointer.py), so a
resume (``--load``, a requeued job) continues the same run: ``wandb.init(id=..., resume="allow")``. Offline runs
(``WANDB_MODE=offline``) keep the id too, and ``wandb sync`` of their directories appends to one run. W&B drops
steps at or below one it already has: after a resume from an older checkpoint, the iterations between it and
the last logged one are not logged again.

``wandb`` is an optional extra (``pip install 'tricorn[wandb]'``), imported only by ``start``. Before launch
(``wandb_errors``) a missing package or a missing login (no WANDB_API_KEY, no .netrc entry for the W&B host,
not offline) is one line. No collectives; only rank 0 has a sink.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import secrets
import string
from typing import Any, Optional
from urllib.parse import urlsplit

_ID_CHARS = string.ascii_lowercase + string.digits  # W&B's own run ids: 8 of these
_NO_LOGIN_MODES = ("offline", "disabled", "dryrun")


def wandb_errors(cfg, env=os.environ) -> list[str]:
    """Why --wandb-project cannot work here (no package, no login), one sentence, before anything starts."""
    if not cfg.logging.wandb_project:
        return [f"{flag} needs --wandb-project" for flag, v in _other_flags(cfg) if v is not None]
    if importlib.util.find_spec("wandb") is None:
        return ["--wandb-project needs the wandb package: pip install 'tricorn[wandb]' (or pip install wandb)"]
    if env.get("WANDB_MODE", "").lower() in _NO_LOGIN_MODES or env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return []
    host = urlsplit(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    if _netrc_has(host, env):
        return []
    return [
        f"--wandb-project: no W&B login on this machine (no WANDB_API_KEY, no {host} entry in ~/.netrc): run "
        "`wandb login` or set WANDB_API_KEY, or log offline with WANDB_MODE=offline and `wandb sync` the run later"
    ]


def _other_flags(cfg) -> list[tuple[str, Any]]:
    lg = cfg.logging
    return [("--wandb-exp-name", lg.wandb_exp_name), ("--wandb-save-dir", lg.wandb_save_dir), ("--wandb-entity", lg.wandb_entity)]


def _netrc_has(host: str, env) -> bool:
    """An entry for the W&B host in the netrc file wandb reads ($NETRC, else ~/.netrc, else ~/_netrc)."""
    paths = [env["NETRC"]] if env.get("NETRC") else [os.path.expanduser("~/.netrc"), os.path.expanduser("~/_netrc")]
    for path in paths:
        try:
            if netrc.netrc(path).authenticators(host):
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def save_dir(cfg) -> str:
    """--wandb-save-dir, else <--save>/wandb (Megatron's default), else ./wandb."""
    lg = cfg.logging
    return lg.wandb_save_dir or (os.path.join(cfg.checkpoint.save, "wandb") if cfg.checkpoint.save else "wandb")


class WandbSink:
    """Rank 0's W&B run: ``start`` once the checkpoint is loaded (its run id), then ``log`` what TensorBoard gets."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.run: Any = None
        self.run_id: Optional[str] = None

    def start(self, resume_id: Optional[str]) -> None:
        import wandb
        import yaml

        from tricorn.config import dump_yaml

        lg = self.cfg.logging
        self.run_id = resume_id or "".join(secrets.choice(_ID_CHARS) for _ in range(8))
        directory = save_dir(self.cfg)
        os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=lg.wandb_project,
            entity=lg.wandb_entity,
            name=lg.wandb_exp_name,
            dir=directory,
            config=yaml.safe_load(dump_yaml(self.cfg)),  # the resolved config, as config.yaml holds it
            id=self.run_id,
            resume="allow",
        )

    def log(self, iteration: int, values: dict[str, float], tokens: Optional[int]) -> None:
        if self.run is not None:
            self.run.log({**values, **({"consumed-tokens": tokens} if tokens is not None else {})}, step=iteration)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
