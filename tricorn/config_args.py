"""The command line and YAML files -> a Config: parser generated from the dataclasses of tricorn/config.py.

Defaults <- preset <- YAML (``--config``) <- flags. Errors are ConfigError, one sentence each; no
collectives, no device work.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
from typing import Optional

from tricorn.config import SECTIONS, Config, ConfigError, ModelConfig, field_errors
from tricorn.fields import field_kind, flag_of, yaml_type_error
from tricorn.flag_parser import tricorn_parser
from tricorn.megatron_flags import PREFIX as MEGATRON
from tricorn.megatron_flags import add_megatron_options, check_command_line, megatron_defaults, megatron_notice, run_context
from tricorn.presets import PRESETS


def _flag_names() -> dict[str, tuple[str, str]]:
    """flag dest -> (section, field name)."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f.name)
    return out


def build_parser(prog: str = "pretrain_gpt.py", megatron: bool = True) -> argparse.ArgumentParser:
    """The command line, generated from the dataclasses (tricorn/flag_parser.py); with `megatron`, also every
    other flag of Megatron-LM's parser, hidden (tricorn/megatron_flags.py)."""
    parser = tricorn_parser(prog)
    if megatron:
        add_megatron_options(parser)
    return parser


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser, built once (its ~700 hidden Megatron options take a while; parsing mutates nothing)."""
    return build_parser()


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _apply_yaml(cfg: Config, path: str) -> set[str]:
    """Apply a --config file; returns the field names it set."""
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    top_keys = list(SECTIONS) + ["device", "model_preset"]
    errors: list[str] = []
    given: set[str] = set()
    for key, value in data.items():
        if key in ("device", "model_preset"):
            if value is not None and not isinstance(value, str):
                errors.append(f"'{key}' in {path} must be a string, got {value!r}")
            elif key == "device" and value not in (None, "cpu", "cuda"):
                errors.append(f"'device' in {path} must be cpu or cuda, got {value!r}")
            else:
                setattr(cfg, key, value)
            continue
        if key not in SECTIONS:
            raise ConfigError(f"unknown section '{key}' in {path}{_suggest(key, top_keys)}")
        if not isinstance(value, dict):
            raise ConfigError(f"section '{key}' in {path} must be a mapping")
        section = getattr(cfg, key)
        fields = {f.name: f for f in dataclasses.fields(section)}
        for k, v in value.items():
            k2 = str(k).replace("-", "_")
            if k2 not in fields:
                raise ConfigError(f"unknown key '{key}.{k}' in {path}{_suggest(k2, list(fields))}")
            problem = yaml_type_error(fields[k2], v)
            if problem:
                errors.append(f"'{key}.{k}' in {path} (the value of {flag_of(fields[k2])}) {problem}")
            else:
                is_float = v is not None and field_kind(fields[k2])[0] == "float"  # None: an unset Optional
                setattr(section, k2, float(v) if is_float else v)
                given.add(k2)
    if errors:
        raise ConfigError("; also: ".join(errors))
    return given


def config_from_args(argv: Optional[list[str]] = None, world_size: Optional[int] = None) -> Config:
    """Defaults <- preset <- YAML <- flags. Raises ConfigError; does not validate."""
    args = vars(_parser().parse_args(argv))  # ConfigError on a malformed flag
    megatron_only = {k.removeprefix(MEGATRON): args.pop(k) for k in list(args) if k.startswith(MEGATRON)}
    cfg = Config()
    given = set(args)  # the fields set by a flag, the YAML or the preset (not defaults)
    with_yaml = "config" in args
    if with_yaml:
        given |= _apply_yaml(cfg, args.pop("config"))
    preset = args.pop("model_preset", None) or cfg.model_preset
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(
                f"unknown --model-preset '{preset}'{_suggest(preset, list(PRESETS))}; choose one of {', '.join(PRESETS)}"
            )
        cfg.model_preset = preset
        # Preset first, then anything the YAML or the flags set explicitly on top.
        yaml_model = dataclasses.asdict(cfg.model)
        defaults = dataclasses.asdict(ModelConfig())
        for k, v in PRESETS[preset].items():
            if yaml_model[k] == defaults[k]:
                setattr(cfg.model, k, v)
        given |= set(PRESETS[preset])
    cfg.device = args.pop("device", None) or cfg.device or default_device()
    if "dry_run" in args:
        cfg.dry_run = args.pop("dry_run")
    names = _flag_names()
    for dest, value in args.items():
        section, name = names[dest]
        setattr(getattr(cfg, section), name, value)
    cfg.world_size = (
        world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    )
    applied = megatron_defaults(cfg, given) if megatron_only and not with_yaml else {}
    errors = field_errors(cfg)
    if cfg.training.train_samples is not None and "train_iters" in given:
        errors.append(
            "--train-samples and --train-iters are exclusive (Megatron's sample-based training sets the iterations); give one"
        )
    if errors:  # before the derived values: they divide by the parallel sizes
        raise ConfigError("; also: ".join(errors))
    _resolve_defaults(cfg)
    noops, refusals = check_command_line(megatron_only, run_context(cfg))
    if refusals:
        raise ConfigError(f"Megatron flags tricorn does not implement: {'; '.join(refusals)}")
    cfg.megatron_notice = megatron_notice(noops, applied)
    return cfg


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_defaults(cfg: Config) -> None:
    t = cfg.training
    if t.global_batch_size is None and cfg.data_parallel_size > 0:
        t.global_batch_size = t.micro_batch_size * cfg.data_parallel_size
    if t.train_samples is not None and t.global_batch_size:
        # Megatron's update_train_iters: samples / the (final) global batch, the ramp-up left out as Megatron 0.19 does.
        t.train_iters = max(1, t.train_samples // t.global_batch_size)
    elif t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
