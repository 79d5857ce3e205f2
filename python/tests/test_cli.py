"""The console script and `python -m unshard` run the same CLI as the Rust binary."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import unshard
from conftest import FIXTURES, ROOT, same_tree


def console(*args, **kw):
    exe = shutil.which("unshard")
    assert exe is not None, "the unshard console script is not on PATH (is the wheel installed?)"
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, **kw)


def test_version_agrees_with_the_module():
    out = console("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"unshard {unshard.__version__}"
    mod = subprocess.run([sys.executable, "-m", "unshard", "--version"], capture_output=True, text=True)
    assert mod.returncode == 0, mod.stderr
    assert mod.stdout == out.stdout


def test_console_script_merges_like_transformers(tmp_path):
    out = tmp_path / "out"
    res = console(
        "merge", FIXTURES / "ckpt/llama_policy.pt", "--base", FIXTURES / "models/llama-bf16", "--output", out
    )
    assert res.returncode == 0, res.stderr
    assert same_tree(out, FIXTURES / "expected/llama_policy_into_llama-bf16") == []


@pytest.mark.skipif(not os.environ.get("UNSHARD_BIN"), reason="UNSHARD_BIN (the Rust binary) not given")
def test_console_script_output_is_byte_identical_to_the_rust_binary(tmp_path):
    args = ["merge", FIXTURES / "ckpt/qwen2_policy.pt", "--base", FIXTURES / "models/qwen2-fp16-sharded",
            "--max-shard-size", "100KB", "--output"]
    py = console(*args, tmp_path / "py")
    rust = subprocess.run([os.environ["UNSHARD_BIN"], *map(str, args), tmp_path / "rust"],
                          capture_output=True, text=True)
    assert (py.returncode, rust.returncode) == (0, 0), (py.stderr, rust.stderr)
    assert same_tree(tmp_path / "py", tmp_path / "rust") == []
    inspect_py = console("inspect", "--json", tmp_path / "py")
    inspect_rust = subprocess.run([os.environ["UNSHARD_BIN"], "inspect", "--json", tmp_path / "rust"],
                                  capture_output=True, text=True)
    assert inspect_py.returncode == inspect_rust.returncode == 0
    py_json = inspect_py.stdout.replace(str(tmp_path / "py"), "OUT")
    assert py_json == inspect_rust.stdout.replace(str(tmp_path / "rust"), "OUT")


def test_exit_codes_are_the_clis(tmp_path):
    usage = console("merge")
    assert usage.returncode == 2
    assert "Usage" in usage.stderr
    missing = console("merge", tmp_path / "nope.pt", "--output", tmp_path / "out")
    assert missing.returncode == 1
    assert missing.stderr.startswith("error:")
    assert not (tmp_path / "out").exists()


def test_inspect_json_from_the_console_script_matches_the_api():
    import json

    res = console("inspect", "--json", FIXTURES / "ckpt/llama_policy.pt")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == unshard.inspect(FIXTURES / "ckpt/llama_policy.pt").to_dict()
