"""`minillm convert`: SRC (a .gguf, an HF-layout folder, or a pulled preset's name) -> a minillm weights
folder, with at most one rewrite (FlashNorm's folded gains, or fewer KV heads) besides quantizing.
The steps themselves are the checkpoints layer's (checkpoints/convert.py, checkpoints/kv_heads.py).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

from minillm.checkpoints.convert import convert, convert_flashnorm
from minillm.checkpoints.kv_heads import convert_kv_heads_dir
from minillm.checkpoints.pull import resolve
from minillm.errors import MiniLLMError


def convert_checkpoint(src: str, dst: str, kv_heads: int | None = None, quant: str | None = None,
                       group_size: int = 128, dtype: str | None = None, flashnorm: bool = False,
                       untie: bool = False, force: bool = False) -> str:
    """`minillm convert`: SRC (a .gguf, an HF folder, or a pulled preset's name) -> DST, with at most
    one rewrite besides quantizing; returns what to tell the user. A DST holding files needs `force`."""
    if not Path(src).exists():
        src = str(resolve(src))   # a preset's name -> its weights folder; a missing path is refused as `-m` refuses it
    _check_destination(src, dst, force)
    if untie and not flashnorm:
        raise MiniLLMError("--untie only goes with --flashnorm (it unties the LM head so the final norm folds)")
    if kv_heads is not None and (flashnorm or quant):
        raise MiniLLMError(f"convert --kv-heads first, then --{'flashnorm' if flashnorm else 'quant'} the result")
    if flashnorm:
        report = _user_error(convert_flashnorm, src, dst, untie=untie, dtype=dtype, quant=quant, group_size=group_size)
        return f"{report}\nwrote {dst}"
    if kv_heads is None:
        _user_error(convert, src, dst, dtype=dtype, quant=quant, group_size=group_size)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            source = convert(src, tmp, dtype=dtype) if str(src).endswith(".gguf") else src
            _user_error(convert_kv_heads_dir, source, dst, kv_heads)
    return f"wrote {dst}"


def _check_destination(src: str, dst: str, force: bool) -> None:
    """A folder that already holds files is written into only with --force: a typo must not silently
    replace another model. Writing into SRC itself is refused by each conversion step."""
    out = Path(dst)
    if not force and out.is_dir() and any(out.iterdir()) and out.resolve() != Path(src).resolve():
        raise MiniLLMError(f"{dst} already holds files: pass --force to write over them")


def _user_error(fn, *args, **kwargs):
    """Run a conversion whose ValueErrors are the user's mistakes (bad sizes, bad choices)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        raise MiniLLMError(str(e)) from None
