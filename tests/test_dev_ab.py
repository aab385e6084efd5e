"""python -m minillm.cuda.dev.ab on the CPU: the change it is asked for is a LabSettings field (the shipped tunings and
the lab's choices) and a Python literal, or it says in one line what is wrong (exit 2) before it looks for a GPU."""
import pytest

from minillm.cuda.dev import ab


def test_a_change_is_a_settings_field_and_a_literal_it_accepts():
    assert ab.parse_change("qkv_one_round=False") == {"qkv_one_round": False}
    assert ab.parse_change("pdl = False") == {"pdl": False}
    for text, says in [("nope=1", "LabSettings' fields"), ("pdl", "NAME=VALUE"), ("pdl=Fals", "not a Python literal")]:
        with pytest.raises(ValueError, match=says):
            ab.parse_change(text)


@pytest.mark.parametrize("argv,says", [(["--set", "nope=1"], "LabSettings' fields"),
                                       (["--set", "pdl=False", "--formats", "float16,fp4"], "--formats: fp4")])
def test_a_wrong_request_ends_in_one_line(argv, says, capsys):
    assert ab.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_the_sweep_checks_then_times_each_format_against_its_first_variant(monkeypatch, capsys):
    """decode_ab (dev.ab and dev.pdl) with the GPU parts stood in for: each format's models checked once, timed in
    alternating rounds, and printed with the ratio to the first variant."""
    import sys
    import types
    from argparse import Namespace

    from minillm.cuda import gpu_model, selfcheck

    class Model:
        weight_bytes = 10 ** 9

        def __init__(self, fmt, speed=1.0):
            self.fmt, self.speed = fmt, speed

        def with_settings(self, **change):
            return Model(self.fmt, 1.25)

        def new_cache(self, n):
            return None
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    monkeypatch.setattr(gpu_model.GPUTransformer, "random", staticmethod(lambda cfg, dtype, seed, quant: Model(quant)))
    monkeypatch.setattr(ab, "decode_sweep_setup", lambda quick: (selfcheck.bench_config(True), 4e12, [1, 2, 3]))
    monkeypatch.setattr(ab, "decode_tok_s", lambda model, cache, prompt, n: (100.0 * model.speed, []))
    checked = []
    ab.decode_ab(Namespace(quick=True, rounds=3, new_tokens=8), ["float16", "int4"],
                 lambda gpu: {"off": gpu, "on": gpu.with_settings(pdl=True)},
                 lambda gpu, models, prompt, fmt: checked.append((fmt, list(models))), header="PDL")
    assert checked == [("float16", ["off", "on"]), ("int4", ["off", "on"])]
    out = capsys.readouterr().out
    assert "vs off" in out and out.count("1.250x") == 2 and out.count("1.000x") == 2 and "125.0" in out
