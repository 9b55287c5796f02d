"""Write tests/fixtures/hf5/: one tiny random model per Hugging Face family, saved by transformers 5, with its logits.

transformers 5 cannot be installed beside the dev extra's transformers 4.57, so these are made in a scratch
virtual environment and committed; tests/test_hf_families.py reads them without transformers 5:

    python3 -m venv /tmp/tf5 && /tmp/tf5/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors
    /tmp/tf5/bin/python scripts/make_hf_fixtures.py --output tests/fixtures/hf5

Each family's directory holds what `save_pretrained` wrote (config.json in transformers 5's layout, with
`rope_parameters` instead of a top-level `rope_theta`; model.safetensors in fp32) and `reference.npz`: fixed
token ids and transformers 5's fp32 logits for them. Norm weights and biases are drawn at random (transformers
initialises them to 1 and 0, which would hide a norm or a bias mapped to the wrong place).

`--check-export DIR --family NAME` goes the other way: it loads a directory `tricorn export-hf` wrote with
transformers 5's `from_pretrained` and asserts its logits equal the family's reference (docs/interop.md):

    tricorn import-hf --input tests/fixtures/hf5/qwen3 --save /tmp/q3 && tricorn export-hf --load /tmp/q3 --output /tmp/q3-hf
    /tmp/tf5/bin/python scripts/make_hf_fixtures.py --check-export /tmp/q3-hf --family qwen3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

VOCAB, SEQ = 64, 24
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
# family -> (config class, model class, config keywords beyond COMMON). Between them: tied and untied heads,
# llama3 RoPE scaling, a head dim that is not hidden / heads, a sliding window that never limits (Mistral's
# default 4096 at 64 positions), both MoE layouts.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )),
}  # fmt: skip


def tokens() -> np.ndarray:
    return np.random.default_rng(7).integers(0, VOCAB, size=(2, SEQ)).astype(np.int64)


def build(family: str):
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights around 1, biases around 0
                p.copy_(torch.randn(p.shape) * 0.2 + (0.0 if name.endswith("bias") else 1.0))
    return model


def logits(model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def write(family: str, out: Path) -> None:
    import torch
    import transformers

    model = build(family)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    ids = tokens()
    np.savez(tmp / "reference.npz", tokens=ids, logits=logits(model, ids))
    (tmp / "made_by.json").write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1024:.0f} KB)")


def check_export(family: str, exported: Path, fixtures: Path) -> None:
    import transformers

    model_name = FAMILIES[family][1]
    model = getattr(transformers, model_name).from_pretrained(exported).float().eval()
    ref = np.load(fixtures / family / "reference.npz")
    got = logits(model, ref["tokens"])
    err = float(np.abs(got - ref["logits"]).max())
    scale = float(np.abs(ref["logits"]).max())
    print(f"{family}: transformers {transformers.__version__} loaded {exported} as {model_name}; max |logits diff| {err:.3g}")
    assert err <= 1e-5 * scale, (err, scale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("tests/fixtures/hf5"))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--check-export", type=Path, help="a directory tricorn export-hf wrote, to load in transformers")
    parser.add_argument("--family", choices=list(FAMILIES), help="with --check-export: whose reference logits to compare")
    args = parser.parse_args()
    import transformers

    assert transformers.__version__.startswith("5."), f"run with transformers 5, not {transformers.__version__}"
    if args.check_export:
        check_export(args.family, args.check_export, args.output)
        return 0
    args.output.mkdir(parents=True, exist_ok=True)
    for family in args.families:
        write(family, args.output / family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
