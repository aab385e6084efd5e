"""SmolLM2-135M's real weights cut to fit a machine that gets files only in small pieces (the GPU machine:
64 MiB per upload, no network): the first layers plus the tied embedding, stored narrow, rebuilt there as
an HF-layout dir that tests/test_cuda_quant.py loads through MINILLM_TEST_SMOLLM2.

    python3 tests/smollm2_pieces.py pack weights/smollm2-135m .smollm2/pieces.npz [n_layers]   (here)
    python3 tests/smollm2_pieces.py unpack .smollm2/pieces.npz /tmp/smollm2-cut                 (there)

The whole model (~95 MB this way) is more than one upload: `pack-all` splits it into two pieces by layer
(each under the limit, the tokenizer files inside the first), uploaded by two calls in a row while the
machine stays warm, and `unpack` given both rebuilds all of it:

    python3 tests/smollm2_pieces.py pack-all weights/smollm2-135m .smollm2/a.npz .smollm2/b.npz
    python3 tests/smollm2_pieces.py unpack .smollm2/a.npz,.smollm2/b.npz /tmp/smollm2

Layer matrices travel as int4 in groups of 32 (SmolLM2 comes from a Q4_1 GGUF, whose grid that is: its
weights come back as they were), the embedding as int8 per row (it was Q8_0 in blocks of 32: close, not
exact). Either way both devices then load the same fp32 values, which is all a GPU-vs-CPU check needs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def pack(src: Path, dst: Path, n_layers: int = 6, layers: range | None = None, embedding: bool = True,
         tokenizer: bool = False) -> None:
    """The first `n_layers` layers (the config says that many), or only `layers` of the full config."""
    from minillm.model.quant import quantize_int4, quantize_int8
    from minillm.checkpoints.weights import load_hf_dir
    config, tensors = load_hf_dir(src)
    kept = layers if layers is not None else range(n_layers)
    if layers is None:
        config = config.replace(n_layers=n_layers)
    out = {"config": np.frombuffer(json.dumps(config.to_hf()).encode(), np.uint8)}
    if tokenizer:
        for f in TOKENIZER_FILES:
            if (src / f).exists():
                out["file:" + f] = np.frombuffer((src / f).read_bytes(), np.uint8)
    for name, a in tensors.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) not in kept:
            continue
        if not name.startswith("model.layers.") and not embedding:
            continue
        a = np.asarray(a, np.float32)
        if name == "model.embed_tokens.weight":
            q = quantize_int8(a)
            out |= {name + ".i8": q.qweight, name + ".scales": q.scales}
        elif a.ndim == 2:
            q = quantize_int4(a, 32)
            out |= {name + ".i4": q.qweight, name + ".scales": q.scales, name + ".mins": q.mins}
        else:
            out[name] = a
    dst.parent.mkdir(parents=True, exist_ok=True)
    np.savez(dst, **out)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def pack_all(src: Path, first: Path, second: Path) -> None:
    """The whole model in two pieces: embedding, norms, tokenizer and the first half of the layers; the rest."""
    from minillm.model.config import ModelConfig
    n = ModelConfig.from_hf(json.loads((src / "config.json").read_text())).n_layers
    pack(src, first, layers=range(n // 4), tokenizer=True)          # the embedding is ~30% of the bytes
    pack(src, second, layers=range(n // 4, n), embedding=False)


def unpack(srcs: str | Path, dst: Path) -> Path:
    """Rebuild an HF-layout dir from one piece or several (comma-separated paths)."""
    from minillm.model.config import ModelConfig
    from minillm.checkpoints.weights import save_hf_dir
    config, tensors = None, {}
    for src in str(srcs).split(","):
        z = np.load(src)
        config = config or ModelConfig.from_hf(json.loads(z["config"].tobytes()))
        tensors |= _tensors(z, dst)
    return save_hf_dir(dst, config, tensors)


def _tensors(z, dst: Path) -> dict:
    from minillm.model.quant import Int4Weight, Int8Weight
    tensors = {}
    for key in z.files:
        if key.startswith("file:"):
            dst.mkdir(parents=True, exist_ok=True)
            (dst / key[5:]).write_bytes(z[key].tobytes())
            continue
        if key.endswith(".i8"):
            tensors[key[:-3]] = Int8Weight(z[key], z[key[:-3] + ".scales"]).dequantize()
        elif key.endswith(".i4"):
            name = key[:-3]
            cols = z[key].shape[1] * 2
            tensors[name] = Int4Weight(z[key], z[name + ".scales"], z[name + ".mins"], cols).dequantize()
        elif not key.endswith((".scales", ".mins")) and key != "config":
            tensors[key] = z[key]
    return tensors


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    verb, a, b = sys.argv[1:4]
    if verb == "pack":
        pack(Path(a), Path(b), *(int(n) for n in sys.argv[4:5]))
    elif verb == "pack-all":
        pack_all(Path(a), Path(b), Path(sys.argv[4]))
    else:
        print(unpack(Path(a), Path(b)))
