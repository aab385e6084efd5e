"""The process that runs one student's exercise file for the grader, and the data-only channel to it.

The grader (remote.py) owns the cases and the verdicts. This process only loads the student's file and
answers calls: the grader sends a function's arguments, this process calls the student's function and
sends back what it returned (and the arguments it changed in place). Nothing it sends is a verdict:
the grader compares every answer with the engine's own, so a forged line is only a wrong answer.

A frame on the channel is a JSON header followed by NumPy arrays in the .npy format (read without
pickle: an object array or a pickle is refused); nothing else crosses, so no code can.

    header  {"args": TREE, ...} where TREE is JSON with arrays as {"$array": i}, numpy scalars as
            {"$scalar": i}, tuples as {"$tuple": [...]}, dicts as {"$dict": {...}}, dataclasses (a
            ModelConfig) as {"$record": {...}} (a SimpleNamespace here), and an answer that is a
            view of argument j as {"$view": j, ...}
    layout  u32 header bytes, u32 array count, the header, then per array u64 bytes + the .npy file
    order   the grader's setup; {"mechanism"} (sent before any code of the student's runs, so it cannot
            be forged); {"load_error"}; then {"call": n, "args", "kwargs"} answered by {"call": n,
            "value", "changed"} (or "raised", or "unsendable"), until the grader closes the channel

It runs as a script (`python -I -S sandbox.py`): no site-packages, no PYTHON* variables, no minillm.
Before the student's code it confines itself (confine.py: Landlock + seccomp), unless the teacher gave
--unsafe; the grader refuses to grade where confinement fails."""
from __future__ import annotations

import io
import json
import os
import struct
import sys
import traceback

OPTIONAL_MODULES = ("ml_dtypes",)  # importable by a student besides NumPy and the standard library (exercise 23)
MAX_HEADER = 1 << 20                # a header is small: shapes, numbers, short strings
_SCALAR_KINDS = "biufc"
_ARRAY_KINDS = "biufcUS"            # bool, integers, floats, complex, text; never objects or records


class BadFrame(Exception):
    """What came down the channel is not a well-formed answer; the message says why, in one line."""


# ---- encoding values as a JSON tree plus arrays --------------------------------------------------------------

def encode(value, arrays: list, views_of: list | None = None, depth: int = 0):
    """`value` as a JSON-able tree; its arrays appended to `arrays`. With `views_of` (the call's argument
    arrays), an array that is a view of one of them is sent as where it lies in it, not as a copy."""
    import numpy as np
    if depth > 20:
        raise TypeError("nested more than 20 levels deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray):
        view = _as_view(value, views_of) if views_of else None
        if view is not None:
            return view
        if value.dtype.kind not in _ARRAY_KINDS:
            raise TypeError(f"an array of dtype {value.dtype}, which is not numbers (no objects, no records)")
        arrays.append(value)
        return {"$array": len(arrays) - 1}
    if isinstance(value, np.generic):
        if value.dtype.kind not in _SCALAR_KINDS:
            raise TypeError(f"a numpy {type(value).__name__}, which is not a number")
        arrays.append(np.asarray(value))
        return {"$scalar": len(arrays) - 1}
    if isinstance(value, (list, tuple)):
        items = [encode(v, arrays, views_of, depth + 1) for v in value]
        return items if isinstance(value, list) else {"$tuple": items}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a dict whose keys are not all strings")
        return {"$dict": {k: encode(v, arrays, views_of, depth + 1) for k, v in value.items()}}
    if isinstance(value, bytes):
        return {"$bytes": value.decode("latin-1")}
    if hasattr(value, "__dataclass_fields__"):               # a ModelConfig: its fields and its properties
        return {"$record": {k: encode(v, arrays, None, depth + 1) for k, v in _record(value).items()}}
    raise TypeError(f"a {type(value).__name__}, which is not data (arrays, numbers, strings, lists, tuples, dicts)")


def _record(obj) -> dict:
    fields = {name: getattr(obj, name) for name in obj.__dataclass_fields__}
    for name in dir(type(obj)):
        if not name.startswith("_") and isinstance(getattr(type(obj), name, None), property):
            try:
                fields[name] = getattr(obj, name)
            except Exception:  # noqa: BLE001 - a property this record cannot compute is left out
                pass
    return fields


def _as_view(a, args: list):
    import numpy as np
    for j, base in enumerate(args):
        if a.dtype == base.dtype and a.size and np.may_share_memory(a, base):
            offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            if 0 <= offset < base.nbytes:
                return {"$view": j, "offset": offset, "shape": list(a.shape), "strides": list(a.strides)}
    return None


def decode(tree, arrays: list, args: list | None = None, depth: int = 0):
    """The value a tree stands for (the inverse of `encode`); `args` are the call's argument arrays a
    `$view` may point into. Raises BadFrame on anything malformed."""
    if depth > 20:
        raise BadFrame("nested more than 20 levels deep")
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [decode(v, arrays, args, depth + 1) for v in tree]
    if not (isinstance(tree, dict) and len(tree) >= 1):
        raise BadFrame(f"a {type(tree).__name__} where a value was expected")
    (tag, body), = list(tree.items())[:1]
    if tag in ("$array", "$scalar"):
        if not (isinstance(body, int) and 0 <= body < len(arrays)):
            raise BadFrame(f"{tag} {body!r} names no array of the frame")
        return arrays[body] if tag == "$array" else arrays[body][()]
    if tag == "$tuple" and isinstance(body, list):
        return tuple(decode(v, arrays, args, depth + 1) for v in body)
    if tag == "$dict" and isinstance(body, dict):
        return {k: decode(v, arrays, args, depth + 1) for k, v in body.items()}
    if tag == "$bytes" and isinstance(body, str):
        return body.encode("latin-1")
    if tag == "$record" and isinstance(body, dict):
        from types import SimpleNamespace
        return SimpleNamespace(**{k: decode(v, arrays, args, depth + 1) for k, v in body.items()})
    if tag == "$view" and args is not None:
        return _view(tree, args)
    raise BadFrame(f"an unknown value tag {tag!r}")


def _view(tree: dict, args: list):
    """The view of a caller's argument an answer says it returned, checked to lie inside that array."""
    import numpy as np
    j, offset, shape, strides = (tree.get(k) for k in ("$view", "offset", "shape", "strides"))
    ok = isinstance(j, int) and 0 <= j < len(args) and isinstance(offset, int) and isinstance(shape, list) \
        and isinstance(strides, list) and len(shape) == len(strides) <= 32 \
        and all(isinstance(v, int) for v in shape + strides) and all(v >= 0 for v in shape)
    if not ok:
        raise BadFrame("a malformed view of an argument")
    base = args[j]
    lo = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0 and n > 0)
    hi = offset + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0 and n > 0) + base.itemsize
    if not base.flags.c_contiguous or lo < 0 or hi > base.nbytes or offset % base.itemsize:
        raise BadFrame("a view that does not lie inside the argument it names")
    return np.ndarray(tuple(shape), base.dtype, buffer=base, offset=offset, strides=tuple(strides))


# ---- frames ------------------------------------------------------------------------------------------------------

def frame_bytes(header: dict, arrays: list) -> bytes:
    import numpy as np
    body = json.dumps(header).encode()
    out = [struct.pack("<II", len(body), len(arrays)), body]
    for a in arrays:
        buf = io.BytesIO()
        np.lib.format.write_array(buf, np.asarray(a), allow_pickle=False)
        out += [struct.pack("<Q", buf.tell()), buf.getvalue()]
    return b"".join(out)


def parse_frame(read, max_bytes: int) -> tuple[dict, list]:
    """Read one frame with `read(n) -> exactly n bytes`; refuse one that announces more than `max_bytes`
    of arrays before reading them, and any array that would need pickle."""
    n_header, n_arrays = struct.unpack("<II", read(8))
    if n_header > MAX_HEADER or n_arrays > 4096:
        raise BadFrame(f"a header of {n_header:,} bytes and {n_arrays} arrays, more than an answer holds")
    try:
        header = json.loads(read(n_header))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise BadFrame("a header that is not JSON (or nested beyond reading)") from None
    if not isinstance(header, dict):
        raise BadFrame("a header that is not a JSON object")
    arrays, total = [], 0
    for _ in range(n_arrays):
        (size,) = struct.unpack("<Q", read(8))
        total += size
        if total > max_bytes:
            raise BadFrame(f"arrays of {total / 2**20:,.0f} MB or more, over the {max_bytes / 2**20:,.0f} MB "
                           f"an answer may hold")
        arrays.append(_npy(read(size)))
    return header, arrays


def _npy(data: bytes):
    """The array in one .npy file, its header checked against its size before anything is allocated
    (a header may claim a terabyte over eight bytes of data); never unpickled."""
    import numpy as np
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"version {version}")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
    except (ValueError, TypeError, SyntaxError) as e:
        raise BadFrame(f"an array that is not plain data ({str(e).splitlines()[0][:80]})") from None
    if dtype.hasobject or dtype.kind not in _ARRAY_KINDS:
        raise BadFrame(f"an array of dtype {dtype}, which is not plain data (no objects, no pickle)")
    count = 1
    for n in shape:
        count *= n
    if f.tell() + count * dtype.itemsize != len(data):
        raise BadFrame(f"an array of shape {list(shape)[:8]} whose data is {len(data) - f.tell():,} bytes")
    flat = np.frombuffer(data, dtype, count=count, offset=f.tell())
    return flat.reshape(shape, order="F" if fortran else "C").copy()      # writeable, and the grader's own


# ---- the student's side -------------------------------------------------------------------------------------

def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _student_line(error: BaseException, path: str) -> str:
    line = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if os.path.basename(frame.filename) == os.path.basename(path):
            line = f" ({os.path.basename(path)}, line {frame.lineno})"
    return line


def _raised(error: BaseException, path: str) -> dict:
    return {"raised": [type(error).__name__, str(error)[:300], _student_line(error, path)]}


def _load(path: str, function: str):
    """The student's module, loaded from the scratch folder under a plain name. -> (function, error)"""
    import importlib.util
    spec = importlib.util.spec_from_file_location("exercise", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        return None, f"line {e.lineno}: {type(e).__name__}: {e.msg}"
    except BaseException as e:  # noqa: BLE001 - its top level raised: that is the student's failure
        where = _student_line(e, path)
        return None, f"{type(e).__name__}: {str(e)[:200]}{where}"
    fn = getattr(module, function, None)
    if not callable(fn):
        return None, f"has no function {function}()"
    return fn, None


class _Found:
    """Finds the optional packages located before confinement (site-packages cannot be listed after it)."""

    def __init__(self, specs: dict):
        self.specs = specs

    def find_spec(self, name, path=None, target=None):
        return self.specs.get(name)


def _numpy_readable(numpy) -> list[str]:
    """NumPy, its bundled libraries, the standard library but its site-packages, and the system's shared
    libraries: everything the student's process may read besides its folder and OPTIONAL_MODULES."""
    import sysconfig
    paths = [os.path.dirname(numpy.__file__), os.path.dirname(numpy.__file__) + ".libs"]
    std = sysconfig.get_paths()["stdlib"]
    paths += [os.path.join(std, e) for e in os.listdir(std) if e not in ("site-packages", "dist-packages")]
    return paths + ["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/dev/null"]


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    requests, answers = os.dup(0), os.dup(1)        # the channel; fds 0 and 1 go nowhere useful
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)                                   # the student's print() lands in the grader's log
    os.close(null)
    setup = _setup(requests)
    sys.path.append(here)
    import confine                                  # noqa: E402 - its path is known only now
    sys.path.remove(here)
    confine.set_limits(setup["memory_bytes"], setup["cpu_seconds"])
    sys.path.append(setup["numpy_path"])
    import importlib.util
    import numpy
    extra = {name: importlib.util.find_spec(name) for name in OPTIONAL_MODULES}   # found now, imported on demand
    extra = {name: spec for name, spec in extra.items() if spec is not None}
    sys.meta_path.insert(0, _Found(extra))
    sys.path.remove(setup["numpy_path"])
    os.chdir(setup["scratch"])
    if setup["unsafe"]:
        mechanism = "not isolated (--unsafe)"
    else:
        try:
            readable = _numpy_readable(numpy) + [p for spec in extra.values() for p in spec.submodule_search_locations]
            mechanism = confine.confine(readable, [setup["scratch"]])
        except confine.Unconfinable as e:
            _write_all(answers, frame_bytes({"unconfined": str(e)}, []))
            return
    _write_all(answers, frame_bytes({"mechanism": mechanism}, []))      # before any code of the student's
    fn, error = _load(os.path.join(setup["scratch"], setup["file"]), setup["function"])
    _write_all(answers, frame_bytes({"load_error": error}, []))
    if fn is None:
        return
    _serve(fn, setup["file"], requests, answers, setup["max_answer_bytes"])


def _setup(fd: int) -> dict:
    """The grader's first message: where NumPy and the student's file are, the limits, --unsafe."""
    (n,) = struct.unpack("<I", _read_exact(fd, 4))
    return json.loads(_read_exact(fd, n))


def _serve(fn, path: str, requests: int, answers: int, max_answer: int) -> None:
    """Answer calls until the grader closes the channel."""
    import numpy as np
    while True:
        try:
            header, arrays = parse_frame(lambda n: _read_exact(requests, n), 1 << 40)
        except EOFError:
            return
        args = decode(header["args"], arrays)
        kwargs = decode(header["kwargs"], arrays)
        before = [a.copy() for a in arrays]
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - whatever the student's code raised is their answer
            answer, out = _raised(e, path), []
        else:
            out = []
            try:
                changed = {str(j): encode(a, out) for j, (a, b) in enumerate(zip(arrays, before))
                           if a.shape == b.shape and not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")}
                answer = {"value": encode(value, out, views_of=arrays), "changed": changed}
            except (TypeError, ValueError) as e:
                answer, out = {"unsendable": f"returned {e}"}, []
        size = sum(a.nbytes for a in out)
        if size > max_answer:                       # refused before it is copied into a frame
            answer, out = {"unsendable": f"returned {size / 2**20:,.0f} MB of arrays, over the "
                                         f"{max_answer / 2**20:,.0f} MB an answer may hold"}, []
        answer["call"] = header.get("call")
        try:
            data = frame_bytes(answer, out)
        except (TypeError, ValueError) as e:
            data = frame_bytes({"unsendable": f"returned something that is not plain data: {e}",
                                "call": answer["call"]}, [])
        except MemoryError:
            data = frame_bytes({"unsendable": "returned more than fits in memory to send", "call": answer["call"]}, [])
        _write_all(answers, data)


if __name__ == "__main__":
    main()
