"""The Python API on the committed fixtures: results, reports, errors, progress, threads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import unshard
from conftest import FIXTURES, cases, leftovers, same_tree


@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
def test_merge_writes_what_transformers_writes(case, tmp_path):
    out = tmp_path / "out"
    report = unshard.merge(
        FIXTURES / case["checkpoint"],
        out,
        base=FIXTURES / case["base"],
        dtype=case["dtype"],
        max_shard_size=case["max_shard_size"],
        allow_overflow="--allow-overflow" in case.get("extra_args", []),
        progress=False,
    )
    assert isinstance(report, unshard.MergeReport)
    assert same_tree(out, FIXTURES / case["expected_dir"]) == []
    assert sorted(report.files) == sorted(p.name for p in out.iterdir())
    assert set(case["files"]) <= set(report.files)


def test_merge_report_says_what_was_done(tmp_path):
    report = unshard.merge(
        FIXTURES / "ckpt/llama_fsdp_prefixed.pt",
        str(tmp_path / "out"),
        base=str(FIXTURES / "models/llama-bf16"),
        progress=False,
    )
    data = report.to_dict()
    # (name, reason) pairs and (old, new) pairs, as `unshard merge` reports them.
    assert any("inv_freq" in name for name, _ in data["dropped"]), data["dropped"]
    assert any("_fsdp_wrapped_module" in old and "_fsdp" not in new for old, new in data["renamed"])
    assert data["casts"] and all(to == "BF16" for _, to, _ in data["casts"])
    with pytest.raises(AttributeError):
        report.no_such_field


def test_layout_packed_writes_what_model_state_dict_holds(tmp_path):
    # transformers' per-expert files, written packed: the state dict of the model
    # transformers loads from them, as gen_moe.py saved it; verify takes the layout
    # back from unshard.json.
    moe = FIXTURES / "moe/qwen3_moe"
    out = tmp_path / "out"
    report = unshard.merge(moe / "expected", out, base=moe / "base", layout="packed", progress=False)
    assert same_tree(out, moe / "expected_packed") == []
    assert any("packed into" in n for n in report.notes), report.notes
    assert unshard.verify(out).ok


def test_paths_may_be_pathlike_and_bad_types_are_refused(tmp_path):
    unshard.merge(Path(FIXTURES / "ckpt/llama_policy.pt"), tmp_path / "o", base=FIXTURES / "models/llama-bf16",
                  progress=False)
    with pytest.raises(TypeError):
        unshard.merge(42, tmp_path / "p")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ckpt, kwargs, exc",
    [
        ("ckpt/does_not_exist.pt", {}, unshard.UnreadableCheckpoint),
        ("ckpt/llama_extra_key.pt", {"base": "models/llama-bf16"}, unshard.UnknownTensor),
        ("ckpt/llama_shape_mismatch.pt", {"base": "models/llama-bf16"}, unshard.ShapeMismatch),
        ("ckpt/qwen2_overflow.pt", {"base": "models/qwen2-fp16"}, unshard.DtypeOverflow),
        ("ckpt/llama_policy.pt", {"dtype": "float8"}, unshard.InvalidOption),
        ("ckpt/llama_policy.pt", {"max_shard_size": "huge"}, unshard.InvalidOption),
        ("ckpt/llama_policy.pt", {"layout": "stacked"}, unshard.InvalidOption),
    ],
)
def test_errors_are_typed_and_leave_nothing(ckpt, kwargs, exc, tmp_path):
    if "base" in kwargs:
        kwargs["base"] = FIXTURES / kwargs["base"]
    out = tmp_path / "out"
    with pytest.raises(exc) as info:
        unshard.merge(FIXTURES / ckpt, out, progress=False, **kwargs)
    assert isinstance(info.value, unshard.UnshardError)
    assert info.value.message
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []


def test_no_config_anywhere_is_refused_unless_weights_only(tmp_path):
    ckpt = tmp_path / "policy.pt"
    ckpt.write_bytes((FIXTURES / "ckpt/llama_policy.pt").read_bytes())
    out = tmp_path / "out"
    with pytest.raises(unshard.UnshardError) as info:
        unshard.merge(ckpt, out, progress=False)
    assert "no config.json" in info.value.message
    assert info.value.hint and "base" in info.value.hint and "weights" in info.value.hint
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []
    unshard.merge(ckpt, out, weights_only=True, progress=False)
    assert (out / "model.safetensors").is_file()
    assert not (out / "config.json").exists()


def test_an_existing_output_needs_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = (FIXTURES / "ckpt/llama_policy.pt", out)
    with pytest.raises(unshard.OutputExists) as info:
        unshard.merge(*args, base=FIXTURES / "models/llama-bf16", progress=False)
    assert info.value.hint and "force" in info.value.hint
    unshard.merge(*args, base=FIXTURES / "models/llama-bf16", force=True, progress=False)
    assert same_tree(out, FIXTURES / "expected/llama_policy_into_llama-bf16") == []


def test_verify_passes_and_finds_a_flipped_byte(tmp_path):
    out = tmp_path / "out"
    base = FIXTURES / "models/llama-bf16"
    ckpt = FIXTURES / "ckpt/llama_policy.pt"
    unshard.merge(ckpt, out, base=base, progress=False)
    good = unshard.verify(out, ckpt, base=base)
    assert good.ok and bool(good)
    shard = out / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    bad = unshard.verify(out, ckpt, base=base)
    assert not bad.ok and not bool(bad)
    assert bad.mismatches


def test_diff_reports_identical_and_different(tmp_path):
    same = unshard.diff(FIXTURES / "models/llama-bf16", FIXTURES / "models/llama-bf16")
    assert same.identical
    other = unshard.diff(FIXTURES / "ckpt/llama_policy.pt", FIXTURES / "models/llama-bf16")
    assert not other.identical
    assert other.tensors


def test_inspect_finds_the_state_dict():
    info = unshard.inspect(FIXTURES / "ckpt/llama_policy.pt")
    assert info["key"] == "state"
    names = [t["name"] for t in info["tensors"]]
    assert "model.embed_tokens.weight" in names
    with_stats = unshard.inspect(FIXTURES / "ckpt/llama_policy.pt", stats=True)
    assert "stats" in with_stats["tensors"][0]


def test_progress_callback_sees_bytes_up_to_the_total(tmp_path, slow_engine):
    calls = []
    unshard.merge(
        FIXTURES / "ckpt/llama_policy.pt",
        tmp_path / "out",
        base=FIXTURES / "models/llama-bf16-sharded",
        max_shard_size="100KB",
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls, "the callback was never called"
    totals = {t for _, t in calls}
    assert len(totals) == 1 and totals.pop() > 0
    dones = [d for d, _ in calls]
    assert dones == sorted(dones)
    assert all(0 <= d <= t for d, t in calls)


def test_progress_false_calls_nothing(tmp_path, slow_engine, monkeypatch):
    import unshard._api as api

    monkeypatch.setattr(api, "_TqdmProgress", None)  # would fail if used
    unshard.merge(FIXTURES / "ckpt/llama_policy.pt", tmp_path / "out", base=FIXTURES / "models/llama-bf16",
                  progress=False)


def test_keyboard_interrupt_cancels_and_leaves_nothing(tmp_path, slow_engine):
    out = tmp_path / "out"

    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        unshard.merge(FIXTURES / "ckpt/llama_policy.pt", out, base=FIXTURES / "models/llama-bf16-sharded",
                      max_shard_size="100KB", progress=interrupt)
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []


def test_ctrl_c_in_the_main_thread_cancels(tmp_path, slow_engine):
    import _thread

    out = tmp_path / "out"
    # interrupt_main() is what Ctrl-C does: it only flags SIGINT, and the exception
    # is raised where the interpreter next runs its signal handlers, i.e. in the
    # wait loop around the running merge (not inside this callback).
    asked = []

    def ctrl_c_once(done, total):
        if not asked:
            asked.append(done)
            _thread.interrupt_main()

    with pytest.raises(KeyboardInterrupt):
        unshard.merge(FIXTURES / "ckpt/llama_policy.pt", out, base=FIXTURES / "models/llama-bf16-sharded",
                      max_shard_size="100KB", progress=ctrl_c_once)
    assert asked, "the merge ended before the interrupt could be sent"
    assert not out.exists()
    assert leftovers(tmp_path, "out") == []


def test_two_merges_in_two_threads_one_cancelled(tmp_path, slow_engine):
    results = {}

    def run(name, cancel):
        def progress(done, total):
            if cancel:
                raise RuntimeError("stop this one")

        try:
            results[name] = unshard.merge(
                FIXTURES / "ckpt/llama_policy.pt", tmp_path / name, base=FIXTURES / "models/llama-bf16-sharded",
                max_shard_size="100KB", progress=progress,
            )
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            results[name] = e

    threads = [threading.Thread(target=run, args=("a", False)), threading.Thread(target=run, args=("b", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(results["a"], unshard.MergeReport)
    assert same_tree(tmp_path / "a", FIXTURES / "expected/llama_policy_into_llama-bf16-sharded") == []
    assert isinstance(results["b"], RuntimeError)
    assert not (tmp_path / "b").exists()
    assert leftovers(tmp_path, "b") == []


def test_merge_fuses_a_lora_adapter_as_peft_does(tmp_path):
    out = tmp_path / "out"
    unshard.merge(FIXTURES / "lora/adapters/llama_lora", out, base=FIXTURES / "models/llama-bf16", progress=False)
    # peft's merge_and_unload on a float32 base, cast once, saved by transformers.
    assert same_tree(out, FIXTURES / "lora/expected/llama_lora") == []
    kept = unshard.merge(FIXTURES / "lora/adapters/llama_lora", tmp_path / "kept",
                         base=FIXTURES / "models/llama-bf16", no_fuse=True, progress=False)
    assert (tmp_path / "kept" / "adapter" / "adapter_config.json").is_file()
    assert unshard.diff(tmp_path / "kept", FIXTURES / "models/llama-bf16").identical
    assert kept.files


def test_several_adapters_need_a_name(tmp_path):
    two = FIXTURES / "lora/adapters/llama_two_adapters"
    with pytest.raises(unshard.UnshardError) as info:
        unshard.merge(two, tmp_path / "out", base=FIXTURES / "models/llama-bf16", progress=False)
    assert "default, second" in info.value.message
    assert not (tmp_path / "out").exists()
    unshard.merge(two, tmp_path / "out", base=FIXTURES / "models/llama-bf16", adapter="second", progress=False)
    assert not unshard.diff(tmp_path / "out", FIXTURES / "models/llama-bf16").identical


def test_progress_without_tqdm_prints_lines_where_stderr_is_not_a_terminal(tmp_path, slow_engine, monkeypatch,
                                                                            capfd):
    import re
    import sys

    # As in a fresh venv: no tqdm.
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    report = unshard.merge(FIXTURES / "ckpt/llama_policy.pt", tmp_path / "out",
                           base=FIXTURES / "models/llama-bf16-sharded", max_shard_size="100KB")
    lines = capfd.readouterr().err.splitlines()
    got = [re.fullmatch(r"unshard: merging (\d+)% \((.+) of (.+), \d+ s\)", line) for line in lines]
    assert got and all(got), lines
    pcts = [int(m.group(1)) for m in got]
    # A line per tenth at most, in order, ending with the whole.
    assert pcts == sorted(pcts) and len(pcts) <= 11 and len(pcts) >= 2, pcts
    assert pcts[-1] == 100 and got[-1].group(2) == got[-1].group(3)
    assert report.tensors_written
    # progress=False: silent.
    unshard.merge(FIXTURES / "ckpt/llama_policy.pt", tmp_path / "quiet", base=FIXTURES / "models/llama-bf16-sharded",
                  progress=False)
    assert capfd.readouterr().err == ""


def test_progress_without_tqdm_draws_a_bar_on_a_terminal(monkeypatch):
    import io

    import unshard._api as api

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(api.sys, "stderr", tty)
    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)
    bar = api._progress_callback(True, "merging")
    for done in (0, 512, 1024):
        bar(done, 1024)
    bar.close()
    text = tty.getvalue()
    assert text.count("\r") == 3 and text.endswith("100% 1.0 KiB/1.0 KiB\n"), repr(text)


def test_progress_lines_come_once_per_tenth(monkeypatch):
    import io

    import unshard._api as api

    log = io.StringIO()  # not a terminal
    monkeypatch.setattr(api.sys, "stderr", log)
    monkeypatch.setitem(__import__("sys").modules, "tqdm.auto", None)
    lines = api._progress_callback(True, "merging")
    for done in range(0, 1001):
        lines(done, 1000)
    pcts = [int(line.split()[2].rstrip("%")) for line in log.getvalue().splitlines()]
    assert pcts == list(range(0, 101, 10)), pcts
