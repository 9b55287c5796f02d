"""Config: flags, presets, YAML, and every validation error (one line, before any process group)."""

import os
import subprocess
import sys

import pytest
from harness import BASE_FLAGS, ENTRY, with_flag

from tricorn.config import PRESETS, ConfigError, dump_yaml
from tricorn.config_args import config_from_args
from tricorn.validation import validate


def errors(argv, world_size=1):
    return validate(config_from_args(argv, world_size=world_size))


def test_defaults_and_flags():
    cfg = config_from_args(BASE_FLAGS + ["--tensor-model-parallel-size", "2", "--swiglu"], world_size=4)
    assert cfg.model.num_layers == 2 and cfg.model.swiglu and cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.data_parallel_size == 2 and cfg.num_microbatches == 1
    assert errors(BASE_FLAGS) == []


@pytest.mark.parametrize(
    "argv,world,needle",
    [
        (
            with_flag(BASE_FLAGS, "--num-attention-heads", "6") + ["--hidden-size", "96", "--tensor-model-parallel-size", "4"],
            4,
            "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            BASE_FLAGS + ["--num-query-groups", "1", "--group-query-attention", "--tensor-model-parallel-size", "2"],
            2,
            "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2",
        ),
        (
            with_flag(BASE_FLAGS, "--global-batch-size", "6") + ["--micro-batch-size", "2"],
            2,
            "--global-batch-size 6 is not divisible by --micro-batch-size x DP = 2 x 2 = 4",
        ),
        (BASE_FLAGS + ["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by TP x PP x CP"),
        (with_flag(BASE_FLAGS, "--num-attention-heads", "5"), 1, "--hidden-size 64 is not divisible by --num-attention-heads 5"),
        (BASE_FLAGS + ["--bf16", "--fp16"], 1, "--bf16 and --fp16 are exclusive"),
        ([x for x in BASE_FLAGS if x != "--mock-data"], 1, "no training data"),
    ],
)
def test_validation_errors(argv, world, needle):
    errs = errors(argv, world)
    assert any(needle in e for e in errs), errs


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match="did you mean 'llama2-7b'"):
        config_from_args(["--model-preset", "llama2-7", "--mock-data"])


def test_presets_have_published_shapes():
    cfg = config_from_args(["--model-preset", "llama2-70b", "--mock-data"], world_size=1)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (80, 8192, 28672)
    assert cfg.model.kv_heads == 8 and cfg.model.swiglu and cfg.model.untie_embeddings_and_output_weights
    assert set(PRESETS) >= {"tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "codellama-34b"}
    # A flag overrides the preset.
    assert config_from_args(["--model-preset", "llama2-7b", "--num-layers", "2", "--mock-data"]).model.num_layers == 2


def test_yaml_and_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  num_layers: 3\n  hidden_size: 96\ntraining:\n  lr: 0.5\n")
    cfg = config_from_args(["--config", str(f), "--num-layers", "5", "--mock-data"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.training.lr) == (5, 96, 0.5)


def test_the_yaml_a_run_saves_reads_back_as_the_same_config(tmp_path):
    """config.yaml (log dir, checkpoints) given back to --config rebuilds the run's config, unset Optionals included."""
    cfg = config_from_args(BASE_FLAGS + ["--tensor-model-parallel-size", "2", "--clip-grad", "0.5"], world_size=2)
    f = tmp_path / "config.yaml"
    f.write_text(dump_yaml(cfg))
    again = config_from_args(["--config", str(f)], world_size=2)
    assert dump_yaml(again) == dump_yaml(cfg)


def test_yaml_unknown_key_names_closest(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model:\n  num_layer: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'model.num_layer'.*did you mean 'num_layers'"):
        config_from_args(["--config", str(f)])


def test_cli_refuses_with_one_line_before_launch():
    """The Foundation acceptance, exactly: FLAGS + --num-attention-heads 6 --tensor-model-parallel-size 4, one process."""
    argv = with_flag(BASE_FLAGS, "--num-attention-heads", "6") + ["--tensor-model-parallel-size", "4"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(ENTRY), *argv], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("tricorn: error: --num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4")


def test_only_rank_zero_prints_the_refusal():
    argv = with_flag(BASE_FLAGS, "--num-attention-heads", "6") + ["--tensor-model-parallel-size", "4"]
    env = {**os.environ, "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = subprocess.run([sys.executable, str(ENTRY), *argv], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.strip() == ""


def test_layout_over_device_memory_is_refused_before_launch():
    from tricorn.planning.estimate import memory_errors

    big = config_from_args(["--model-preset", "llama2-70b", "--mock-data", "--bf16", "--device", "cuda"], world_size=1)
    (err,) = memory_errors(big, 80 * 2**30)
    assert "exceeds the device's 80.0 GiB" in err and "--dry-run" in err
    assert memory_errors(config_from_args(BASE_FLAGS, world_size=1), 80 * 2**30) == []
    assert memory_errors(big, None) == []  # no device to compare with (CPU)
