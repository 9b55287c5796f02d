"""Safe reading of Megatron-LM's pickles: its common state, and its legacy `model_optim_rng.pt` / `distrib_optim.pt`.

Megatron pickles its saved arguments (an argparse.Namespace holding a few of its own enums), the
iteration, the scheduler and the optimizer's plain state next to tensors. Everything is read with
torch.load(weights_only=True), torch's restricted unpickler, widened by exactly this allow-list:
  - argparse.Namespace (its attributes are set as plain data, no constructor runs);
  - the Megatron enums named in MEGATRON_ENUMS (those of its args and of its rerun state machine's state,
    which a default save stores) and signal.Signals, each replaced by a stand-in that turns the pickled value
    into a string such as "AttnBackend.auto" or "RerunMode.VALIDATE_RESULTS" (megatron is never imported);
  - numpy's array reconstruction (the legacy format's RNG states), data only.
Plain containers, numbers, strings, torch dtypes and tensors are torch's own allow-list. Anything else
is refused with one line naming the class; nothing from the checkpoint is executed.
No collectives; memory: the file being read.
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, Union

import torch

from tricorn.checkpoint.interop.hf_mapping import ConvertError

# The Megatron enums a default megatron-core 0.19 save pickles (its args, and the rerun state machine's state in
# the common state), as value -> member name, copied from megatron-core 0.19.2's definitions. A value missing
# here reads as "Class(value)", so a newer member never fails a load.
_RERUN = "megatron.core.rerun_state_machine."
MEGATRON_ENUMS: dict[str, dict[Any, str]] = {
    "megatron.core.transformer.enums.AttnBackend": {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"},
    "megatron.core.transformer.enums.AttnMaskType": {
        1: "padding",
        2: "causal",
        3: "no_mask",
        4: "padding_causal",
        5: "arbitrary",
        6: "causal_bottom_right",
    },
    "megatron.core.transformer.enums.InferenceCudaGraphScope": {1: "none", 2: "layer", 3: "block"},
    "megatron.core.transformer.enums.CudaGraphScope": dict(
        enumerate(
            ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration_inference"), 1
        )
    ),
    "megatron.core.transformer.enums.LayerType": dict(enumerate(("embedding", "loss", "encoder", "decoder", "mtp"), 1)),
    "megatron.core.enums.ModelType": {1: "encoder_or_decoder", 2: "retro_encoder", 3: "retro_decoder"},
    "megatron.core.enums.Fp8Recipe": {v: v for v in ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")},
    "megatron.core.enums.Fp4Recipe": {v: v for v in ("nvfp4", "custom")},
    # The rerun state machine (--rerun-mode, validate_results by default): its mode and state in the common state,
    # its diagnostics in the per-rank rerun_state_machine_state object.
    _RERUN + "RerunMode": {v: v.upper() for v in ("disabled", "validate_results", "report_determinism_stats")},
    _RERUN + "RerunState": dict(
        enumerate(
            (
                "NOT_RUNNING_YET",
                "INITIAL_RUN",
                "RERUNNING_IN_PLACE",
                "WILL_RERUN_FROM_CHECKPOINT",
                "RERUNNING_FROM_CHECKPOINT",
                "RERUNNING_AGAIN_FROM_CHECKPOINT",
            )
        )
    ),
    _RERUN + "RerunDiagnostic": {v: v.upper() for v in ("correct_result", "transient_error", "persistent_error")},
    _RERUN + "RerunValidationStatus": {
        v: v.upper()
        for v in (
            "rerun_disabled",
            "initial_run",
            "first_rerun_not_reproducible",
            "first_rerun_reproducible",
            "second_rerun_not_reproducible",
            "second_rerun_reproducible",
        )
    },
    "signal.Signals": {},
}


class EnumName(str):
    """A pickled enum member as the string "Class.member" (or "Class(value)" for a value not in the table)."""

    def __reduce__(self):  # saved again, it is a plain string
        return (str, (str(self),))


def _enum_standin(path: str):
    cls = path.rsplit(".", 1)[1]
    names = MEGATRON_ENUMS[path]

    def build(value: Any = None, *_: Any) -> EnumName:
        if path == "signal.Signals":
            import signal

            try:
                return EnumName(f"Signals.{signal.Signals(value).name}")
            except ValueError:
                pass
        name = names.get(value) if isinstance(value, (int, str)) else None
        return EnumName(f"{cls}.{name}" if name else f"{cls}({value!r})")

    build.__name__ = build.__qualname__ = f"standin_{cls}"
    return build


def _allowed() -> list:
    allowed: list = [argparse.Namespace, (str, "builtins.str"), (str, "__builtin__.unicode")]  # str: EnumName saved again
    allowed += [(_enum_standin(path), path) for path in MEGATRON_ENUMS]
    try:
        import numpy as np

        core = np._core if hasattr(np, "_core") else np.core
        allowed += [core.multiarray._reconstruct, np.ndarray, np.dtype]
        allowed += [(core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]
        allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32", "uint8", "bool")]
    except ImportError:  # no numpy: a legacy file with numpy RNG states is then refused, naming the class
        pass
    return allowed


_UNSUPPORTED = re.compile(r"GLOBAL ([\w.]+) was not an allowed global|Unsupported global: GLOBAL ([\w.]+)")


def safe_load(source: Union[Path, bytes], what: str) -> Any:
    """torch.load(weights_only=True) with the allow-list above; ConvertError naming the refused class or damage."""
    stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = _UNSUPPORTED.search(str(e))
        if found:
            name = found.group(1) or found.group(2)
            raise ConvertError(
                f"{what} refers to {name}, which tricorn does not load (only plain data, argparse.Namespace "
                "and named Megatron enums are allowed; nothing from a checkpoint is executed)"
            ) from None
        raise ConvertError(f"{what} cannot be read safely ({str(e).splitlines()[0][:160]})") from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError) as e:
        raise ConvertError(f"{what} is damaged or not a torch file ({str(e).splitlines()[0][:160]})") from None


def namespace_dict(obj: Any, what: str) -> dict:
    """Megatron's saved args as a plain dict (a Namespace in every format it writes)."""
    if isinstance(obj, argparse.Namespace):
        return dict(vars(obj))
    if isinstance(obj, dict):
        return dict(obj)
    raise ConvertError(f"{what}: the saved 'args' are a {type(obj).__name__}, not Megatron's argparse.Namespace")
