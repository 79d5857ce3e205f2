#!/usr/bin/env python3
"""Writes the reference pickles under tests/data/ that the Rust tests parse.

Run from anywhere: `python3 crates/unshard-pickle/tests/gen_pickles.py`. Needs only the
standard library. If `torch` is importable (e.g. `/work/venv/bin/python`), it also writes
`torch_state_dict.pkl` (the data.pkl of a real torch.save zip) and `torch_legacy.pt`
(the pre-1.6 stream format: several pickles back to back, then raw storage bytes).

Pickles made by hand (opcodes Python 3 no longer writes: STRING, BINSTRING, INST, OBJ,
PERSID, BINUNICODE8, ...) are checked against `pickle.loads` here, so every file is
one CPython accepts. The expected values are written out in the Rust tests.
"""

import collections
import io
import os
import pickle
import pickletools
import struct
import sys
import types
import zipfile

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

# A module that pickle can find classes in, with a name that does not depend on how
# this script is run.
geometry = types.ModuleType("geometry")
sys.modules["geometry"] = geometry


class Point:
    def __init__(self, x=0, y=0):
        self.x = x
        self.y = y

    def __eq__(self, other):
        return type(other) is Point and vars(self) == vars(other)


class Outer:
    class Inner:
        pass


class Keyworded:
    """Pickled with NEWOBJ_EX: __getnewargs_ex__ returns keyword arguments."""

    def __new__(cls, a, *, b):
        obj = super().__new__(cls)
        obj.a, obj.b = a, b
        return obj

    def __getnewargs_ex__(self):
        return (self.a,), {"b": self.b}


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


for cls in (Point, Outer, Keyworded, Evil):
    cls.__module__ = "geometry"
    setattr(geometry, cls.__name__, cls)
Outer.Inner.__module__ = "geometry"


def write(name, data, expect=None, check=True, **load_kwargs):
    """Writes tests/data/<name> after checking CPython loads it (to `expect` if given)."""
    if check:
        loaded = pickle.loads(data, **load_kwargs)
        if expect is not None and loaded != expect:
            raise SystemExit(f"{name}: loads gave {loaded!r}, expected {expect!r}")
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def dumps_all(stem, obj, protocols=range(6)):
    for proto in protocols:
        data = pickle.dumps(obj, protocol=proto)
        with open(os.path.join(OUT, f"{stem}_p{proto}.pkl"), "wb") as f:
            f.write(data)


def nested():
    return {
        "ints": [0, 1, -1, 255, 256, 65535, 65536, -123456, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)],
        "floats": [1.5, -0.25],
        "text": ["", "abc", "h\xe9llo \u20ac \U0001f600", "back\\slash\nnewline"],
        "bytes": [b"", b"\x00\x01\xff"],
        "consts": (None, True, False),
        "tuples": ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)),
        "nested": {"x": [], "y": {}, "z": [[1], [2, [3]]]},
        1: "int key",
    }


def main():
    os.makedirs(OUT, exist_ok=True)

    # The same nested value under every protocol.
    dumps_all("nested", nested())

    # OrderedDict keeps insertion order; the _metadata attribute arrives through BUILD,
    # as on every torch state dict.
    od = collections.OrderedDict()
    od["zeta"] = 1
    od["alpha"] = 2
    od["mid"] = 3
    od._metadata = {"": {"version": 1}}
    dumps_all("ordered_dict", od, protocols=(0, 2, 4))

    # Memo sharing and cycles.
    a = [1]
    dumps_all("shared", [a, a], protocols=(0, 2, 4))
    me = []
    me.append(me)
    dumps_all("self_list", me, protocols=(0, 2, 4))
    inner = []
    rec_tuple = (inner,)
    inner.append(rec_tuple)
    dumps_all("recursive_tuple", rec_tuple, protocols=(0, 1, 2, 4))

    # Integers at the i64 boundaries and far past them (LONG text, LONG1, LONG4).
    big = [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**100, -(2**70), 2**3000, -(2**3000)]
    dumps_all("big_ints", big, protocols=(0, 2))

    floats = [0.0, -0.0, 1.5, -2.25e-300, 1e308, float("inf"), float("-inf"), float("nan"), 0.1]
    dumps_all("floats", floats, protocols=(0, 2))

    # bytes: _codecs.encode before protocol 3; bytearray: a REDUCE before protocol 5.
    dumps_all("bytes", [b"", b"\x00\x01\xff", bytearray(b"ab"), bytearray()])

    # Sets: REDUCE set([...]) before protocol 4, EMPTY_SET/ADDITEMS/FROZENSET after.
    dumps_all("sets", [{1, 2, 3}, frozenset({4, 5}), set(), frozenset()], protocols=(0, 2, 4))

    # Objects: NEWOBJ+BUILD (protocol 2+), copy_reg._reconstructor (0/1), NEWOBJ_EX (4).
    dumps_all("instance", Point(1, "two"), protocols=(0, 2, 4))
    dumps_all("keyworded", Keyworded(1, b=2), protocols=(4,))

    # A nested class: getattr(Outer, 'Inner') before protocol 4, STACK_GLOBAL 'Outer.Inner' after.
    dumps_all("nested_class", Outer.Inner, protocols=(2, 4))

    # os.system must stay an inert object.
    for proto in (0, 2):
        with open(os.path.join(OUT, f"os_system_p{proto}.pkl"), "wb") as f:
            f.write(pickle.dumps(Evil(), protocol=proto))

    # Persistent ids the way torch writes storages (BINPERSID) and protocol 0 (PERSID).
    class StoragePickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, bytearray):
                return ("storage", "0", "cpu", len(obj))
            return None

    buf = io.BytesIO()
    StoragePickler(buf, protocol=2).dump({"w": bytearray(6)})
    with open(os.path.join(OUT, "persid_p2.pkl"), "wb") as f:
        f.write(buf.getvalue())

    class Loader(pickle.Unpickler):
        def persistent_load(self, pid):
            return ("pid", pid)

    # Protocol 0 text opcodes that Python 3 no longer writes (Python 2 str, INST, PERSID).
    text_p0 = (
        b"(lp0\n"
        b"S'plain'\np1\na"
        b"S\"it's \\x41\\101\\n\\\\ \\xe9\"\np2\na"
        b"Vunicode \\u00e9\\u20ac\\U0001f600 \\\\u0041\np3\na"
        b"I01\naI00\naI-42\naI12345678901234567890\na"
        b"L123456789012345678901234567890L\naL-5L\na"
        b"F1.5\naF-inf\na"
        b"N"
        b"a"
        b"(igeometry\nPoint\np4\n(dp5\nVx\nI1\nsVy\nI2\nsba"
        b"Pstorage-key\na"
        b"g1\na"
        b"."
    )
    loaded = Loader(io.BytesIO(text_p0), encoding="latin1").load()
    assert loaded[0] == "plain", loaded
    assert loaded[1] == "it's AA\n\\ \xe9", loaded
    assert loaded[2] == "unicode \xe9\u20ac\U0001f600 \\\\u0041", loaded
    assert loaded[3:6] == [True, False, -42], loaded
    assert loaded[6] == 12345678901234567890
    assert loaded[7:9] == [123456789012345678901234567890, -5]
    assert loaded[9:11] == [1.5, float("-inf")]
    assert loaded[11] is None
    assert loaded[12] == Point(1, 2)
    assert loaded[13] == ("pid", "storage-key")
    assert loaded[14] == "plain"
    write("text_opcodes_p0.pkl", text_p0, check=False)

    # Protocol 1 binary opcodes for Python 2 str, OBJ, DUP, POP, POP_MARK.
    text_p1 = (
        b"]q\x00("
        b"U\x03abcq\x01"
        b"T\x02\x00\x00\x00\xe9\xffq\x02"
        b"K\x07M\x00\x01J\xff\xff\xff\xff"
        b"G\x3f\xf8\x00\x00\x00\x00\x00\x00"
        b"(cgeometry\nPoint\nK\x05K\x06o"
        b"N2"  # DUP: None twice
        b"K\x090"  # POP discards the 9
        b"(K\x01K\x021"  # POP_MARK discards the mark and 1, 2
        b"e."
    )
    write(
        "binary_opcodes_p1.pkl",
        text_p1,
        expect=["abc", "\xe9\xff", 7, 256, -1, 1.5, Point(5, 6), None, None],
        encoding="latin1",
    )

    # Protocol 4/5 opcodes Python only writes for huge values.
    def u64(n):
        return struct.pack("<Q", n)

    p5 = (
        b"\x80\x05\x95" + u64(0) +  # an empty frame is legal
        b"]\x94("
        b"\x8d" + u64(3) + b"abc"  # BINUNICODE8
        b"\x8e" + u64(2) + b"\x00\x01"  # BINBYTES8
        b"\x96" + u64(1) + b"z"  # BYTEARRAY8
        b"\x8b\x02\x00\x00\x00\x00\x80"  # LONG4: -32768
        b"B\x01\x00\x00\x00x"  # BINBYTES
        b"C\x01y"  # SHORT_BINBYTES
        b"\x8c\x01s"  # SHORT_BINUNICODE
        b"\x8c\x08geometry\x8c\x05Point\x93)\x81}(\x8c\x01xK\x03\x8c\x01yK\x04ub"  # STACK_GLOBAL NEWOBJ BUILD
        b"e."
    )
    write(
        "wide_opcodes_p5.pkl",
        p5,
        expect=["abc", b"\x00\x01", bytearray(b"z"), -32768, b"x", b"y", "s", Point(3, 4)],
    )

    # A torch-like OrderedDict() REDUCE + BUILD {_metadata}, by hand at protocol 2 and
    # with dict keys that Python merges (1, True, 1.0) and a repeated string key.
    dup_keys = (
        b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01("
        b"X\x01\x00\x00\x00aK\x01"
        b"K\x01X\x03\x00\x00\x00one"
        b"\x88X\x04\x00\x00\x00true"
        b"G\x3f\xf0\x00\x00\x00\x00\x00\x00X\x05\x00\x00\x00float"
        b"X\x01\x00\x00\x00aK\x02"
        b"u}X\t\x00\x00\x00_metadata}sb."
    )
    write(
        "duplicate_keys_p2.pkl",
        dup_keys,
        expect=collections.OrderedDict([("a", 2), (1, "float")]),
    )

    # Several pickles back to back, as the legacy torch format writes them.
    stream = b"".join(pickle.dumps(v, protocol=2) for v in (0x1950A86A20F9469CFC6C, 1001, {"k": 1}))
    write("back_to_back_p2.pkl", stream, expect=0x1950A86A20F9469CFC6C)

    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not importable: torch_state_dict.pkl and torch_legacy.pt not rewritten")
    else:
        write_torch_files()

    print(f"wrote {len(os.listdir(OUT))} files to {OUT}")


def write_torch_files():
    import torch

    torch.manual_seed(0)
    w = torch.arange(6.0).reshape(2, 3)
    sd = collections.OrderedDict(
        w=w,
        t=w.t(),
        p=torch.nn.Parameter(torch.zeros(2, dtype=torch.float16)),
        step=torch.tensor(7),
    )
    buf = io.BytesIO()
    torch.save(sd, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        with open(os.path.join(OUT, "torch_state_dict.pkl"), "wb") as f:
            f.write(z.read(name))

    legacy = io.BytesIO()
    torch.save({"x": torch.tensor([1, 2, 3], dtype=torch.int16)}, legacy, _use_new_zipfile_serialization=False)
    with open(os.path.join(OUT, "torch_legacy.pt"), "wb") as f:
        f.write(legacy.getvalue())


if __name__ == "__main__":
    main()
