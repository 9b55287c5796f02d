#!/usr/bin/env python
"""Pretrain a GPT/Llama model with Megatron-LM's flags: `torchrun --nproc-per-node N pretrain_gpt.py ...`."""

import sys

from tricorn.training.main import main

if __name__ == "__main__":
    sys.exit(main())
