"""The kvq command line: exit codes, JSON output, the default model."""

import json
import subprocess
import sys

import pytest

from kvq.cli import main
from kvq.models.source import model_shape, resolve_model

BARE = ["--num-layers", "36", "--num-kv-heads", "2", "--head-dim", "128", "--block-size", "16"]


def _plan_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("fmt,expected", [("fp8", 294912), ("fp16", 589824), ("int8", 299520)])
def test_plan_bare_config_reproduces_seed_002(capsys, fmt, expected):
    rec = _plan_json(capsys, *BARE, "--kv-cache-dtype", fmt)
    assert rec["bytes_per_block"] == expected
    assert rec["capacity"]["num_blocks"] == (8 << 30) // expected


def test_plan_unknown_format_exits_2_naming_valid_ones(capsys):
    assert main(["plan", *BARE, "--kv-cache-dtype", "fp8_e4m4"]) == 2
    err = capsys.readouterr().err
    assert "fp8_e4m4" in err and "fp8_e4m3" in err and "int4_kivi" in err


def test_console_script_exit_code():
    r = subprocess.run([sys.executable, "-m", "kvq.cli", "plan", *BARE, "--kv-cache-dtype", "nope"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "valid formats" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvq.cli", "plan", "--no-such-flag"], capture_output=True, text=True)
    assert r.returncode == 2


def test_plan_other_errors_exit_2(capsys):
    assert main(["plan", *BARE, "--kv-cache-dtype", "int4_kivi"]) == 2  # block 16 < group 32
    assert "multiple of 32" in capsys.readouterr().err
    assert main(["plan", "--num-layers", "4", "--kv-cache-dtype", "fp8"]) == 2
    assert main(["plan", *BARE, "--memory", "lots"]) == 2
    assert main(["plan", "--model", "/no/such/model", "--kv-cache-dtype", "fp8"]) == 2
    assert "never downloads" in capsys.readouterr().err


def test_plan_split_k_v_and_skip_layers(capsys):
    rec = _plan_json(capsys, *BARE, "--kv-cache-dtype-k", "fp8", "--kv-cache-dtype-v", "int8",
                     "--kv-cache-dtype-skip-layers", "0", "1")
    assert (rec["k_format"], rec["v_format"]) == ("fp8_e4m3", "int8")
    assert rec["skip_layers"] == [0, 1]
    assert rec["bytes_per_block"] == 34 * (294912 + 299520) // 72 + 2 * 589824 // 36


def test_formats_lists_every_format(capsys):
    assert main(["formats", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in rows]
    assert "fp8_per_block" in names and "int2_kivi" in names and "fp8_e4m3fnuz" in names
    assert main(["formats", *BARE[:6]]) == 0
    out = capsys.readouterr().out
    assert "18432.0" in out  # fp8 on the Qwen2.5-3B shape: 36 layers * (K+V) * 2 heads * 128 bytes
    assert "decode_per_layer" not in out  # a bare shape has no engine: no backend column


def test_formats_with_a_model_name_the_decode_backend_per_layer_here(capsys):
    import torch

    assert main(["formats", "--model", "default", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    if not torch.cuda.is_available():
        assert rows["int4_kivi"]["backend"] == "torch" and rows["int4_kivi"]["decode_per_layer"] == "cpu: torch 0-29"
    else:
        assert rows["int4_kivi"]["decode_per_layer"].startswith("cuda: ")


def test_default_model_shape():
    src = resolve_model("default")
    assert src.gguf_file and src.path.is_file()
    m = model_shape("default")
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.num_attention_heads) == (30, 3, 64, 9)
    assert m.max_position_embeddings == 8192 and m.dtype == "bfloat16"


def test_plan_default_model(capsys):
    rec = _plan_json(capsys, "--kv-cache-dtype", "int4_kivi", "--memory", "1GiB")
    assert rec["model"] == "default" and rec["block_size"] == 32
    assert rec["bytes_per_block"] == 30 * 2 * (3 * 32 * 32 + 2 * 2 * 3 * 64)
    assert rec["capacity"]["hp_blocks_per_sequence"] == 5


def test_plan_host_tier_holds_the_formats_ratio_too(capsys):
    """Swapped blocks are stored as on the device: a 4 GiB host tier holds 4x the blocks of 1 GiB
    of device memory (up to the windows' rounding), and int4_kivi's tier holds its ratio more
    tokens than bf16's."""
    rec = _plan_json(capsys, "--kv-cache-dtype", "int4_kivi", "--memory", "1GiB", "--cpu-offload-gb", "4")
    host, dev = rec["cpu_offload"], rec["capacity"]
    assert host["memory_bytes"] == 4 << 30 and abs(host["num_blocks"] - 4 * dev["num_blocks"]) <= 4  # floors
    bf16 = _plan_json(capsys, "--kv-cache-dtype", "bfloat16", "--memory", "1GiB", "--cpu-offload-gb", "4")
    assert host["num_tokens"] / bf16["cpu_offload"]["num_tokens"] == pytest.approx(rec["ratio_vs_model_dtype"],
                                                                                    rel=0.01)
    assert main(["plan", "--model", "default", "--cpu-offload-gb", "-1"]) == 2
    assert "--cpu-offload-gb" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["formats"], ["plan", "--num-layers", "36", "--num-kv-heads", "2",
                                                             "--head-dim", "128", "--block-size", "16"],
                                  ["generate", "--help"], ["serve", "--help"], ["eval", "--help"]])
def test_cli_help_formats_and_plan_import_no_torch(argv):
    """The commands that only print or do arithmetic start fast: torch is not imported."""
    code = ("import sys\nimport kvq.cli\nsys.argv = ['kvq'] + %r\ntry:\n    kvq.cli.main()\nexcept SystemExit:\n"
            "    pass\nassert 'torch' not in sys.modules, 'torch was imported'\n" % argv)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_help_names_every_attention_backend(capsys):
    from kvq.attention.backends import backend_names

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in backend_names():
        assert name in text.rsplit("--attention-backend", 1)[1][:200], name  # the option's help, not usage


def test_usage_errors_are_one_line_and_return_2(capsys):
    """argparse's own errors (unknown flag, a value that is not a number) come back as exit code 2
    with one line, like every other bad input; --help still exits 0."""
    for argv, want in ((["plan", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                       (["plan", *BARE, "--context-len", "ten"], "invalid int value: 'ten'"),
                       (["generate"], "the following arguments are required: prompt"),
                       (["nope"], "invalid choice: 'nope'")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kvq: error: ") and err.count("\n") == 1 and want in err, err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0


def test_engine_commands_take_threads(capsys):
    for command in ("generate", "serve", "eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--threads" in capsys.readouterr().out, command


def test_plan_shows_the_tier_ladder(capsys):
    """Elastic precision in `kvq plan`: each tier's bytes a block, blocks a slab and tokens if the whole
    budget held it; bad tier options exit 2 naming what is valid."""
    args = ["plan", "--num-layers", "32", "--num-kv-heads", "8", "--head-dim", "128", "--kv-cache-dtype", "fp8_e4m3",
            "--kv-cache-tiers", "int4_kivi", "--memory", "8GiB"]
    assert main([*args, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["tiers"]
    assert rec["policies"] == ["pressure"] and [r["format"] for r in rec["ladder"]] == ["fp8_e4m3", "int4_kivi"]
    assert [r["blocks_per_slab"] for r in rec["ladder"]] == [5, 8] and rec["slabs"] == (8 << 30) // (5 << 21)
    assert main(args) == 0
    assert "int4_kivi" in capsys.readouterr().out
    assert main([*args, "--kv-tier-age", "1024,2048"]) == 2
    assert "one age per tier" in capsys.readouterr().err
    assert main([*args, "--kv-tier-policy", "lru"]) == 2
    assert "valid: age, pressure" in capsys.readouterr().err
    assert main([*args[:-4], "--kv-cache-dtype", "int2_kivi", "--kv-cache-tiers", "int4_kivi"]) == 2
    assert "smaller than the one above" in capsys.readouterr().err

