"""Where a run's model flags come from besides the command line: a preset, or the checkpoint (--use-checkpoint-args).

    defaults <- preset <- YAML <- flags          (config_args.config_from_args)
    --use-checkpoint-args: the architecture fields (config.ARCHITECTURE_FIELDS) of the --load checkpoint's
    config.yaml replace the defaults; --seq-length, --rotary-angles-dtype and --moe-aux-loss-coeff too when not given;
    the vocabulary only with --mock-data (with a tokenizer, prepare_vocab takes the checkpoint's and checks it)

A preset names a published model and the checkpoint is the model being trained, so a flag or YAML value that
contradicts either on an architecture field is refused with one line naming both values, never silently
overridden (Megatron's --use-checkpoint-args overrides most flags without a word). Values equal to theirs are
fine, and so is a preset's --num-layers (PRESET_DEPTH). Reads one YAML file; no collectives.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tricorn.config import ARCHITECTURE_FIELDS, Config, ConfigError, ModelConfig
from tricorn.fields import flag_of

# Taken from the checkpoint only when the run does not set them: the run's length, a numerical choice, and the
# MoE load-balancing weight (import-hf records the release's router_aux_loss_coef).
_IF_NOT_GIVEN = ("seq_length", "rotary_angles_dtype", "moe_aux_loss_coeff")


def _flag(name: str) -> str:
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


# Fields that decide one property together are compared by what they decide (None: derived from the others).
_DERIVED = {
    "head dim": (("kv_channels",), "head_dim"),
    "key/value heads": (("group_query_attention", "num_query_groups"), "kv_heads"),
    "MLP width": (("ffn_hidden_size",), "ffn_size"),
    "expert MLP width": (("moe_ffn_hidden_size",), "moe_ffn_size"),
}


def conflicts(model: ModelConfig, given: dict[str, Any], unset_is_free: bool) -> list[str]:
    """`flags contradicts ..., which ...` without the subject's name, for each architecture field in `given` (field ->
    value) that changes `model`. unset_is_free: a field `model` leaves None is the run's to give (a preset's)."""
    given = {k: v for k, v in given.items() if k in ARCHITECTURE_FIELDS}
    changed = dataclasses.replace(model, **given)
    out = []
    for what, (names, prop) in _DERIVED.items():
        if any(n in given for n in names) and getattr(changed, prop) != getattr(model, prop):
            flags = " ".join(_given(n, given[n]) for n in names if n in given)
            out.append(f"{flags} contradicts {{}}, which has {what} {getattr(model, prop)}")
    derived = {n for names, _ in _DERIVED.values() for n in names}
    for name, value in given.items():
        theirs = getattr(model, name)
        if name in derived or (theirs is None and unset_is_free) or value == theirs:
            continue
        out.append(f"{_given(name, value)} contradicts {{}}, which {_theirs(theirs)}")
    return out


def preset_conflicts(preset: str, values: dict[str, Any], explicit: dict[str, Any]) -> list[str]:
    """One sentence per architecture field that the run sets (`explicit`: field -> value) against the preset's model:
    the preset's own values and what they imply (its head dim, its key/value heads, a feature it leaves off); a
    field the preset leaves unset (None: the tiny preset's vocabulary) is the run's to give, and so is its depth."""
    given = {k: v for k, v in explicit.items() if k != PRESET_DEPTH}
    return [
        line.format(f"--model-preset {preset}") + " (drop the flag, or drop the preset and give every model flag)"
        for line in conflicts(ModelConfig(**values), given, unset_is_free=True)
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


def apply_checkpoint_args(cfg: Config, explicit: dict[str, Any]) -> set[str]:
    """--use-checkpoint-args: the model of the --load checkpoint, refusing explicit values that contradict it; returns
    the fields it set (given, as far as Megatron's defaults for its command lines are concerned)."""
    if not cfg.checkpoint.load:
        raise ConfigError("--use-checkpoint-args needs --load (the checkpoint whose model flags to use)")
    path, saved = checkpoint_model(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    found = conflicts(ModelConfig(**{k: v for k, v in saved.items() if k in known}), explicit, unset_is_free=False)
    if found:
        lines = "; ".join(line.format("the checkpoint") for line in found)
        raise ConfigError(
            f"--use-checkpoint-args takes the model from {path}: {lines} (drop the flag, or drop --use-checkpoint-args)"
        )
    taken = {name for name in ARCHITECTURE_FIELDS + _IF_NOT_GIVEN if name in saved and name not in explicit}
    if not cfg.data.mock_data:  # the vocabulary: the tokenizer's, checked against the checkpoint's (data/loader.py)
        taken.discard("vocab_size")
    for name in taken:
        setattr(cfg.model, name, saved[name])
    return taken
