"""One truth in both front ends: every CLI option that changes what a command does has
its Python keyword, errors name keywords (not flags) and have their own classes, and
``verify(out)`` reads unshard.json as ``unshard verify OUT`` does."""

from __future__ import annotations

import inspect
import re

import pytest

import unshard
from conftest import FIXTURES, leftovers
from test_cli import console

# Flags with no keyword, and why.
CLI_ONLY = {
    "help": "Python has help()",
    "version": "unshard.__version__",
    "quiet": "Python prints no summary; progress=False silences progress",
    "verbose": "a longer text summary; Python's report holds every rename and every tensor from the base",
    "json": "Python returns the report as an object (report.to_dict())",
    "output": "the output is the second positional argument",
    "all": "diff's text lists only differing tensors unless --all; Python's report holds them all",
}
# Keywords with no flag, and why.
PYTHON_ONLY = {
    "progress": "the CLI draws its own bar on stderr (-q silences it)",
}
# Positional arguments (the CLI's positionals).
POSITIONAL = {
    "merge": {"checkpoint", "output"},
    "verify": {"output"},
    "inspect": {"path"},
    "diff": {"a", "b"},
}


def cli_flags(command: str) -> set:
    res = console(command, "--help")
    assert res.returncode == 0, res.stderr
    flags = set(re.findall(r"^\s+(?:-\w, )?--([a-z][a-z0-9-]*)", res.stdout, re.M))
    assert flags, res.stdout
    return {f.replace("-", "_") for f in flags}


@pytest.mark.parametrize("command", sorted(POSITIONAL))
def test_every_flag_has_its_keyword_and_back(command):
    flags = cli_flags(command) - set(CLI_ONLY)
    params = set(inspect.signature(getattr(unshard, command)).parameters) - POSITIONAL[command]
    params -= set(PYTHON_ONLY)
    assert sorted(flags - params) == [], f"unshard {command} flags without a keyword"
    assert sorted(params - flags) == [], f"unshard.{command} keywords without a flag"


def test_the_walk_sees_a_missing_keyword(monkeypatch):
    # The check above is not vacuous: drop a keyword and it is found missing.
    def merge_without_part(checkpoint, output, *, refuse_unsafe=False):  # pragma: no cover
        pass

    params = set(inspect.signature(merge_without_part).parameters) - POSITIONAL["merge"]
    assert "part" in cli_flags("merge") - params


def test_unknown_tensor_hint_names_the_keyword(tmp_path):
    with pytest.raises(unshard.UnknownTensor) as info:
        unshard.merge(FIXTURES / "ckpt/llama_extra_key.pt", tmp_path / "o", base=FIXTURES / "models/llama-bf16",
                      progress=False)
    assert "rename=" in info.value.hint
    assert "renames" not in info.value.hint and "--" not in info.value.hint


@pytest.mark.parametrize(
    "ckpt, kwargs, exc, words",
    [
        # One file of a torch.distributed.checkpoint: the hint names its directory.
        ("lora/train/llama_dora_fsdp2/checkpoint/.metadata", {}, unshard.WrongInput, "checkpoint"),
        # A Hub id that is not in the (empty) cache.
        ("ckpt/llama_policy.pt", {"base": "no-such-org/no-such-model"}, unshard.PlanError, "base"),
        # No config anywhere: base= or weights_only=True, in Python's words.
        ("ckpt/llama_policy.pt", {}, unshard.PlanError, "weights_only=True"),
    ],
)
def test_errors_have_classes_and_name_keywords(ckpt, kwargs, exc, words, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    src = FIXTURES / ckpt
    if ckpt.endswith(".pt"):
        # Away from the fixtures' config.json.
        (tmp_path / "policy.pt").write_bytes(src.read_bytes())
        src = tmp_path / "policy.pt"
    out = tmp_path / "out"
    with pytest.raises(exc) as info:
        unshard.merge(src, out, progress=False, **kwargs)
    e = info.value
    assert type(e) is not unshard.UnshardError and e.kind != "error"
    text = str(e)
    assert words in text, text
    assert not re.search(r"(^|\s)--[a-z]", text), text
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []


def test_verify_reads_unshard_json(tmp_path):
    out = tmp_path / "out"
    ckpt = FIXTURES / "ckpt/llama_policy.pt"
    unshard.merge(ckpt, out, base=FIXTURES / "models/llama-bf16", dtype="float32", progress=False)
    report = unshard.verify(out)
    assert report.ok, report.to_dict()
    assert report.against == str(ckpt.resolve())
    assert any("float32" in t for t in report.from_manifest), report.from_manifest
    # The CLI agrees.
    res = console("verify", out)
    assert res.returncode == 0, res.stderr
    # A changed byte is found with no more arguments.
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    assert not unshard.verify(out).ok
    assert console("verify", out).returncode != 0


def test_verify_without_unshard_json_asks_for_against(tmp_path):
    out = tmp_path / "out"
    unshard.merge(FIXTURES / "ckpt/llama_policy.pt", out, base=FIXTURES / "models/llama-bf16", no_manifest=True,
                  progress=False)
    with pytest.raises(unshard.InvalidOption) as info:
        unshard.verify(out)
    assert "against=" in str(info.value)


def test_part_writes_its_share_and_the_last_commits(tmp_path):
    out = tmp_path / "out"
    ckpt, base = FIXTURES / "ckpt/llama_policy.pt", FIXTURES / "models/llama-bf16"
    first = unshard.merge(ckpt, out, base=base, max_shard_size="200KB", part="0/2", progress=False)
    assert isinstance(first, unshard.PartReport) and not first.committed and first.waiting_for == [1]
    assert not out.exists()
    last = unshard.merge(ckpt, out, base=base, max_shard_size="200KB", part="1/2", progress=False)
    assert last.committed and last.waiting_for == []
    assert sorted(first.shards + last.shards) == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert unshard.verify(out).ok
    with pytest.raises(unshard.InvalidOption) as info:
        unshard.merge(ckpt, tmp_path / "x", base=base, part="2/2", progress=False)
    assert "part='2/2'" in str(info.value) and "--part" not in str(info.value)


def test_reports_are_typed_and_say_what_matters(tmp_path):
    import typing

    out = tmp_path / "out"
    report = unshard.merge(FIXTURES / "ckpt/llama_policy.pt", out, base=FIXTURES / "models/llama-bf16", progress=False)
    # Declared fields are the fields the report has (type checkers see what Python gets).
    for cls, rep in [
        (unshard.MergeReport, report),
        (unshard.VerifyReport, unshard.verify(out)),
        (unshard.DiffReport, unshard.diff(out, FIXTURES / "models/llama-bf16")),
        (unshard.InspectReport, unshard.inspect(out)),
    ]:
        assert isinstance(rep, cls)
        declared = set(typing.get_type_hints(cls))
        assert declared == set(rep.to_dict()), (cls.__name__, declared ^ set(rep.to_dict()))
    r = repr(report)
    assert str(out) in r and f"{report.tensors_written} tensors" in r and f"{len(report.files)} files" in r, r
    assert repr(unshard.inspect(out)).startswith("InspectReport(path=")
    assert unshard.inspect(out).to_dict()["total_tensors"] == report.tensors_written
