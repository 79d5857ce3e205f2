"""Warnings reach Python as the CLI prints them: through `warnings`, in the report, in unshard.json."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

import unshard
from conftest import FIXTURES
from test_cli import console

HOSTILE = FIXTURES / "hostile"


def payload_case():
    """A checkpoint whose pickle calls os.system under torch.load (fixtures/gen_hostile.py
    checked that torch.load runs it), and the callables its generator put in it."""
    with open(HOSTILE / "manifest.json") as f:
        case = next(c for c in json.load(f)["cases"] if c["name"] == "metrics_os_system")
    assert case["torch_load"]["runs_payload"]
    return HOSTILE / case["file"], case["callables"]


@pytest.fixture
def policy(tmp_path):
    src, callables = payload_case()
    dst = tmp_path / "policy.pt"
    shutil.copyfile(src, dst)
    return dst, callables


def test_unsafe_pickle_warns_is_reported_and_recorded(policy, tmp_path):
    ckpt, callables = policy
    out = tmp_path / "out"
    with pytest.warns(unshard.UnsafePickleWarning) as caught:
        report = unshard.merge(ckpt, out, weights_only=True, progress=False)
    unsafe = [w for w in caught if issubclass(w.category, unshard.UnsafePickleWarning)]
    assert len(unsafe) == 1, [str(w.message) for w in caught]
    message = str(unsafe[0].message)
    assert str(ckpt) in message
    for c in callables:
        assert c in message
    # The warning points at the caller's line, not into unshard.
    assert unsafe[0].filename == __file__
    # Kept in the report, as data.
    kept = [w for w in report.warnings if w["kind"] == "unsafe_pickle"]
    assert [w["message"] for w in kept] == [message]
    assert kept[0]["file"] == str(ckpt)
    assert sorted(c["callable"] for c in report.unsafe_calls) == sorted(callables)
    # Recorded in the output.
    with open(out / "unshard.json") as f:
        recorded = json.load(f)["unsafe_calls"]
    assert sorted(c["callable"] for c in recorded) == sorted(callables)
    assert all(c["file"] == str(ckpt.resolve()) and c["verdict"] == "dangerous" for c in recorded)
    # The CLI on the same input names each call in the same words.
    res = console("merge", ckpt, tmp_path / "cli", "--weights-only", "-q")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    head = next(i for i, line in enumerate(lines) if "its pickle would run code under torch.load" in line)
    assert lines[head] == f"warning: {message.split(': ', 2)[0]}: " + message.split(": ", 2)[1] + ":"
    listed = [line.strip() for line in lines[head + 1:] if line.startswith("  ")]
    assert len(listed) == len(callables)
    for call in listed:
        assert call in message


def test_refuse_unsafe_raises_and_writes_nothing(policy, tmp_path):
    ckpt, callables = policy
    for kwargs in ({"refuse_unsafe": True}, {"strict": True}):
        out = tmp_path / "out"
        with pytest.raises(unshard.UnsafePickle) as e:
            unshard.merge(ckpt, out, weights_only=True, progress=False, **kwargs)
        assert isinstance(e.value, unshard.UnshardError)
        for c in callables:
            assert c in str(e.value)
        assert "refuse_unsafe" in (e.value.hint or "")
        assert not out.exists()
    res = console("merge", ckpt, tmp_path / "cli", "--weights-only", "--refuse-unsafe")
    assert res.returncode == 1
    assert str(e.value.message) in res.stderr


def test_clean_inputs_warn_nothing_unsafe_and_record_no_calls(tmp_path):
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("error", unshard.UnsafePickleWarning)
        report = unshard.merge(
            FIXTURES / "ckpt/llama_policy.pt", out, base=FIXTURES / "models/llama-bf16", progress=False
        )
    assert report.unsafe_calls == []
    with open(out / "unshard.json") as f:
        assert json.load(f)["unsafe_calls"] == []


def test_other_warnings_are_unshard_warnings(tmp_path):
    # No tokenizer beside this config: the merge warns, and Python hears of it.
    base = tmp_path / "base"
    base.mkdir()
    shutil.copyfile(FIXTURES / "models/llama-bf16/config.json", base / "config.json")
    with pytest.warns(unshard.UnshardWarning, match="no tokenizer") as caught:
        report = unshard.merge(FIXTURES / "ckpt/llama_policy.pt", tmp_path / "out", base=base, progress=False)
    assert not any(issubclass(w.category, unshard.UnsafePickleWarning) for w in caught)
    assert any(w["kind"] == "merge" and "no tokenizer" in w["message"] for w in report.warnings)
