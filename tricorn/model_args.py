"""Where a run's model flags come from besides the command line: a preset, or the checkpoint (--use-checkpoint-args).

    defaults <- preset <- YAML <- flags          (config_args.config_from_args)
    --use-checkpoint-args: the architecture fields (config.ARCHITECTURE_FIELDS) of the --load checkpoint's
    config.yaml replace the defaults; --seq-length, --rotary-angles-dtype and --moe-aux-loss-coeff too when not given

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

# Taken from the checkpoint only when the run does not set them: the run's length, a numerical choice, and the
# MoE load-balancing weight (import-hf records the release's router_aux_loss_coef).
_IF_NOT_GIVEN = ("seq_length", "rotary_angles_dtype", "moe_aux_loss_coeff")


def _flag(name: str) -> str:
    import dataclasses

    return flag_of(next(f for f in dataclasses.fields(ModelConfig) if f.name == name))


def _show(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# A preset's depth may change: a shallower copy of a published shape is how smoke tests and `tricorn simulate` size
# a run (its layers are the published ones). Width, heads, vocabulary and the rest would be another model.
PRESET_DEPTH = "num_layers"


def _given(name: str, value: Any) -> str:
    """How a value reads on the command line: `--qk-layernorm`, `--hidden-size 1024`."""
    if isinstance(value, bool):
        return _flag(name) if value else f"{_flag(name)} off"
    return f"{_flag(name)} {_show(value)}"


def _theirs(value: Any) -> str:
    return ("turns it on" if value else "leaves it off") if isinstance(value, bool) else f"sets {_show(value)}"


def preset_conflicts(preset: str, values: dict[str, Any], explicit: dict[str, Any]) -> list[str]:
    """One sentence per architecture field that the run sets (`explicit`: field -> value) against the preset's model:
    the preset's own values and what they imply (its head dim, its key/value heads, a feature it leaves off); a
    field the preset leaves unset (None: the tiny preset's vocabulary) is the run's to give."""
    import dataclasses

    model = ModelConfig(**values)
    given = {k: explicit[k] for k in ARCHITECTURE_FIELDS if k in explicit and k != PRESET_DEPTH}
    changed = dataclasses.replace(model, **given)
    out = []
    derived = {  # flags that decide one property together: compared by what they decide
        "head dim": (("kv_channels",), model.head_dim, changed.head_dim),
        "key/value heads": (("group_query_attention", "num_query_groups"), model.kv_heads, changed.kv_heads),
    }
    for what, (names, theirs, ours) in derived.items():
        if ours != theirs:
            flags = " ".join(_given(n, given[n]) for n in names if n in given)
            out.append(f"{flags} contradicts --model-preset {preset}, which has {what} {theirs}")
    skip = {n for names, _, _ in derived.values() for n in names}
    for name, value in given.items():
        if name not in skip and getattr(model, name) is not None and value != getattr(model, name):
            out.append(f"{_given(name, value)} contradicts --model-preset {preset}, which {_theirs(getattr(model, name))}")
    return [f"{line} (drop the flag, or drop the preset and give every model flag)" for line in out]


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


def apply_checkpoint_args(cfg: Config, explicit: dict[str, Any]) -> set[str]:
    """--use-checkpoint-args: the model of the --load checkpoint, refusing explicit values that contradict it; returns
    the fields it set (given, as far as Megatron's defaults for its command lines are concerned)."""
    if not cfg.checkpoint.load:
        raise ConfigError("--use-checkpoint-args needs --load (the checkpoint whose model flags to use)")
    path, saved = checkpoint_model(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    conflicts, taken = [], set()
    for name in ARCHITECTURE_FIELDS + _IF_NOT_GIVEN:
        if name not in saved:
            continue
        if name in explicit:
            if name in ARCHITECTURE_FIELDS and explicit[name] != saved[name]:
                conflicts.append(f"{_given(name, explicit[name])} contradicts the checkpoint's {_show(saved[name])}")
            continue
        setattr(cfg.model, name, saved[name])
        taken.add(name)
    if conflicts:
        raise ConfigError(
            f"--use-checkpoint-args takes the model from {path}: {'; '.join(conflicts)} (drop the flag, or drop "
            "--use-checkpoint-args)"
        )
    return taken
