"""tricorn: Megatron-style 3D-parallel GPT/Llama pretraining that runs and is tested on CPU.

The packages, from the leaf up (docs/architecture.md): config/presets, model, data, parallel, checkpoint,
training; planning is arithmetic over the config beside them; simulate.py and cli.py orchestrate.
"""

import os as _os
import warnings as _warnings

# `make test` sets TRICORN_STRICT_WARNINGS=1 in every process it starts, ranks included: a FutureWarning raised
# from tricorn's own code (a deprecated torch API it calls) is then an error, so deprecations are fixed when torch
# announces them rather than when it removes the API.
if _os.environ.get("TRICORN_STRICT_WARNINGS") == "1":
    _warnings.filterwarnings("error", category=FutureWarning, module=r"tricorn(\.|$)")
