"""Grades the student's exercise files against the engine (run: pytest lessons/exercises --exercise N)."""
from minillm.course import check_exercise


def test_exercise(exercise_number):
    report = check_exercise(exercise_number)
    assert report.passed, "\n" + str(report)
