"""Write tests/fixtures/megatron_documents.npz: megatron-core's samples with --reset-position-ids,
--reset-attention-mask and --eod-mask-loss, for tests/test_documents.py.

Run in megatron-core's own environment (see scripts/make_megatron_fixtures.py for how it is made):

    /tmp/mcore/bin/python scripts/make_megatron_document_fixtures.py --output tests/fixtures/megatron_documents.npz

Each case is a synthetic corpus whose documents end with the end-of-document token (what `tricorn preprocess`
and Megatron's preprocess_data.py --append-eod write), with pad ids and empty documents among them, read
through megatron-core's BlendedMegatronDatasetBuilder and GPTDataset with the three flags (each alone, and all
together) and ``create_attention_mask=True``. Stored for every sample of the train split: tokens, labels,
loss_mask, position_ids, and the document boundaries: for each query row, the first key its attention mask
allows (the script asserts the mask is exactly causal within those bounds, so that one number per row says it
all). Only numpy and megatron-core are imported; the test rebuilds the corpora with the same recipe.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from types import SimpleNamespace

import numpy as np
from make_megatron_fixtures import MEGATRON_CORE_VERSION, require_megatron_core, write_npz

VOCAB = 1000
PAD_ID = 5
EOD_ID = VOCAB - 1
# (documents, longest document, seed, seq_length, split, flags): reset_position_ids, reset_attention_mask, eod_mask_loss
CASES = [
    (40, 20, 1, 16, "9,1,0", (True, True, True)),
    (40, 20, 1, 16, "9,1,0", (True, False, False)),
    (40, 20, 1, 16, "9,1,0", (False, True, False)),
    (40, 20, 1, 16, "9,1,0", (False, False, True)),
    (25, 70, 7, 32, "1", (True, True, True)),  # documents longer than a sample
    (60, 6, 3, 24, "1", (True, True, True)),  # many short documents per sample, back-to-back eods
]


def token_at(sequence: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Document tokens below EOD_ID (the end of document is appended); PAD_ID occurs (position 3 of every 7th)."""
    tokens = (sequence * 31 + position * 7 + (position * position) % 13) % (VOCAB - 1)
    return np.where((sequence % 7 == 0) & (position == 3), PAD_ID, tokens)


def corpus_lengths(num_documents: int, max_length: int, seed: int) -> np.ndarray:
    """Text lengths (the eod comes on top); some documents are empty and hold only their eod."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length + 1, size=num_documents)
    lengths[rng.random(num_documents) < 0.15] = 0
    return lengths.astype(np.int32)


def document(s: int, n: int) -> np.ndarray:
    return np.concatenate([token_at(np.full(n, s), np.arange(n)), [EOD_ID]]).astype(np.uint16)


def write_corpus(prefix: str, lengths: np.ndarray) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for s, n in enumerate(lengths.tolist()):
        builder.add_document(document(s, n), [n + 1])
    builder.finalize(prefix + ".idx")


def first_allowed_keys(mask: np.ndarray) -> np.ndarray:
    """Megatron's boolean mask (True: masked out) [s, s] -> the first key each row may see; asserts the rest."""
    s = mask.shape[0]
    allowed = ~mask
    first = allowed.argmax(axis=1)
    rows, cols = np.arange(s)[:, None], np.arange(s)[None, :]
    assert np.array_equal(allowed, (cols >= first[:, None]) & (cols <= rows)), "not a block-diagonal causal mask"
    return first.astype(np.int64)


def run_case(index: int, case: tuple, workdir: str) -> dict[str, np.ndarray]:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    num_documents, max_length, seed, seq, split, (reset_positions, reset_mask, eod_loss) = case
    lengths = corpus_lengths(num_documents, max_length, seed)
    prefix = os.path.join(workdir, f"case{index}")
    write_corpus(prefix, lengths)
    tokenizer = SimpleNamespace(pad=PAD_ID, eod=EOD_ID, vocab_size=VOCAB, unique_identifiers={"pad": PAD_ID})
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq,
        tokenizer=tokenizer,
        reset_position_ids=reset_positions,
        reset_attention_mask=reset_mask,
        eod_mask_loss=eod_loss,
        create_attention_mask=True,
        blend=([prefix], None),
        split=split,
        path_to_cache=os.path.join(workdir, f"cache{index}"),
    )
    train = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()[0]
    out: dict[str, np.ndarray] = {
        "lengths": lengths,
        "seq": np.array(seq),
        "seed": np.array(seed),
        "split": np.array(split),
        "flags": np.array([reset_positions, reset_mask, eod_loss]),
    }
    samples = [train[i] for i in range(len(train))]
    for field in ("tokens", "labels", "loss_mask", "position_ids"):
        out[field] = np.stack([sample[field].numpy() for sample in samples])
    out["first_key"] = np.stack([first_allowed_keys(sample["attention_mask"][0].numpy()) for sample in samples])
    return out


def main() -> None:
    require_megatron_core()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="tests/fixtures/megatron_documents.npz")
    args = parser.parse_args()
    arrays: dict[str, np.ndarray] = {"megatron_core_version": np.array(MEGATRON_CORE_VERSION), "num_cases": np.array(len(CASES))}
    with tempfile.TemporaryDirectory() as workdir:
        for i, case in enumerate(CASES):
            for key, value in run_case(i, case, workdir).items():
                arrays[f"case{i}/{key}"] = value
    write_npz(args.output, arrays)
    print(f"wrote {args.output}: {len(CASES)} cases, {os.path.getsize(args.output) / 1024:.0f} KB")


if __name__ == "__main__":
    main()
