"""`pytest lessons/exercises --exercise N` grades exercise N (every exercise without the option)."""


def pytest_addoption(parser):
    parser.addoption("--exercise", default=None, metavar="N",
                     help="grade only exercise N (1, 2, ..., 17.2); default: all of them")


def pytest_generate_tests(metafunc):
    if "exercise_number" in metafunc.fixturenames:
        from minillm.course import EXERCISES
        chosen = metafunc.config.getoption("exercise")
        from minillm.course.cases import exercise_id
        numbers = [exercise_id(chosen)] if chosen is not None else list(EXERCISES)
        metafunc.parametrize("exercise_number", numbers, ids=[f"ex{n}" for n in numbers])
