"""minillm/cuda/__init__.py's table of what runs a checkpoint on the GPU, held against the code that picks
(llm.gpu_path: the model; llm.batching_for: the Engine's runner), on small CPU models: no GPU needed."""
import re

import pytest

import minillm.cuda
from minillm import llm
from minillm.cuda.dev import mla
from minillm.cuda.gpu_mla import GPUMLATransformer
from minillm.cuda.gpu_model import GPUTransformer
from minillm.cuda.selfcheck import random_cpu_model, small_config


def table() -> dict[str, tuple[str, str]]:
    """{checkpoint: (model, runner)}: the first word of each column of the docstring's table."""
    rows = [line.split("|") for line in minillm.cuda.__doc__.splitlines() if line.count("|") == 2]
    assert rows and rows[0][0].strip() == "checkpoint", "the table's header row moved"
    return {first.strip(): (model.split()[0], runner.split()[0]) for first, model, runner in rows[1:]}


def sharded():
    model = random_cpu_model(small_config("gqa"))
    model.comm = object()              # what a tensor-parallel rank's Transformer holds (its communicator)
    return model


# One loaded CPU Transformer per row of the table: what `load` hands llm._to_gpu for such a checkpoint.
CHECKPOINTS = {
    "dense attention (MHA/GQA/MQA), fp16 or bf16": lambda: random_cpu_model(small_config("mqa")),
    "dense, int8/int4 weights or int8 KV cache":
        lambda: random_cpu_model(small_config("gqa"), quant="int8").with_options(kv_cache="int8"),
    "MLA of a shape mla_decode.cu takes": lambda: mla.small_model(mla.small_config()),
    "MLA of another shape (widths % 8 != 0)": lambda: mla.small_model(mla.small_config(r=12)),
    "a tensor-parallel shard (--tp N)": sharded,
}


def test_every_row_of_the_table_has_a_checkpoint_here():
    assert set(table()) == set(CHECKPOINTS)


@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_the_table_names_the_model_gpu_path_picks(checkpoint):
    model, _ = table()[checkpoint]
    assert llm.gpu_path(CHECKPOINTS[checkpoint]()) == model


def bare(path: str, transformer):
    """The object llm._to_gpu would build for `path`, without a device: only what batching_for reads."""
    if path == "GPUTransformer":
        return object.__new__(GPUTransformer)
    if path == "GPUMLATransformer":
        gpu = object.__new__(GPUMLATransformer)
        gpu.prefill_model = transformer          # from_cpu's prefill Transformer over the same arrays
        return gpu
    return transformer                           # device_model: the Transformer itself (its arrays on CuPy)


@pytest.mark.parametrize("checkpoint", sorted(CHECKPOINTS))
def test_the_table_names_the_runner_batching_for_pairs_with_it(checkpoint, monkeypatch):
    from minillm.cuda import gpu_batched
    from minillm.engine import batched
    from minillm.engine.parallel import serving
    for module, name in ((gpu_batched, "GPUBatching"), (batched, "CPUBatching"), (serving, "TPBatching")):
        monkeypatch.setattr(module, name, lambda model, name=name: (name, model))
    transformer = CHECKPOINTS[checkpoint]()
    path = llm.gpu_path(transformer)
    runner, served = llm.batching_for(bare(path, transformer))
    assert runner == table()[checkpoint][1]
    if path == "GPUMLATransformer":          # the Engine runs the MLA model's prefill Transformer
        assert served is transformer


def test_what_the_table_says_is_refused_is_refused_at_load():
    """The line under the table: MoE on cuda is refused before any GPU model is picked."""
    refused = re.search(r"Refused in one line at load: ([^;]*);", " ".join(minillm.cuda.__doc__.split())).group(1)
    assert "mixture-of-experts" in refused
    with pytest.raises(llm.MiniLLMError, match="mixture-of-experts"):
        llm._check_sparse(small_config("gqa", n_experts=4, n_experts_per_token=2), "cuda", False, None)
