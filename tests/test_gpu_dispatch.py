"""minillm/cuda/__init__.py's table of what runs a checkpoint on the GPU, held against the code that picks
(llm.gpu_path: the model; llm.batching_for: the Engine's runner), on small CPU models: no GPU needed."""
import dataclasses
from types import SimpleNamespace

import numpy as np
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
    "a piece the kernels lack (gpu_model.py)":      # what load hands over for a Qwen3 (the config is what is read)
        lambda: SimpleNamespace(config=small_config("gqa", qk_norm=True), comm=None),
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


def test_a_config_field_the_kernels_do_not_read_sends_the_model_to_device_model():
    """Every ModelConfig field is read by the kernels (KERNEL_FIELDS), checked against a plain Llama's value
    (PLAIN_LLAMA, the RoPE type, the weight format), inert in a model they run (MLA's fields need attention
    "mla", MoE's need experts), or not the layers' math (stop ids): a field added for a new family lands in one of these or this test fails, so the
    kernels never run a model while leaving out one of its pieces."""
    from minillm.cuda import gpu_model
    mla_only = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"}
    moe_only = {"n_experts_per_token", "moe_ffn_dim", "n_shared_experts", "first_dense_layers", "router",
                "n_expert_groups", "n_groups_per_token", "norm_topk_prob", "routed_scaling_factor", "swiglu_limit",
                "swiglu_alpha"}
    not_math = {"generation_eos_token_ids"}                 # what the engine stops on, not what a layer computes
    known = set(gpu_model.KERNEL_FIELDS) | set(gpu_model.PLAIN_LLAMA) | mla_only | moe_only | not_math
    assert {f.name for f in dataclasses.fields(llm.ModelConfig)} == known
    plain = SimpleNamespace(config=small_config("gqa"), comm=None)
    assert llm.gpu_path(plain) == "GPUTransformer"
    changed = [dict(qkv_bias=True), dict(n_experts=4, n_experts_per_token=2, moe_ffn_dim=64), dict(qk_norm=True),
               dict(sandwich_norms=True), dict(activation="gelu_tanh"), dict(partial_rotary_factor=0.5),
               dict(attention_sinks=True), dict(final_softcap=30.0), dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
               dict(quantization={"method": "mxfp4"})]
    for change in changed:
        model = SimpleNamespace(config=dataclasses.replace(plain.config, **change), comm=None)
        assert llm.gpu_path(model) == "device_model", change
        assert gpu_model.unsupported(model)


def test_mixture_of_experts_and_the_float_formats_are_not_refused_on_cuda_what_is_refused_is():
    """MoE and fp8/NF4/MXFP4 run as device_model now (int8 and fp8 KV caches too: tests/test_device_kv_cache.py);
    that path refuses FlashNorm in one line."""
    from minillm.cuda.device_model import to_device
    llm._check_sparse(small_config("gqa", n_experts=4, n_experts_per_token=2), "cuda", False, "mxfp4")
    model = random_cpu_model(small_config("gqa"))
    model.flashnorm = True                   # what Transformer(flashnorm=True) sets over folded weights
    with pytest.raises(ValueError, match="FlashNorm"):
        to_device(model, xp=np)
