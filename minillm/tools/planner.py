"""`minillm plan`: will this model fit on that GPU, for how many users, how fast, at what cost?

The capacity math of LLM serving, written out (1 GB = 1e9 bytes throughout):

    weights  = parameters × bytes per parameter (+ quantization scales)
    KV/token = 2 (K and V) × n_layers × n_kv_heads × head_dim × bytes per value (+ scales)
    KV/user  = KV/token × context
    budget   = GPU memory − weights − reserve (activations, workspace, CUDA context)
    users    = ⌊budget / KV/user⌋                 or   context = ⌊budget / (users × KV/token)⌋

Decode roofline ("the scaling book" inference chapter): one batched decode step produces one token
for every user. It must read all weights once plus every user's KV cache, and do 2 FLOPs per
parameter per user (one multiply-add):

    step = max((weights + users × KV/user) / bandwidth,  2 × params × users / FLOP/s)

Assumptions, all optimistic or conservative in a known direction:
- every user sits at the full context (the last step of the conversation: the most KV to read);
- peak spec-sheet bandwidth and dense bf16 FLOP/s (real kernels reach ~70–90% of bandwidth);
- attention FLOPs (4 × n_layers × n_heads × head_dim × context per token) and the embedding lookup
  being a gather, not a matmul, are ignored: decode is memory-bound long before they matter;
- the KV cache holds every position (minillm's cache does; a sliding-window model such as Mistral
  could cap it at the window with a rolling buffer, which this planner does not assume).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from minillm.model.config import PRESETS, ModelConfig
from minillm.errors import MiniLLMError
from minillm.resources import install_hint

GB = 1e9
DEFAULT_GPU = "h100"
DEFAULT_CONTEXT = 4096
DEFAULT_RESERVE = 0.10   # fraction of GPU memory kept for activations, workspace and the CUDA context


class PlanError(MiniLLMError, ValueError):
    """A bad planner input (unknown GPU, dtype or value): one line; the CLI prints it and exits 1."""


# ---- GPUs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    bandwidth: float          # bytes/s of HBM/GDDR, peak
    bf16_flops: float         # dense bf16 tensor-core FLOP/s (spec sheets quote 2× "with sparsity")
    price_per_hour: float     # $/GPU-hour, a default to override: cloud prices vary 2–3× by provider
    aliases: tuple[str, ...] = ()
    price_source: str = ""    # where price_per_hour comes from (PRICE_SOURCES)


# Spec numbers from NVIDIA's datasheets (H100 SXM5, H200 SXM, A100 80GB SXM, L40S, A40, L4, RTX PRO 6000
# Blackwell Server Edition, HGX/DGX B200 per GPU; RTX 6000 Ada from its datasheet and the Ada whitepaper),
# halving the "with sparsity" tensor FLOP/s to get dense (RTX PRO 6000: its sparse FP4 figure / 8). Memory is
# read as decimal GB ("80 GB" = 80e9 bytes): a little under what the device has, the safe side to err on.
# Prices are one provider's published rates per GPU-hour; any other provider's differ by 2–3×: override them
# (`minillm plan --prices h100=2.1,l4=0.5`, or `--price` for one GPU).
PRICE_SOURCES = {
    "runpod": "RunPod Serverless 'active worker' price per second × 3600 (docs.runpod.io/serverless/pricing, "
              "read 2026-12-01)",
    "runpod-pod": "RunPod on-demand pod rate as tabulated by deploybase.ai, 'RunPod GPU Pricing', 2026-03-10 "
                  "(the serverless table does not list this card)",
    "2024": "a rough 2024–25 on-demand cloud rate (no current listing found)",
}
GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("H100-80GB-SXM", 80 * GB, 3.35e12, 989.4e12, 3.35, ("h100", "h100-80gb", "h100-sxm", "h100-sxm5"), "runpod"),
    GPU("H200-SXM", 141 * GB, 4.8e12, 989.4e12, 4.46, ("h200", "h200-141gb", "h200-sxm"), "runpod"),
    GPU("B200", 180 * GB, 8.0e12, 2250e12, 6.84, ("b200", "b200-180gb", "hgx-b200"), "runpod"),
    GPU("A100-80GB-SXM", 80 * GB, 2.039e12, 312e12, 2.16, ("a100", "a100-80gb", "a100-sxm", "a100-sxm4"), "runpod"),
    GPU("L40S", 48 * GB, 864e9, 362e12, 1.33, ("l40s", "l40s-48gb"), "runpod"),
    GPU("A40", 48 * GB, 696e9, 149.7e12, 0.86, ("a40", "a40-48gb"), "runpod"),
    GPU("RTX-PRO-6000-Blackwell", 96 * GB, 1.792e12, 500e12, 1.57,
        ("rtx-pro-6000", "rtx-pro-6000-blackwell", "rtx6000-pro", "pro-6000"), "runpod-pod"),
    GPU("L4", 24 * GB, 300e9, 121e12, 0.47, ("l4", "l4-24gb"), "runpod"),
    GPU("RTX-6000-Ada", 48 * GB, 960e9, 364.2e12, 1.00, ("rtx-6000-ada", "rtx6000-ada", "6000-ada"), "2024"),
]}


def _squash(name: str) -> str:
    """'H100 80GB', 'h100-80gb' and 'h100_80GB' all become 'h10080gb'."""
    return "".join(ch for ch in name.lower() if ch.isalnum())


def find_gpu(name: str) -> GPU:
    """A GPU from the table by name or alias, ignoring case, spaces, '-' and '_'."""
    for gpu in GPUS.values():
        if _squash(name) in {_squash(n) for n in (gpu.name, *gpu.aliases)}:
            return gpu
    raise PlanError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


# ---- precisions ---------------------------------------------------------------------------------
WEIGHT_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4", "fp8", "nf4", "mxfp4")
KV_DTYPES = ("fp32", "fp16", "bf16", "int8")
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
                  "bfloat16": "bf16", "q8": "int8", "q4": "int4"}
FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
SCALE_BYTES = 2           # every quantization scale is one fp16
INT4_GROUP = 128          # int4 is group-wise: one scale per 128 consecutive weights of a row
# The float formats (model/formats.py) as minillm stores them: bytes a weight, and (scale bytes, weights a scale)
# per row: fp8 one fp32 per row, NF4 one fp32 absmax per 64, MXFP4 one E8M0 byte per 32.
FORMAT_BYTES = {"fp8": (1.0, 4, None), "nf4": (0.5, 4, 64), "mxfp4": (0.5, 1, 32)}


def dtype_name(name: str, allowed: tuple[str, ...], what: str) -> str:
    """Normalize 'bfloat16' -> 'bf16' etc.; PlanError if `allowed` lacks it."""
    key = _DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in allowed:
        raise PlanError(f"unknown {what} dtype {name!r}; choose one of {', '.join(allowed)}")
    return key


def _is_mla(c: ModelConfig) -> bool:
    return getattr(c, "attention", "gqa") == "mla"


def _layer_matrices(c: ModelConfig, i: int, experts: int | None = None) -> list[tuple[int, int]]:
    """Layer i's linear weights: a dense layer's, or attention + `experts` routed experts (default all)
    + the shared ones of an MoE layer (its router stays 16-bit, counted with the rest)."""
    if not getattr(c, "n_experts", 0) or not c.is_moe_layer(i):
        return _block_matrices(c)
    attention = _block_matrices(c)[:-3]
    width = c.moe_ffn_dim
    expert = [(width, c.dim), (width, c.dim), (c.dim, width)]
    shared = [(width * c.n_shared_experts, c.dim)] * 2 + [(c.dim, width * c.n_shared_experts)] if c.n_shared_experts else []
    return attention + expert * (c.n_experts if experts is None else experts) + shared


def _block_matrices(c: ModelConfig) -> list[tuple[int, int]]:
    """(rows, cols) of one layer's linear weights in HF [out, in] layout: attention, then gate, up, down."""
    mlp = [(c.ffn_dim, c.dim), (c.ffn_dim, c.dim), (c.dim, c.ffn_dim)]
    q = c.n_heads * c.head_dim
    if _is_mla(c):   # DeepSeek MLA (mla.py): low-rank q, down to the latent + rope key, latent up to k_nope and v
        q_proj = [(c.q_lora_rank, c.dim), (q, c.q_lora_rank)] if c.q_lora_rank else [(q, c.dim)]
        return q_proj + [(c.kv_lora_rank + c.qk_rope_head_dim, c.dim),
                         (c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                         (c.dim, c.n_heads * c.v_head_dim)] + mlp
    kv = c.n_kv_heads * c.head_dim
    return [(q, c.dim), (kv, c.dim), (kv, c.dim), (c.dim, q)] + mlp


def weight_bytes(c: ModelConfig, dtype: str) -> int:
    """Bytes of all weights at `dtype`.

    Floats: every parameter at that width. int8/int4 quantize the layers' linear weights only, as
    GPTQ/AWQ/bitsandbytes do; embeddings, the LM head and norms stay 16-bit. int8 is per output
    channel (one fp16 scale per row); int4 is group-wise (one fp16 scale per 128 weights of a row,
    i.e. +0.125 bits/weight; add another 2 bytes/group if your format stores a zero point too).
    """
    return _bytes(c, dtype, None, c.n_params)


def _bytes(c: ModelConfig, dtype: str, experts: int | None, n_params: int) -> int:
    """weight_bytes with `experts` routed experts a MoE layer (None: all) and n_params counted."""
    if dtype in FLOAT_BYTES:
        return n_params * FLOAT_BYTES[dtype]
    matrices = [m for i in range(c.n_layers) for m in _layer_matrices(c, i, experts)]
    linear = sum(rows * cols for rows, cols in matrices)
    if dtype in FORMAT_BYTES:   # fp8 / nf4 / mxfp4: (bytes a weight, bytes a scale, weights a scale or per row)
        if _ships_experts_only(c, dtype):    # GPT-OSS's MXFP4 release: the experts only, attention stays 16-bit
            attention = len(_block_matrices(c)) - 3
            matrices = [m for i in range(c.n_layers) for m in _layer_matrices(c, i, experts)[attention:]]
            linear = sum(rows * cols for rows, cols in matrices)
        per_weight, per_scale, block = FORMAT_BYTES[dtype]
        scales = sum(rows * (1 if block is None else math.ceil(cols / block)) for rows, cols in matrices)
        return int(linear * per_weight) + scales * per_scale + (n_params - linear) * 2
    if dtype == "int8":
        values, scales = linear, sum(rows for rows, _ in matrices)
    else:  # int4: two weights a byte
        values = linear // 2
        scales = sum(rows * math.ceil(cols / INT4_GROUP) for rows, cols in matrices)
    return values + scales * SCALE_BYTES + (n_params - linear) * 2


def weights_read_per_step(c: ModelConfig, dtype: str, users: int) -> int:
    """Bytes of weights one decode step reads for `users` tokens. Dense: all of them. MoE: all but the
    routed experts, and of those the ones some token picked, E·(1 - (1 - k/E)^users) a layer if the
    router spreads tokens uniformly (memory still holds every expert: weight_bytes)."""
    if not getattr(c, "n_experts", 0):
        return weight_bytes(c, dtype)
    touched = c.n_experts * (1 - (1 - c.n_experts_per_token / c.n_experts) ** max(users, 1))
    none = _bytes(c, dtype, 0, c._params(0))                       # everything but the routed experts
    every = weight_bytes(c, dtype)
    return int(none + (every - none) * touched / c.n_experts)


def kv_bytes_per_token(c: ModelConfig, dtype: str) -> int:
    """KV-cache bytes per token. int8 adds one fp16 scale per cached vector per token: per layer, per
    K/V, per KV head (per-token-per-head quantization), i.e. +2 bytes per head_dim values; an MLA
    layer caches one vector a token (the latent with its rope key), so one scale."""
    if dtype in FLOAT_BYTES:
        return c.kv_bytes_per_token(FLOAT_BYTES[dtype])
    vectors_per_layer = 1 if _is_mla(c) else 2 * c.n_kv_heads
    return c.kv_bytes_per_token(1) + c.n_layers * vectors_per_layer * SCALE_BYTES


# ---- the plan -----------------------------------------------------------------------------------
@dataclass
class Plan:
    """Every number of a capacity plan; `format_plan` prints it."""
    model: str
    config: ModelConfig
    gpu: GPU
    weight_dtype: str
    kv_dtype: str
    mode: str                   # "max-users" (users solved at `context`) or "max-context" (users given)
    context: int                # tokens per user the throughput is evaluated at
    users: int                  # concurrent users the throughput is evaluated at; 0 = does not fit
    max_users: int              # at `context`
    max_context: int | None     # at `users_asked` (max-context mode only)
    users_asked: int | None     # the `users` argument: None in max-users mode
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_user: int      # at `context`
    reserve_bytes: float
    kv_budget_bytes: float      # memory − weights − reserve, never below 0
    step_bytes: float           # bytes one decode step reads: weights + users × KV/user
    memory_time_s: float        # step_bytes / bandwidth
    compute_time_s: float       # 2 × params × users / FLOP/s
    tok_s_per_user: float
    tok_s_total: float
    price_per_hour: float
    cost_per_million: float | None   # $ per 1M output tokens; None when nothing runs
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.users > 0

    @property
    def step_time_s(self) -> float:
        return max(self.memory_time_s, self.compute_time_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time_s > self.memory_time_s else "memory"


def resolve_model(model: str | Path | ModelConfig) -> tuple[str, ModelConfig]:
    """A preset name, a folder holding config.json, or a ModelConfig -> (display name, config)."""
    if isinstance(model, ModelConfig):
        return "custom", model
    if str(model) in PRESETS:
        return str(model), PRESETS[str(model)].config
    if str(model) in PLANNER_ONLY:
        return str(model), PLANNER_ONLY[str(model)]
    if Path(model).is_dir():
        from minillm.checkpoints.weights import read_config
        try:
            return Path(model).name, read_config(model)
        except MiniLLMError as e:
            raise PlanError(str(e)) from None
    raise PlanError(f"unknown model {str(model)!r}: not a preset ({', '.join(PRESETS)}) nor a folder with config.json")


def _ships_experts_only(c: ModelConfig, dtype: str) -> bool:
    q = c.quantization or {}
    return bool(q.get("experts_only")) and q.get("method") == dtype


def _config_file(name: str) -> ModelConfig:
    """A real checkpoint's config.json kept as data (minillm/tools/data), read as a checkpoint's is."""
    from minillm.checkpoints.hf_quantized import translate_config
    return ModelConfig.from_hf(translate_config(json.loads((Path(__file__).parent / "data" / name).read_text())))


# Shapes the planner knows without a preset. GPT-OSS-120B (the inference workshop's example: ~240 GB
# bf16, ~120 GB fp8, ~65 GB MXFP4, its experts stored MXFP4 as shipped): its own config.json, 36 layers
# of 128 experts (top-4) of width 2880, GQA 64/8 heads of 64, biases and attention sinks counted.
PLANNER_ONLY = {"gpt-oss-120b": _config_file("gpt-oss-120b.config.json")}


def reserve_bytes(reserve: float, memory_bytes: float) -> float:
    """`reserve` below 1 is a fraction of GPU memory, 1 or more is bytes."""
    _check(reserve >= 0, f"reserve must be >= 0, got {reserve}")
    return reserve * memory_bytes if reserve < 1 else float(reserve)


def plan(model: str | Path | ModelConfig, gpu: str | GPU = DEFAULT_GPU, weight_dtype: str = "bf16",
         kv_dtype: str | None = None, context: int = DEFAULT_CONTEXT, users: int | None = None,
         reserve: float = DEFAULT_RESERVE, price_per_hour: float | None = None) -> Plan:
    """Plan serving `model` on one `gpu`: max users at `context`, or, given `users`, the max context.

    kv_dtype None means the weights' dtype if that is a float, else fp16. A model that does not fit
    is a plan with users = 0 and a note saying why, not an error.
    """
    name, c = resolve_model(model)
    gpu = gpu if isinstance(gpu, GPU) else find_gpu(gpu)
    weight_dtype = dtype_name(weight_dtype, WEIGHT_DTYPES, "weight")
    kv_dtype = dtype_name(kv_dtype or (weight_dtype if weight_dtype in FLOAT_BYTES else "fp16"), KV_DTYPES, "KV")
    _check(context > 0, f"context must be positive, got {context}")
    _check(users is None or users > 0, f"users must be positive, got {users}")
    _check(price_per_hour is None or price_per_hour >= 0, f"price must be >= 0, got {price_per_hour}")
    price = gpu.price_per_hour if price_per_hour is None else price_per_hour

    weights = weight_bytes(c, weight_dtype)
    reserved = reserve_bytes(reserve, gpu.memory_bytes)
    budget = max(0.0, gpu.memory_bytes - weights - reserved)
    per_token = kv_bytes_per_token(c, kv_dtype)
    notes = []

    mode, max_context = "max-users", None
    if users is not None:   # solve for context; evaluate at the asked context if all users fit there
        mode, max_context = "max-context", min(int(budget // (per_token * users)), c.max_seq_len)
        if 0 < max_context < context:
            notes.append(f"{users} users fit only {max_context:,} tokens each: throughput is shown there")
            context = max_context
    max_users = int(budget // (per_token * context))
    n_users = max_users if users is None else users
    if c.max_seq_len < context:
        notes.append(f"context {context:,} is beyond the model's {c.max_seq_len:,} trained positions")
    if weights + reserved > gpu.memory_bytes:
        notes.append(f"does not fit: weights {weights / GB:.2f} GB + reserve {reserved / GB:.2f} GB exceed "
                     f"{gpu.memory_bytes / GB:.0f} GB; try --dtype int8/int4 or a bigger GPU")
        n_users = 0
    elif n_users == 0 or max_context == 0:
        notes.append(f"does not fit: not one user's {context:,}-token KV cache fits in the "
                     f"{budget / GB:.2f} GB left; shorten the context or quantize")
        n_users = 0

    read = weights_read_per_step(c, weight_dtype, n_users)         # MoE: the experts the batch touches
    active = getattr(c, "n_active_params", c.n_params)
    step_bytes, memory_s, compute_s = decode_roofline(read, per_token * context, n_users, active, gpu)
    if getattr(c, "n_experts", 0):
        notes.append(f"MoE: memory holds all {c.n_experts} experts a layer ({weights / GB:.2f} GB); a decode step "
                     f"reads the ones its {max(n_users, 1)} token(s) picked ({read / GB:.2f} GB) and computes "
                     f"with the active {active / 1e9:.2f} B parameters")
    tok_s_total = n_users / max(memory_s, compute_s)
    cost = price / (tok_s_total * 3600) * 1e6 if tok_s_total else None   # $/h ÷ tokens/h × 1e6
    return Plan(name, c, gpu, weight_dtype, kv_dtype, mode, context, n_users, max_users, max_context, users,
                weights, per_token, per_token * context, reserved, budget, step_bytes, memory_s, compute_s,
                tok_s_total / n_users if n_users else 0.0, tok_s_total, price, cost, notes)


def decode_roofline(weights_bytes: float, kv_bytes_per_user: float, users: int, n_params: int,
                    gpu: GPU) -> tuple[float, float, float]:
    """One batched decode step (a token for each user) -> (bytes read, memory time s, compute time s).

    The step reads every weight once, shared by the batch, and each user's own KV cache; it does one
    multiply-add (2 FLOPs) per parameter per user. The step takes the larger of the two times.
    """
    step_bytes = weights_bytes + users * kv_bytes_per_user        # bytes
    return step_bytes, step_bytes / gpu.bandwidth, 2 * n_params * users / gpu.bf16_flops


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message)


# ---- the table ----------------------------------------------------------------------------------
def format_plan(p: Plan, ep: int = 8) -> str:
    """A two-column table of the plan, in GB, tok/s and $ (MoE: with experts split over `ep` GPUs)."""
    g, c = p.gpu, p.config
    users_row = (("max users", f"{p.users:,} at {p.context:,} tokens each") if p.mode == "max-users" else
                 ("max context", f"{p.max_context:,} tokens at {p.users_asked:,} users"
                  + (" (the model's limit)" if p.max_context == c.max_seq_len else "")))
    rows = [
        ("model", f"{p.model}: {c.n_params / 1e9:.2f} B params, {c.n_layers} layers, "
                  f"{c.n_kv_heads} KV heads x {c.head_dim}"),
        ("GPU", f"{g.name}: {g.memory_bytes / GB:.0f} GB, {g.bandwidth / 1e12:.2f} TB/s, "
                f"{g.bf16_flops / 1e12:.0f} TFLOP/s bf16, ${p.price_per_hour:.2f}/h"),
        ("precision", f"weights {p.weight_dtype}, KV cache {p.kv_dtype}"),
        ("weights", f"{p.weights_bytes / GB:.2f} GB"),
        ("KV per token", f"{p.kv_bytes_per_token:,} bytes"),
        ("KV per user", f"{p.kv_bytes_per_user / GB:.3f} GB at {p.context:,} tokens"),
        ("reserve", f"{p.reserve_bytes / GB:.2f} GB (activations, workspace)"),
        ("KV budget", f"{p.kv_budget_bytes / GB:.2f} GB (memory - weights - reserve)"),
        users_row,
    ]
    if p.mode == "max-context":
        rows.append(("max users", f"{p.max_users:,} at {p.context:,} tokens"))
    if p.fits:
        rows += [
            ("decode step", f"{p.step_time_s * 1e3:.2f} ms, {p.bound}-bound "
                            f"({p.step_bytes / GB:.2f} GB read: {p.memory_time_s * 1e3:.2f} ms; "
                            f"compute {p.compute_time_s * 1e3:.2f} ms)"),
            ("tok/s per user", f"{p.tok_s_per_user:,.1f}"),
            ("tok/s total", f"{p.tok_s_total:,.0f}"),
            ("cost", f"${p.cost_per_million:.3f} per 1M output tokens" if p.cost_per_million is not None
                     else "n/a"),
        ]
    if getattr(c, "n_experts", 0):
        rows += expert_parallel_rows(c, p.weight_dtype, (ep,))
    rows += [("note", n) for n in p.notes]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---- plots --------------------------------------------------------------------------------------
def plot_plan(p: Plan, directory: str | Path, user_counts: tuple[int, ...] = (1, 8, 32, 128)) -> list[Path]:
    """Write kv_memory_vs_context.png and max_users_vs_context.png into `directory`; return their paths."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlanError(f"plotting needs matplotlib: {install_hint('lessons')}") from None
    import numpy as np

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    contexts = np.unique(np.geomspace(128, max(p.config.max_seq_len, p.context, 256), 200).astype(int))
    title = f"{p.model} on {p.gpu.name}, weights {p.weight_dtype}, KV {p.kv_dtype}"

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for n in user_counts:
        ax.plot(contexts, n * p.kv_bytes_per_token * contexts / GB, label=f"{n} user{'s' * (n > 1)}")
    if p.kv_budget_bytes > 0:   # a log axis has no 0: a model that does not fit gets no line
        ax.axhline(p.kv_budget_bytes / GB, color="k", linestyle="--", label="KV budget (memory - weights - reserve)")
    _finish(ax, title, "KV cache (GB)")
    kv_png = _save(fig, FigureCanvasAgg, directory / "kv_memory_vs_context.png")

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    max_users = p.kv_budget_bytes // (p.kv_bytes_per_token * contexts)
    ax.plot(contexts, np.where(max_users > 0, max_users, np.nan), label="max users (memory limit)")
    if p.fits:
        ax.plot([p.context], [p.users], "o", label=f"this plan: {p.users} users at {p.context:,}")
    if p.mode == "max-context" and p.max_context:
        ax.plot([p.max_context], [p.users_asked], "s",
                label=f"max context at {p.users_asked} users: {p.max_context:,}")
    if not (max_users > 0).any():   # nothing to put on a log axis: say so on the chart
        ax.text(0.5, 0.5, "no user fits at any context", transform=ax.transAxes, ha="center")
    _finish(ax, title, "max concurrent users", log_y=bool((max_users > 0).any()))
    users_png = _save(fig, FigureCanvasAgg, directory / "max_users_vs_context.png")
    return [kv_png, users_png]


def expert_parallel_rows(c: ModelConfig, dtype: str, ranks: tuple[int, ...] = (8,)) -> list[tuple[str, str]]:
    """Expert parallelism beside tensor parallelism: the experts split over `ranks` GPUs, attention
    replicated. Each token's hidden state (dim values, bf16) goes to the ranks of its k experts and
    comes back: per MoE layer 2 · k · dim · 2 bytes, (n-1)/n of it off the GPU (uniform routing)."""
    rows = []
    for n in ranks:
        experts = -(-c.n_experts // n)
        per_layer = 2 * c.n_experts_per_token * c.dim * 2 * (n - 1) / n                 # bytes a token
        expert_bytes = (weight_bytes(c, dtype) - _bytes(c, dtype, 0, c._params(0))) / n
        rows.append((f"expert parallel {n}", f"{experts} experts a GPU ({expert_bytes / GB:.2f} GB of experts each); "
                     f"all-to-all {per_layer * c.n_moe_layers / 1e3:,.1f} KB a token "
                     f"({per_layer / 1e3:.1f} KB x {c.n_moe_layers} MoE layers, dispatch + combine)"))
    return rows


def _finish(ax, title: str, ylabel: str, log_y: bool = True) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log" if log_y else "linear")
    ax.set_xlabel("context (tokens per user)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig, canvas_cls, path: Path) -> Path:
    canvas_cls(fig)            # Agg: no display needed, no global pyplot state
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


# ---- which GPU, at what cost: the workshop's workflow --------------------------------------------
@dataclass
class Ranked:
    """One GPU's answer to "serve this model at this latency per token, to at least this batch"."""
    gpu: GPU
    price_per_hour: float
    plan: Plan | None           # at the largest batch that meets the target; None when none does
    reason: str = ""            # why not, when plan is None

    @property
    def cost_per_million(self) -> float | None:
        return self.plan.cost_per_million if self.plan is not None else None


def parse_prices(text: str | None) -> dict[str, float]:
    """'h100=2.1,l4=0.5' -> {GPU name: $/h}; names as find_gpu takes them."""
    prices = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        _check(bool(sep) and math.isfinite(price) and price >= 0,
               f"price {item.strip()!r}: write GPU=DOLLARS_PER_HOUR, e.g. h100=2.1")
        prices[find_gpu(name.strip()).name] = price
    return prices


def rank_gpus(model: str | Path | ModelConfig, latency_ms: float, min_batch: int = 1, weight_dtype: str = "bf16",
              kv_dtype: str | None = None, context: int = DEFAULT_CONTEXT, reserve: float = DEFAULT_RESERVE,
              prices: dict[str, float] | None = None, gpus: list[GPU] | None = None) -> list[Ranked]:
    """Every GPU (or `gpus`) that decodes `model` at <= latency_ms per token for at least `min_batch` users at
    `context`, at the largest such batch (the cheapest tokens), cheapest per 1M output tokens first; then
    the GPUs that cannot, each with its reason. A decode step's time grows with the batch, so the batch
    that just meets the target is found by bisection."""
    _check(latency_ms > 0, f"the latency target must be positive, got {latency_ms} ms")
    _check(min_batch >= 1, f"the minimum batch must be >= 1, got {min_batch}")
    prices = prices or {}
    rows = []
    for gpu in gpus or list(GPUS.values()):
        price = prices.get(gpu.name, gpu.price_per_hour)
        one = plan(model, gpu, weight_dtype, kv_dtype, context, reserve=reserve, price_per_hour=price)
        if one.max_users < min_batch or one.weights_bytes + one.reserve_bytes > gpu.memory_bytes:
            rows.append(Ranked(gpu, price, None, f"memory holds {max(one.max_users, 0):,} users at {context:,} "
                                                 f"tokens (< {min_batch})"))
            continue
        at = lambda users: plan(model, gpu, weight_dtype, kv_dtype, context, users, reserve, price)
        low, high = min_batch, one.max_users
        if at(low).step_time_s * 1e3 > latency_ms:
            rows.append(Ranked(gpu, price, None, f"{at(low).step_time_s * 1e3:.1f} ms a token at batch {min_batch} "
                                                 f"(> {latency_ms:g} ms)"))
            continue
        while low < high:                      # the largest batch whose step still meets the target
            mid = (low + high + 1) // 2
            low, high = (mid, high) if at(mid).step_time_s * 1e3 <= latency_ms else (low, mid - 1)
        rows.append(Ranked(gpu, price, at(low)))
    met = sorted((r for r in rows if r.plan is not None), key=lambda r: r.cost_per_million)
    return met + [r for r in rows if r.plan is None]


def format_ranking(rows: list[Ranked], latency_ms: float, min_batch: int) -> str:
    """The ranking as a table, with the price sources under it."""
    if not rows:
        return "no GPU to rank"
    p0 = next((r.plan for r in rows if r.plan is not None), None)
    head = ["GPU", "GB", "TB/s", "TFLOP/s", "$/h", "batch", "ms/token", "tok/s", "$/1M out"]
    table = []
    for r in rows:
        g = r.gpu
        cells = [g.name, f"{g.memory_bytes / GB:.0f}", f"{g.bandwidth / 1e12:.2f}", f"{g.bf16_flops / 1e12:.0f}",
                 f"{r.price_per_hour:.2f}"]
        if r.plan is None:
            cells += ["-", "-", "-", f"no: {r.reason}"]
        else:
            q = r.plan
            cells += [f"{q.users:,}", f"{q.step_time_s * 1e3:.1f}", f"{q.tok_s_total:,.0f}", f"{q.cost_per_million:.3f}"]
        table.append(cells)
    # A "no: why" in the last column runs past it rather than widening it for every row.
    widths = [max([len(h)] + [len(row[i]) for row in table if i < len(head) - 1 or not row[i].startswith("no:")])
              for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    where = f"{p0.model}, weights {p0.weight_dtype}, KV {p0.kv_dtype}, {p0.context:,} tokens a user" if p0 else ""
    order = f"({where}), cheapest first:" if p0 is not None else "(none of them does):"
    out = [f"GPUs that decode at <= {latency_ms:g} ms a token for >= {min_batch} users {order}",
           line(head)] + [line(cells) for cells in table]
    sources: dict[str, list[str]] = {}
    for r in rows:
        key = r.gpu.price_source if r.price_per_hour == r.gpu.price_per_hour else "given"
        sources.setdefault(key, []).append(r.gpu.name)
    for key, names in sources.items():
        where = "given on the command line (--prices / --price)" if key == "given" else PRICE_SOURCES.get(key, key)
        out.append(f"$/h of {', '.join(names)}: {where}")
    out.append("override with --prices h100=2.1,l4=0.5 (dollars per GPU-hour)")
    return "\n".join(out)


def plot_ranking(rows: list[Ranked], path: str | Path, latency_ms: float, min_batch: int) -> Path:
    """A bar chart of $ per 1M output tokens for the GPUs that meet the target, labelled with their batch."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlanError(f"plotting needs matplotlib: {install_hint('lessons')}") from None
    met = [r for r in rows if r.plan is not None]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 0.45 * max(len(rows), 3) + 1.2))
    ax = fig.add_subplot()
    names = [r.gpu.name for r in rows][::-1]
    costs = [r.cost_per_million if r.plan is not None else 0.0 for r in rows][::-1]
    bars = ax.barh(names, costs, color=["tab:blue" if c else "lightgray" for c in costs])
    for bar, r in zip(bars, rows[::-1]):
        label = f"  ${r.cost_per_million:.3f}, batch {r.plan.users:,}" if r.plan is not None else "  does not meet it"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    ax.set_xlabel("$ per 1M output tokens")
    model = met[0].plan.model if met else ""
    ax.set_title(f"{model}: <= {latency_ms:g} ms a token, >= {min_batch} users", fontsize=10)
    ax.set_xlim(0, max(costs + [1e-3]) * 1.6)
    return _save(fig, FigureCanvasAgg, path)


def rank_cli(model: str, latency_ms: float, min_batch: int = 1, dtype: str = "bf16", kv_dtype: str | None = None,
             context: int = DEFAULT_CONTEXT, reserve: str | float | None = None, prices: str | None = None,
             price: float | None = None, gpu: str | None = None, png: str | Path | None = None) -> str:
    """`minillm plan --latency-ms T [--min-batch B]`: the ranking table (and with png, the chart)."""
    overrides = parse_prices(prices)
    if price is not None and gpu:               # --price with one --gpu: that GPU's price
        overrides[find_gpu(gpu).name] = price
    rows = rank_gpus(model, latency_ms, min_batch, dtype, kv_dtype, context, parse_reserve(reserve), overrides)
    text = format_ranking(rows, latency_ms, min_batch)
    if png:
        text += f"\nwrote {plot_ranking(rows, png, latency_ms, min_batch)}"
    return text


# ---- the page's calculator (minillm serve's /plan) ------------------------------------------------
class PlannerAPI:
    """What /plan's sliders read through minillm serve's /api/plan: the same `plan` and `rank_gpus` as the
    CLI, their numbers as JSON. The server is handed one (serve may not import tools)."""

    def options(self) -> dict:
        models = list(PRESETS) + list(PLANNER_ONLY)
        gpus = [{"name": g.name, "memory_gb": g.memory_bytes / GB, "bandwidth_tb_s": g.bandwidth / 1e12,
                 "bf16_tflop_s": g.bf16_flops / 1e12, "price_per_hour": g.price_per_hour,
                 "price_source": PRICE_SOURCES.get(g.price_source, "")} for g in GPUS.values()]
        return {"models": models, "gpus": gpus, "weight_dtypes": list(WEIGHT_DTYPES), "kv_dtypes": list(KV_DTYPES),
                "defaults": {"model": "llama-3-8b" if "llama-3-8b" in PRESETS else models[0], "gpu": GPUS[find_gpu(DEFAULT_GPU).name].name,
                             "context": DEFAULT_CONTEXT, "users": 16, "weight_dtype": "bf16", "kv_dtype": "bf16",
                             "latency_ms": 50.0}}

    def plan(self, query: dict) -> dict:
        """query: model, gpu, context, users, weight_dtype, kv_dtype, latency_ms (strings, as in a URL)."""
        q = {"model": "llama-3-8b", "gpu": DEFAULT_GPU, "context": str(DEFAULT_CONTEXT), "users": "16",
             "weight_dtype": "bf16", "kv_dtype": "", "latency_ms": "50"} | query
        context, users, latency = _number(q, "context", int), _number(q, "users", int), _number(q, "latency_ms", float)
        p = plan(q["model"], q["gpu"], q["weight_dtype"], q["kv_dtype"] or None, context, users)
        kv_used = p.users * p.kv_bytes_per_user
        ranking = rank_gpus(q["model"], latency, users, p.weight_dtype, p.kv_dtype, context)
        return {
            "model": p.model, "gpu": p.gpu.name, "weight_dtype": p.weight_dtype, "kv_dtype": p.kv_dtype,
            "context": p.context, "users": p.users, "max_users": p.max_users, "max_context": p.max_context,
            "fits": p.fits, "notes": p.notes,
            "memory_gb": {"total": p.gpu.memory_bytes / GB, "weights": p.weights_bytes / GB, "kv": kv_used / GB,
                          "reserve": p.reserve_bytes / GB,
                          "free": (p.gpu.memory_bytes - p.weights_bytes - p.reserve_bytes - kv_used) / GB},
            "kv_bytes_per_token": p.kv_bytes_per_token,
            "decode": {"step_ms": p.step_time_s * 1e3, "bound": p.bound, "tok_s_per_user": p.tok_s_per_user,
                       "tok_s_total": p.tok_s_total, "meets_latency": p.fits and p.step_time_s * 1e3 <= latency},
            "price_per_hour": p.price_per_hour, "cost_per_million": p.cost_per_million,
            "ranking": [{"gpu": r.gpu.name, "price_per_hour": r.price_per_hour,
                         "batch": r.plan.users if r.plan else None,
                         "step_ms": r.plan.step_time_s * 1e3 if r.plan else None,
                         "cost_per_million": r.cost_per_million, "reason": r.reason} for r in ranking],
            "text": format_plan(p),
        }


def _number(query: dict, key: str, kind):
    try:
        value = kind(query[key])
    except (TypeError, ValueError):
        raise PlanError(f"{key} must be a number, got {query[key]!r}") from None
    _check(math.isfinite(value) and value > 0, f"{key} must be positive, got {query[key]!r}")
    return value


# ---- the command line's one call ----------------------------------------------------------------
def parse_reserve(text: str | float | None) -> float:
    """'10%' -> 0.10, '8GB' -> 8e9, '0.1' -> 0.1 (a fraction), '8e9' -> 8e9 (bytes); None -> default."""
    if text is None:
        return DEFAULT_RESERVE
    s = str(text).strip().lower()
    number, scale = (s[:-1], 0.01) if s.endswith("%") else (s[:-2], GB) if s.endswith("gb") else (s, 1.0)
    try:
        value = float(number) * scale
    except ValueError:
        raise PlanError(f"reserve {text!r}: give a fraction (0.1), a percent (10%) or bytes (8GB)") from None
    _check(not s.endswith("%") or value < 1, f"reserve {text!r}: a percent must be below 100")
    return value


def run_cli(model: str, gpu: str = DEFAULT_GPU, context: int = DEFAULT_CONTEXT, users: int | None = None,
            dtype: str = "bf16", kv_dtype: str | None = None, price: float | None = None,
            plot: str | Path | None = None, reserve: str | float | None = None, ep: int = 8) -> str:
    """`minillm plan`: the text to print (PlanError, a ValueError, on bad input). ep: the expert-parallel
    split shown for MoE models."""
    p = plan(model, gpu, dtype, kv_dtype, context, users, parse_reserve(reserve), price)
    text = format_plan(p, ep)
    if plot:
        text += "".join(f"\nwrote {path}" for path in plot_plan(p, plot))
    return text


def tp_plan(model: str, gpu: str = DEFAULT_GPU, tp: int = 2, pp: int = 1, context: int = DEFAULT_CONTEXT,
            users: int = 1, dtype: str = "bf16", kv_dtype: str | None = None, link: str = "nvlink") -> str:
    """`minillm plan --tp N [--pp M] [--link nvlink|pcie|mpi]`: engine/parallel/cost.py's tensor-parallel
    table for this model and GPU (mpi: this machine's interconnect, measured with 2 local ranks)."""
    from minillm.engine.parallel import cost
    name, c = resolve_model(model)
    g = gpu if isinstance(gpu, GPU) else find_gpu(gpu)
    w = dtype_name(dtype, WEIGHT_DTYPES, "weight")
    kv = dtype_name(kv_dtype or (w if w in FLOAT_BYTES else "fp16"), KV_DTYPES, "KV")
    kv_value = kv_bytes_per_token(c, kv) / c.kv_bytes_per_token(1)          # bytes a cached value, scales included
    if link == "mpi":
        from minillm.engine.parallel.measure import measure_link
        chosen = measure_link()
    else:
        chosen = cost.LINKS[link]
    return cost.plan_text(name, c, g.name, g.memory_bytes, g.bandwidth, tp, pp, context, users,
                          weight_bytes(c, w), kv_value, chosen)
