"""`pytest lessons/exercises --exercise N` grades exercise N (every exercise without the option)."""


def pytest_addoption(parser):
    parser.addoption("--exercise", type=int, default=None, metavar="N",
                     help="grade only exercise N (1, 2, ...); default: all of them")


def pytest_generate_tests(metafunc):
    if "exercise_number" in metafunc.fixturenames:
        from minillm.course import EXERCISES
        chosen = metafunc.config.getoption("exercise")
        numbers = [chosen] if chosen is not None else sorted(EXERCISES)
        metafunc.parametrize("exercise_number", numbers, ids=[f"ex{n:02d}" for n in numbers])
