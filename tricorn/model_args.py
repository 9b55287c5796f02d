"""Where a run's model flags come from besides the command line: a preset, or the checkpoint (--use-checkpoint-args).

    defaults <- preset <- YAML <- flags          (config_args.config_from_args)
    --use-checkpoint-args: the architecture fields (config.ARCHITECTURE_FIELDS) of the --load checkpoint's
    config.yaml replace the defaults; --seq-length and --rotary-angles-dtype too when not given

A preset names a published model and the checkpoint is the model being trained, so a flag or YAML value that
contradicts either on an architecture field is refused with one line naming both values, never silently
overridden (Megatron's --use-checkpoint-args overrides most flags without a word). Values equal to theirs are
fine, and so is a preset's --num-layers (PRESET_DEPTH). Reads one YAML file; no collectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tricorn.config import ARCHITECTURE_FIELDS, Config, ConfigError, ModelConfig
from tricorn.fields import flag_of

# Taken from the checkpoint only when the run does not set them: the run's length and a numerical choice.
_IF_NOT_GIVEN = ("seq_length", "rotary_angles_dtype")


def _flag(name: str) -> str:
    import dataclasses

    return flag_of(next(f for f in dataclasses.fields(ModelConfig) if f.name == name))


def _show(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# A preset's depth may change: a shallower copy of a published shape is how smoke tests and `tricorn simulate` size
# a run (its layers are the published ones). Width, heads, vocabulary and the rest would be another model.
PRESET_DEPTH = "num_layers"


def preset_conflicts(preset: str, values: dict[str, Any], explicit: dict[str, Any]) -> list[str]:
    """One sentence per architecture field that the run sets (`explicit`: field -> value) against the preset's."""
    return [
        f"{_flag(k)} {_show(explicit[k])} contradicts --model-preset {preset}, which sets {_show(values[k])} "
        "(drop the flag, or drop the preset and give every model flag)"
        for k in ARCHITECTURE_FIELDS
        if k != PRESET_DEPTH and k in values and k in explicit and explicit[k] != values[k]
    ]


def checkpoint_model(load: str, ckpt_step: Any) -> tuple[Path, dict]:
    """(checkpoint directory, its config.yaml's model section) of --load, for --use-checkpoint-args."""
    import yaml

    from tricorn.checkpoint import io

    try:
        path, _ = io.find_checkpoint(Path(load), ckpt_step)
    except io.CheckpointError as e:
        raise ConfigError(f"--use-checkpoint-args: {e}") from None
    if path is None:
        raise ConfigError(f"--use-checkpoint-args: --load {load} holds no checkpoint to take the model flags from")
    try:
        saved = (yaml.safe_load((path / io.CONFIG_FILE).read_text()) or {}).get("model") or {}
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"--use-checkpoint-args: {path / io.CONFIG_FILE} cannot be read ({e})") from None
    return path, saved


def apply_checkpoint_args(cfg: Config, explicit: dict[str, Any]) -> None:
    """--use-checkpoint-args: the model of the --load checkpoint, refusing explicit values that contradict it."""
    if not cfg.checkpoint.load:
        raise ConfigError("--use-checkpoint-args needs --load (the checkpoint whose model flags to use)")
    path, saved = checkpoint_model(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    conflicts = []
    for name in ARCHITECTURE_FIELDS + _IF_NOT_GIVEN:
        if name not in saved:
            continue
        if name in explicit:
            if name in ARCHITECTURE_FIELDS and explicit[name] != saved[name]:
                conflicts.append(f"{_flag(name)} {_show(explicit[name])} contradicts the checkpoint's {_show(saved[name])}")
            continue
        setattr(cfg.model, name, saved[name])
    if conflicts:
        raise ConfigError(
            f"--use-checkpoint-args takes the model from {path}: {'; '.join(conflicts)} (drop the flag, or drop "
            "--use-checkpoint-args)"
        )
