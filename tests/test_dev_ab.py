"""python -m minillm.cuda.dev.ab on the CPU: the change it is asked for is a KernelSettings field and value that
KernelSettings accepts, or it says in one line what is wrong (exit 2) before it looks for a GPU."""
import pytest

from minillm.cuda.dev import ab


def test_a_change_is_a_settings_field_and_a_literal_it_accepts():
    assert ab.parse_change('qkv_one_round=("int8", "16-bit")') == {"qkv_one_round": ("int8", "16-bit")}
    assert ab.parse_change("pdl = False") == {"pdl": False}
    for text, says in [("nope=1", "KernelSettings' fields"), ("pdl", "NAME=VALUE"), ("pdl=Fals", "not a Python literal"),
                       ('qkv_one_round=("int4",)', "'int8' and/or '16-bit'")]:
        with pytest.raises(ValueError, match=says):
            ab.parse_change(text)


@pytest.mark.parametrize("argv,says", [(["--set", "nope=1"], "KernelSettings' fields"),
                                       (["--set", "pdl=False", "--formats", "float16,fp4"], "--formats: fp4")])
def test_a_wrong_request_ends_in_one_line(argv, says, capsys):
    assert ab.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err
