"""Exercise 11 (lesson 11): what crosses the bus between the host and the GPU, and how often.

Write `transfer_bytes` below, then check it:
    minillm exercise check 11         (in a clone: pytest lessons/exercises --exercise 11)
The grader compares it with what the engine's GPU path moves (minillm/cuda/gpu_model.py).
"""


def transfer_bytes(config, weight_bytes: int = 2) -> tuple[int, int, int]:
    """Bytes copied between host memory and GPU memory when minillm runs `config` on the GPU.

    config        a model's shape: the fields and properties of a minillm.model.config.ModelConfig
                  (vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, tie_embeddings, ...;
                  config.n_params counts every parameter), as attributes; not its methods
    weight_bytes  bytes per weight of the matrices on the device: 2 for fp16 or bf16

    returns (upload, up_per_token, down_per_token):
      upload          host -> device, once, when GPUTransformer.from_cpu copies the model over: every
                      layer matrix (q, k, v, o, gate, up, down) and the embedding at weight_bytes per
                      weight; the LM head too, unless it is tied to the embedding (then it is the same
                      array and goes once); the RMSNorm gains (two per layer and the final one, dim
                      values each) stay fp32 on the device, 4 bytes a value
      up_per_token    host -> device for one decode step
      down_per_token  device -> host for one decode step
    For the last two, read GPUTransformer.decode: which device array is set from the host, which one is
    fetched back, and their dtypes. An array made on the device (cp.zeros: the KV cache, the activation
    buffers) never crosses the bus.
    """
    raise NotImplementedError("write transfer_bytes: see the docstring")


if __name__ == "__main__":   # `python lessons/exercises/ex11_transfer_bytes.py` grades this file
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.course import check_exercise
    report = check_exercise(11, __file__)
    print(report)
    sys.exit(0 if report.passed else 1)
