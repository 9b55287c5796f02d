"""Decoder math only: no process groups, no collectives (see transformer.py)."""

from tricorn.model.spec import LayerSpec, local_spec
from tricorn.model.transformer import GPTModel

__all__ = ["GPTModel", "LayerSpec", "local_spec"]
