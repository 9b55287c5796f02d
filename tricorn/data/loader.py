"""The trainer's entry points to data: prepare_vocab (before validation) and build_loaders.

Sources per split (train, valid, test):
  --train/valid/test-data-path P...  that split reads the whole of those datasets;
  otherwise --data-path P...         each dataset is cut by documents with --split;
  --mock-data                        MockSamples (seed for train, seed+1 valid, seed+2 test).
A path list is one prefix, WEIGHT PREFIX pairs (blended by weight), or several
prefixes without weights (each one epoch, blended by its sample count: megatron-core's
rules, see tricorn.data.blended). Sizes: train_iters x global
batch samples for train, (train_iters // eval_interval + 1) x eval_iters x
global batch for valid, eval_iters x global batch for test (Megatron's).

Every rank builds the same global sample order; GlobalBatchLoader hands each
DP rank its slice, so global batch j is the same at any DP size, and the only
state is consumed_samples. Collectives: one barrier on the default group per
dataset, and one per prefix for its token range, when torch.distributed is
initialised and --data-cache-path is set (see tricorn.data.cache), so all ranks
must call build_loaders. prepare_vocab runs before launch and writes nothing: the
token ranges it scans are cached by build_loaders.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from tricorn.config import ModelConfig
from tricorn.data.base import GlobalBatchLoader, MockSamples, SampleSource
from tricorn.data.blended import SURPLUS, BlendedDataset, blend_sizes
from tricorn.data.cache import description_key, load_or_build
from tricorn.data.errors import DataError
from tricorn.data.gpt_dataset import SPLIT_NAMES, GPTDataset, parse_split, split_ranges
from tricorn.data.indexed import IndexedDataset
from tricorn.data.skip_samples import read_skip_samples
from tricorn.data.tokenizer import (
    VOCAB_FROM_FLAG,
    Tokenizer,
    TokenizerOptions,
    build_tokenizer,
    build_tokenizer_with,
    check_vocab_size,
    loss_pad_id,
)

log = logging.getLogger(__name__)


@dataclass
class BlendSpec:
    flag: str
    prefixes: list[str]
    weights: Optional[list[float]]  # None: by each dataset's tokens in the split


def _strip_extension(prefix: str) -> str:
    return prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix


def parse_blend(values: list[str], flag: str) -> BlendSpec:
    """PREFIX | WEIGHT PREFIX [WEIGHT PREFIX ...] | PREFIX PREFIX ..."""
    values = [str(v) for v in values]

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(values) == 1 and not is_number(values[0]):
        return BlendSpec(flag, [_strip_extension(values[0])], None)
    if len(values) % 2 == 0 and all(is_number(w) for w in values[0::2]) and not any(is_number(p) for p in values[1::2]):
        return BlendSpec(flag, [_strip_extension(p) for p in values[1::2]], [float(w) for w in values[0::2]])
    if values and not any(is_number(v) for v in values):
        return BlendSpec(flag, [_strip_extension(p) for p in values], None)
    raise DataError(
        f"{flag} must be PREFIX or WEIGHT PREFIX pairs (e.g. 0.3 data/a_text_document 0.7 data/b_text_document), got {' '.join(values)}"
    )


def _split_specs(cfg: Any) -> list[Optional[tuple[BlendSpec, Optional[str]]]]:
    """Per split: the blend and the --split string to cut it with (None: use whole datasets)."""
    d = cfg.data
    explicit = [
        (d.train_data_path, "--train-data-path"),
        (d.valid_data_path, "--valid-data-path"),
        (d.test_data_path, "--test-data-path"),
    ]
    out: list[Optional[tuple[BlendSpec, Optional[str]]]] = []
    for values, flag in explicit:
        if values:
            out.append((parse_blend(values, flag), None))
        elif d.data_path:
            out.append((parse_blend(d.data_path, "--data-path"), d.split))
        else:
            out.append(None)
    return out


def split_sizes(cfg: Any) -> tuple[int, int, int]:
    t, d = cfg.training, cfg.data
    gbs = t.global_batch_size
    if gbs is None:
        raise ValueError("cfg.training.global_batch_size must be resolved before building loaders")
    if d.eval_iters <= 0:
        return t.train_iters * gbs, 0, 0
    evaluations = t.train_iters // d.eval_interval + 1 if d.eval_interval > 0 else 1
    return t.train_iters * gbs, evaluations * d.eval_iters * gbs, d.eval_iters * gbs


class _Datasets:
    """Opens each prefix once (all splits share the memory maps)."""

    def __init__(self) -> None:
        self._open: dict[str, IndexedDataset] = {}

    def __call__(self, prefix: str) -> IndexedDataset:
        if prefix not in self._open:
            self._open[prefix] = IndexedDataset(prefix)
        return self._open[prefix]


def build_split_source(
    cfg: Any, split_index: int, num_samples: int, datasets: Optional[_Datasets] = None
) -> Optional[SampleSource]:
    """The sample source of one split (0 train, 1 valid, 2 test), or None when it has no data or no samples are wanted."""
    spec = _split_specs(cfg)[split_index]
    name = SPLIT_NAMES[split_index]
    if spec is None or num_samples <= 0:
        return None
    blend, split = spec
    datasets = datasets or _Datasets()
    parts: list[tuple[IndexedDataset, np.ndarray, float]] = []
    for k, prefix in enumerate(blend.prefixes):
        indexed = datasets(prefix)
        beg, end = split_ranges(split, len(indexed))[split_index] if split is not None else (0, len(indexed))
        documents = np.arange(beg, end, dtype=np.int64)
        weight = blend.weights[k] if blend.weights is not None else 1.0
        if documents.size == 0 or weight <= 0:
            if blend.weights is not None and weight > 0 and name == "train":
                raise DataError(f"the train split of {prefix} has no documents (--split {split}); give train a larger share")
            continue
        parts.append((indexed, documents, weight))
    if not parts:
        if name == "train":
            raise DataError(
                f"the train split of {' '.join(blend.prefixes)} has no documents (--split {split}); give train a larger share"
            )
        # valid matters (evaluation silently off); an empty test split is normal for small corpora.
        report = log.warning if name == "valid" else log.info
        report("the %s split of %s has no documents (--split %s); no %s loader", name, " ".join(blend.prefixes), split, name)
        return None
    seq, seed, cache = cfg.model.seq_length, cfg.training.seed, cfg.data.data_cache_path
    # megatron-core blends even one weighted --data-path prefix (not one --train-data-path prefix).
    if len(blend.prefixes) == 1 and (blend.weights is None or split is None):
        indexed, documents, _ = parts[0]
        return GPTDataset(indexed, documents, num_samples, seq, seed, cache, name)
    if blend.weights is None:
        # megatron-core: each dataset one epoch, blended by those epochs' sample counts, at most their sum.
        components = [GPTDataset(indexed, documents, None, seq, seed, cache, name) for indexed, documents, _ in parts]
        components = [c for c in components if len(c) > 0]  # an epoch shorter than one sample adds nothing
        if not components:
            raise DataError(f"the {name} split of {' '.join(blend.prefixes)} holds less than one sample of --seq-length {seq}")
        counts = [len(c) for c in components]
        return BlendedDataset(components, counts, min(num_samples, sum(counts)), cache, name)
    weights = [w for _, _, w in parts]
    built = blend_sizes(weights, num_samples, SURPLUS)
    components = [GPTDataset(indexed, documents, n, seq, seed, cache, name) for (indexed, documents, _), n in zip(parts, built)]
    return BlendedDataset(components, weights, sum(blend_sizes(weights, num_samples)), cache, name)


def build_loaders(
    cfg: Any, dp_rank: int, dp_size: int, consumed_samples: int = 0
) -> tuple[GlobalBatchLoader, Optional[GlobalBatchLoader], Optional[GlobalBatchLoader]]:
    """(train, valid, test) loaders; train resumes at consumed_samples, valid/test start at 0 (set their state to resume)."""
    sizes = split_sizes(cfg)
    if cfg.data.mock_data:
        vocab, seq, seed = cfg.model.vocab_size, cfg.model.seq_length, cfg.training.seed
        sources: list[Optional[SampleSource]] = [
            MockSamples(vocab, seq, seed + i) if i == 0 or sizes[i] > 0 else None for i in range(len(SPLIT_NAMES))
        ]
    else:
        datasets = _Datasets()
        cache_token_ranges(cfg, datasets)  # what the checks before launch scanned, now that the run has started
        sources = [build_split_source(cfg, i, sizes[i], datasets) for i in range(len(SPLIT_NAMES))]
    assert sources[0] is not None
    pad = -1 if cfg.data.mock_data else loss_pad_id(build_tokenizer(cfg))
    train = GlobalBatchLoader(sources[0], dp_rank, dp_size, consumed_samples, pad, read_skip_samples(cfg.data.skip_samples))
    valid = GlobalBatchLoader(sources[1], dp_rank, dp_size, pad_id=pad) if sources[1] is not None else None
    test = GlobalBatchLoader(sources[2], dp_rank, dp_size, pad_id=pad) if sources[2] is not None else None
    return train, valid, test


def prepare_vocab(cfg: Any) -> list[str]:
    """Resolve cfg.model.vocab_size from the tokenizer and check the data files; returns one line per problem.

    No --vocab-size: the tokenizer's (or, with --load, the checkpoint's when it pads the tokenizer's the same
    way). A --vocab-size (or preset) at least the tokenizer's: kept; a smaller one is refused (its ids past
    it would have no embedding row that a checkpoint keeps). A --load checkpoint whose vocabulary is not the
    tokenizer's, as Megatron pads it, is refused. Then every data prefix is opened (header, sizes) and its
    token ids are checked against the vocabulary.
    """
    d, m = cfg.data, cfg.model
    if d.mock_data:
        return []
    try:
        options = TokenizerOptions.from_config(cfg)
        tokenizer = build_tokenizer_with(options)
        check_vocab_size(tokenizer, options)
    except DataError as e:
        return [str(e)]
    explicit = m.vocab_size is not None
    if not explicit:
        m.vocab_size = tokenizer.vocab_size
    problem = _checkpoint_vocab(cfg, tokenizer, options.source(), explicit)
    if problem:
        return [problem]
    return check_data_files(cfg, m.vocab_size)


def _checkpoint_vocab(cfg: Any, tokenizer: Tokenizer, source: str, explicit: bool) -> str:
    """'' when the --load checkpoint (if any) holds the tokenizer's vocabulary, padded as Megatron pads it, else why not.

    Without --vocab-size the run takes the checkpoint's size then (a Megatron checkpoint stores padded rows).
    A checkpoint that cannot be read is left to the load checks before launch.
    """
    from tricorn.checkpoint.io import CheckpointError, checkpoint_vocab_size

    m = cfg.model
    if not cfg.checkpoint.load:
        return ""
    try:
        found = checkpoint_vocab_size(cfg.checkpoint.load, cfg.checkpoint.ckpt_step)
    except CheckpointError:
        return ""
    if found is None:
        return ""
    ckpt, saved = found
    padded = ModelConfig(vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by)
    if saved < tokenizer.vocab_size or padded.padded_vocab_size(cfg.parallel.tensor_model_parallel_size) < saved:
        return (
            f"checkpoint {ckpt} has a vocabulary of {saved} but tokenizer {source} has {tokenizer.vocab_size} tokens "
            f"(padded {padded.padded_vocab_size(cfg.parallel.tensor_model_parallel_size)}): they do not belong together; "
            f"pass the tokenizer the checkpoint was trained with"
        )
    if not explicit and cfg.data.tokenizer_type not in VOCAB_FROM_FLAG:  # for those, --vocab-size is the tokenizer's
        m.vocab_size = saved
    return ""


def check_data_files(cfg: Any, vocab: int) -> list[str]:
    """Every data prefix opens, leaves training documents, and holds only ids below `vocab` (the model's real rows)."""
    errs: list[str] = []
    try:
        specs = _split_specs(cfg)
        if cfg.data.data_path:
            parse_split(cfg.data.split)
    except DataError as e:
        return [str(e)]
    prefixes = sorted({p for spec in specs if spec is not None for p in spec[0].prefixes})
    train_spec = specs[0]
    for prefix in prefixes:
        try:
            indexed = IndexedDataset(prefix)
        except DataError as e:
            errs.append(str(e))
            continue
        if len(indexed) == 0:
            errs.append(f"{prefix}.idx holds no documents; re-run `tricorn preprocess` on non-empty input")
            continue
        if train_spec is not None and train_spec[1] is not None and prefix in train_spec[0].prefixes:
            beg, end = split_ranges(train_spec[1], len(indexed))[0]
            if end <= beg:
                errs.append(
                    f"--split {train_spec[1]} leaves no training documents of the {len(indexed)} in {prefix}; give train a larger share"
                )
        low, top = token_range(indexed, cfg.data.data_cache_path, write=False)
        if top >= vocab or low < 0:
            errs.append(
                f"{prefix}.bin holds token id {top if top >= vocab else low} outside the model's vocabulary "
                f"[0, {vocab}); was it preprocessed with another tokenizer than {cfg.data.tokenizer_model or cfg.data.tokenizer_type}?"
            )
    return errs


# Token ranges found by the checks before launch, which write nothing: build_loaders caches them once the run starts.
_unsaved_token_ranges: dict[str, np.ndarray] = {}


def token_range(indexed: IndexedDataset, cache_dir: Optional[str], write: bool = True) -> tuple[int, int]:
    """(smallest, largest) token id of the whole .bin, cached beside the sample indices (keyed by the files' size and time).

    `write=False` (the checks before launch): read a cached range, else scan and keep it in memory for
    `cache_token_ranges`. With a process group, every rank must call this with `write=True` alike.
    """
    prefix = indexed.path_prefix
    files = [os.stat(path) for path in (prefix + ".bin", prefix + ".idx")]
    description = {
        "class": "TokenRange",
        "path_prefix": os.path.abspath(prefix),
        "dtype": str(indexed.dtype),
        "files": [[st.st_size, st.st_mtime_ns] for st in files],
    }
    key = description_key(description)

    def scan() -> dict[str, np.ndarray]:
        if key in _unsaved_token_ranges:
            return {"range": _unsaved_token_ranges.pop(key)}
        return {"range": np.array(indexed.token_range(), np.int64)}

    arrays = load_or_build(cache_dir, "TokenRange", "all", description, ["range"], scan, read_only=not write)
    if not write and cache_dir and not arrays.from_cache:
        _unsaved_token_ranges[key] = np.asarray(arrays["range"])
    low, top = (int(v) for v in arrays["range"])
    return low, top


def cache_token_ranges(cfg: Any, datasets: Optional[_Datasets] = None) -> None:
    """Write the token ranges that the checks before launch found into --data-cache-path (rank 0; a barrier each)."""
    if cfg.data.mock_data or not cfg.data.data_cache_path:
        return
    datasets = datasets or _Datasets()
    specs = [spec for spec in _split_specs(cfg) if spec is not None]
    for prefix in sorted({p for blend, _ in specs for p in blend.prefixes}):
        token_range(datasets(prefix), cfg.data.data_cache_path)
