"""Write tests/fixtures/megatron_gpt.npz: megatron-core's own GPT/blend indices and samples for a grid of corpora.

megatron-core needs a GPU software stack and is not a test dependency, so its
answers are computed once here and committed; tests/test_data_megatron.py
compares tricorn against them without importing megatron. Run it in a
separate environment (megatron-core 0.19.2 ships wheels for Python 3.12):

    python3.12 -m venv /tmp/mcore
    /tmp/mcore/bin/pip install torch==2.13.0 numpy megatron-core==0.19.2
    /tmp/mcore/bin/python scripts/make_megatron_fixtures.py --output tests/fixtures/megatron_gpt.npz \
        --checkpoints tests/fixtures/megatron_ckpt

(--checkpoints runs scripts/make_megatron_checkpoints.py, which also needs `pip install psutil`: tiny
Megatron-LM checkpoints with megatron's logits, for tests/test_megatron_checkpoint.py.)

Each case is a few synthetic corpora (sequence lengths drawn from a seed,
some of them 0; token j of sequence s is token_at(s, j)), written with
megatron's IndexedDatasetBuilder and read through megatron-core's
BlendedMegatronDatasetBuilder exactly as pretrain_gpt.py does: --data-path
(one prefix, weighted or unweighted blends) with --split, or per-split paths.
Stored per case: the inputs (lengths, seed, seq_length, split, sizes,
weights), per split the indices of every GPTDataset and BlendedDataset, and
tokens/labels/loss_mask of some samples (pad id PAD_ID, so pad masking is
covered; see fresh_sample for the one megatron-core quirk left out). Only numpy and megatron-core are imported; the corpus recipe is
duplicated in the test on purpose (it must not depend on this script).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from types import SimpleNamespace

import numpy as np

MEGATRON_CORE_VERSION = "0.19.2"
VOCAB = 1000
PAD_ID = 5  # a real id that the corpora contain, so masking shows
EOD_ID = VOCAB - 1
SAMPLES_CHECKED = 6  # per split: the first 3 and the last 3


def token_at(sequence: np.ndarray, position: np.ndarray) -> np.ndarray:
    return (sequence * 31 + position * 7 + (position * position) % 13) % VOCAB


def corpus_lengths(num_sequences: int, max_length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_length + 1, size=num_sequences)
    lengths[rng.random(num_sequences) < 0.1] = 0  # blank documents
    return lengths.astype(np.int32)


def write_corpus(prefix: str, lengths: np.ndarray) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for s, n in enumerate(lengths.tolist()):
        builder.add_document(token_at(np.full(n, s), np.arange(n)).astype(np.uint16), [n])
    builder.finalize(prefix + ".idx")


def cases() -> list[dict]:
    """The grid: corpus sizes, seeds, seq lengths, 1-5 epochs, splits, weighted/unweighted blends, per-split paths."""
    out = []
    # One prefix: sizes chosen so that train needs 1..5 epochs, some final epochs short (separate shuffle).
    for n, max_len, seq, seed, split, epochs in [
        (1, 40, 8, 1234, "1", 2),
        (9, 30, 8, 1, "6,2,1", 3),
        (800, 12, 16, 1234, "969,30,1", 1),
        (800, 12, 16, 1234, "969,30,1", 2),
        (50, 60, 16, 99, "98,2", 5),
        (120, 25, 33, 7, "90,5,5", 4),
        (300, 50, 64, 3, "1,1,1", 2),
        (37, 80, 12, 5, "0,1,1", 3),
        (1500, 10, 20, 11, "969,30,1", 1),
    ]:
        for frac in (0.3, 0.95):
            out.append(
                dict(
                    kind="single",
                    lengths=[(n, max_len, seed + 17)],
                    seq=seq,
                    seed=seed,
                    split=split,
                    epochs=epochs,
                    frac=frac,
                    weights=None,
                )
            )
    # Blends over --data-path, weighted (also one weighted prefix) and unweighted.
    for specs, weights, seq, seed, split, epochs in [
        ([(700, 10, 1), (900, 8, 2)], [0.3, 0.7], 16, 1234, "969,30,1", 2),
        ([(60, 40, 3), (90, 30, 4), (50, 70, 5)], [2.0, 1.0, 1.0], 8, 7, "9,1", 4),
        ([(80, 40, 6), (80, 40, 7)], [0.5, 0.5], 10, 3, "90,5,5", 1),
        ([(700, 10, 8)], [1.0], 16, 5, "95,4,1", 2),
        ([(700, 10, 9), (600, 12, 10)], None, 16, 1234, "90,5,5", 1),
        ([(60, 40, 11), (30, 60, 12), (30, 20, 13)], None, 8, 2, "1,1,1", 1),
    ]:
        out.append(dict(kind="blend", lengths=specs, seq=seq, seed=seed, split=split, epochs=epochs, frac=0.7, weights=weights))
    # Per-split paths (--train-data-path ... ): one prefix, and a weighted pair.
    out.append(dict(kind="per_split", lengths=[(70, 40, 21)], seq=16, seed=4, split=None, epochs=3, frac=0.5, weights=None))
    out.append(
        dict(
            kind="per_split",
            lengths=[(70, 40, 22), (50, 30, 23)],
            seq=8,
            seed=4,
            split=None,
            epochs=2,
            frac=0.5,
            weights=[0.4, 0.6],
        )
    )
    return out


def fresh_sample(ds, parts, i: int) -> dict:
    """ds[i] with the loss mask computed for this sample alone.

    megatron-core 0.19.2 caches the loss mask of the first sample a GPTDataset
    reads after zeroing that sample's pad labels in place, so every later
    sample inherits those zeros (order-dependent; a bug tricorn does not copy).
    """
    for part in parts:
        part.masks_and_position_ids_are_cached = False
    return ds[i]


def run_case(case: dict, workdir: str, index: int) -> dict[str, np.ndarray]:
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, all_lengths = [], []
    for k, (n, max_len, seed) in enumerate(case["lengths"]):
        lengths = corpus_lengths(n, max_len, seed)
        prefix = os.path.join(workdir, f"case{index}_{k}")
        write_corpus(prefix, lengths)
        prefixes.append(prefix)
        all_lengths.append(lengths)
    # Train size: `epochs` epochs of the largest corpus' train share, the last one used `frac`.
    tokens = max(int(lengths.sum()) for lengths in all_lengths)
    per_epoch = max(1, (tokens - 1) // case["seq"])
    train = max(1, int((case["epochs"] - 1 + case["frac"]) * per_epoch * (0.9 if case["split"] else 1.0)))
    sizes = [train, max(1, train // 10), max(1, train // 20)]
    tokenizer = SimpleNamespace(pad=PAD_ID, eod=EOD_ID, vocab_size=VOCAB, unique_identifiers={"pad": PAD_ID})
    blend = (prefixes, case["weights"])
    common = dict(
        random_seed=case["seed"],
        sequence_length=case["seq"],
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=os.path.join(workdir, f"cache{index}"),
    )
    if case["kind"] == "per_split":
        config = GPTDatasetConfig(blend_per_split=[blend, blend, blend], **common)
    else:
        config = GPTDatasetConfig(blend=blend, split=case["split"], **common)
    for lengths in all_lengths:  # megatron-core loops forever on a split without tokens: refuse such a case
        for bounds in config.split_matrix or [(0.0, 1.0)]:
            if bounds is not None:
                beg, end = (int(round(b * float(lengths.size))) for b in bounds)
                assert lengths[beg:end].sum() > 1, f"case {index}: split {bounds} of a corpus holds no tokens"
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    out: dict[str, np.ndarray] = {
        "seq": np.array(case["seq"]),
        "seed": np.array(case["seed"]),
        "split": np.array(case["split"] or ""),
        "kind": np.array(case["kind"]),
        "sizes": np.array(sizes),
        "weights": np.array(case["weights"] if case["weights"] is not None else [], dtype=np.float64),
        "num_corpora": np.array(len(prefixes)),
    }
    for k, lengths in enumerate(all_lengths):
        out[f"lengths{k}"] = lengths
    for split_index, ds in enumerate(datasets):
        name = f"split{split_index}"
        if ds is None or len(ds) == 0:
            out[f"{name}/none"] = np.array(1)
            continue
        out[f"{name}/len"] = np.array(len(ds))
        parts = [ds]
        if isinstance(ds, BlendedDataset):
            out[f"{name}/dataset_index"] = ds.dataset_index
            out[f"{name}/dataset_sample_index"] = ds.dataset_sample_index
            parts = ds.datasets
            out[f"{name}/component_corpora"] = np.array([prefixes.index(p.dataset_path) for p in parts])
        for c, part in enumerate(parts):
            out[f"{name}/c{c}/num_samples"] = np.array(-1 if part.num_samples is None else part.num_samples)
            out[f"{name}/c{c}/documents"] = np.array([part.indices[0], part.indices[-1] + 1])
            for array_name in ("document_index", "sample_index", "shuffle_index"):
                out[f"{name}/c{c}/{array_name}"] = np.asarray(getattr(part, array_name))
        checked = sorted({*range(min(3, len(ds))), *range(max(0, len(ds) - 3), len(ds))})
        out[f"{name}/checked"] = np.array(checked)
        samples = [fresh_sample(ds, parts, i) for i in checked]
        for field in ("tokens", "labels", "loss_mask"):
            out[f"{name}/{field}"] = np.stack([sample[field].numpy() for sample in samples])
    return out


def require_megatron_core() -> None:
    """Stop unless the running megatron-core is the version the fixtures pin."""
    import megatron.core

    if megatron.core.__version__ != MEGATRON_CORE_VERSION:
        raise SystemExit(f"this script pins megatron-core {MEGATRON_CORE_VERSION}, found {megatron.core.__version__}")


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed to `path` atomically (a temporary file, then a rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def main() -> None:
    require_megatron_core()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="tests/fixtures/megatron_gpt.npz")
    parser.add_argument(
        "--checkpoints", help="also write the Megatron checkpoint fixtures there (scripts/make_megatron_checkpoints.py)"
    )
    args = parser.parse_args()
    arrays: dict[str, np.ndarray] = {"megatron_core_version": np.array(MEGATRON_CORE_VERSION)}
    grid = cases()
    with tempfile.TemporaryDirectory() as workdir:
        for i, case in enumerate(grid):
            for key, value in run_case(case, workdir, i).items():
                arrays[f"case{i}/{key}"] = value
    arrays["num_cases"] = np.array(len(grid))
    write_npz(args.output, arrays)
    print(f"wrote {args.output}: {len(grid)} cases, {os.path.getsize(args.output) / 1024:.0f} KB")
    if args.checkpoints:  # its own processes: megatron keeps process groups and args in globals
        import subprocess
        import sys

        sibling = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_megatron_checkpoints.py")
        subprocess.run([sys.executable, sibling, "--output", args.checkpoints], check=True)


if __name__ == "__main__":
    main()
