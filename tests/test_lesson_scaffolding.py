"""Every lesson opens with its ABOUT (prerequisites, objectives, study time, check questions, knobs to try),
and `minillm lesson N --about` prints it without running the lesson."""
import re

import pytest
from click.testing import CliRunner

from minillm.cli import cli
from minillm.course import lessons
from minillm.course.lessons import ABOUT_FIELDS, format_about, lesson_about, list_lessons
from minillm.errors import MiniLLMError

LESSONS = list_lessons()


@pytest.mark.parametrize("lesson", LESSONS, ids=[l.path.stem for l in LESSONS])
def test_every_lesson_has_its_about(lesson):
    about = lesson_about(lesson)
    assert set(about) == set(ABOUT_FIELDS)
    assert isinstance(about["study_time"], str) and re.search(r"\d+ min", about["study_time"])
    assert 2 <= len(about["check_questions"]) <= 3 and all(q.endswith("?") for q in about["check_questions"])
    for key in ("prerequisites", "objectives", "try_this"):
        assert about[key] and all(isinstance(item, str) and item for item in about[key]), key
    # a prerequisite names lessons that exist, never the lesson itself
    numbers = {l.number for l in LESSONS}
    for item in about["prerequisites"]:
        for cited in re.findall(r"lessons? (\d\d)(?: and (\d\d))?", item):
            for n in filter(None, cited):
                assert int(n) in numbers and int(n) != lesson.number, (lesson.number, item)


def test_about_prints_the_fields_without_running_the_lesson(monkeypatch):
    monkeypatch.setattr(lessons, "run_lesson", lambda *a, **k: pytest.fail("--about ran the lesson"))
    result = CliRunner().invoke(cli, ["lesson", "5", "--about"])
    assert result.exit_code == 0, result.output
    about = lesson_about(lessons.find_lesson(5))
    assert result.output.startswith("Lesson 05")
    for heading in ABOUT_FIELDS.values():
        assert heading in result.output
    assert about["check_questions"][0] in result.output and about["try_this"][-1] in result.output
    assert result.output.strip() == format_about(lessons.find_lesson(5))


def test_a_lesson_without_about_is_one_line_and_a_nonzero_exit(tmp_path, monkeypatch):
    (tmp_path / "01_bare.py").write_text('"""Lesson 01 — bare."""\nprint("ran")\n')
    (tmp_path / "02_short.py").write_text('"""Lesson 02 — short."""\nABOUT = {"prerequisites": ["x"], '
                                          '"objectives": ["y"], "study_time": "5 min", '
                                          '"check_questions": ["one?"], "try_this": ["z"]}\n')
    monkeypatch.setattr(lessons, "LESSONS_DIR", tmp_path)
    with pytest.raises(MiniLLMError, match="has no module-level ABOUT"):
        lesson_about(lessons.find_lesson(1))
    with pytest.raises(MiniLLMError, match="1 check questions"):
        lesson_about(lessons.find_lesson(2))
    result = CliRunner().invoke(cli, ["lesson", "1", "--about"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "ABOUT" in result.stderr
