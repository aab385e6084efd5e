"""`load(..., quant="int4")` quantizes once: the copy kept beside the weights (checkpoints/quant_cache.py) is
reused while the source files are unchanged, and made again when they change."""
import os

import numpy as np

import minillm
from hf_models import llama_config, save_random_model
from minillm.checkpoints import convert as convert_module, quant_cache
from minillm.checkpoints.convert import convert

IDS = [1, 5, 9, 40, 200, 7]


def test_int4_at_load_is_kept_beside_the_weights_and_reused_until_they_change(tmp_path, monkeypatch, capsys):
    source = tmp_path / "model"
    save_random_model(llama_config(), source)
    calls = []
    real = quant_cache.quantize_checkpoint

    def short(*args, **kwargs):          # 64 calibration tokens, not 2048: what is tested is the keeping
        return real(*args, **kwargs, calibration_tokens=64)

    def counting(*args, **kwargs):
        calls.append(args[2])
        return short(*args, **kwargs)
    monkeypatch.setattr(quant_cache, "quantize_checkpoint", counting)
    monkeypatch.setattr(convert_module, "quantize_checkpoint", short)

    first = minillm.load(str(source), quant="int4", group_size=32).logits(IDS)
    kept = source / ".quantized" / "int4-g32"
    assert calls == ["int4"] and (kept / "source.json").is_file() and (kept / "config.json").is_file()
    assert f"kept the int4 weights in {kept}" in capsys.readouterr().err
    again = minillm.load(str(source), quant="int4", group_size=32).logits(IDS)
    assert calls == ["int4"]                                    # not quantized again
    np.testing.assert_array_equal(again, first)
    # what it keeps is `minillm convert --quant int4`'s checkpoint
    converted = convert(source, tmp_path / "converted", quant="int4", group_size=32, progress=False)
    np.testing.assert_array_equal(minillm.load(str(converted)).logits(IDS), first)

    weights = source / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))     # the source changed
    minillm.load(str(source), quant="int4", group_size=32)
    assert calls == ["int4", "int4"]
    minillm.load(str(source), quant="int4", group_size=64)     # another group size: its own copy
    assert calls == ["int4", "int4", "int4"] and (source / ".quantized" / "int4-g64" / "source.json").is_file()
