"""Checkpoints: sharded save and load in global coordinates, and the formats of other tools.

    checkpointer.py   Checkpointer: save (sync or --async-save), resume on any layout, the exit hook
    pieces.py         the global rectangles each rank owns and writes (streaming, no gathers)
    io.py             the directory format: names, meta, RNG files, retention, verification, errors
    checksums.py      per-file checksums written with a save and checked before a load
    staging.py        --async-save's host staging buffers
    interop/          other formats: Hugging Face (hf.py, hf_config.py, hf_mapping.py), Megatron-LM (megatron*.py)

Imports point down: training/ imports this package, never the reverse; planning/ never imports it.
"""
