"""A grading run as a teacher posts it: a Markdown report and the same as HTML beside the CSV (points per
student, class statistics per exercise, the seed and the isolation), and Gradescope's results.json per
student (the autograder's format: a score, and a test per exercise with its score, max_score and output)."""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import jinja2

from minillm.course.grading import Gradebook, class_statistics
from minillm.course.registry import EXERCISES


def _tables(book: Gradebook) -> dict:
    """The report's content once, for both renderings."""
    plan = book.plan
    shown = [n for n in EXERCISES if n in plan.points or any(n in s.exercises for s in book.students)]
    students = [[s.student] + [f"{s.exercises[n].score:g} ({s.exercises[n].cell})" if n in s.exercises else "-"
                               for n in shown] + [f"{s.score(plan):g}"] for s in book.students]
    stats = [[r["number"], r["function"], f"{r['points']:g}", f"{r['submitted']}/{len(book.students)}",
              str(r["complete"]), f"{r['mean']:g}", f"{r['median']:g}", r["hardest"] or "-"]
             for r in class_statistics(book)]
    return dict(
        title="Grades",
        facts=[f"{len(book.students)} student{'s' if len(book.students) != 1 else ''}, graded "
               f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
               f"points: {sum(plan.points.values()):g} in all; an exercise earns its points times the fraction "
               f"of its cases passed",
               f"hidden cases drawn with --seed {plan.seed} (`minillm exercise grade ... --seed {plan.seed}` "
               f"grades on the same cases)",
               f"isolation of the students' code: {plan.isolation}"],
        warning=("NOT ISOLATED: graded with --unsafe, so a submission could read files (the solutions) and "
                 "reach the network while it ran; the verdicts were still computed by the grader."
                 if plan.unsafe else ""),
        student_header=["student"] + shown + [f"points (of {sum(plan.points.values()):g})"],
        students=students,
        stats_header=["exercise", "function", "points", "submitted", "all cases pass", "mean points",
                      "median points", "case failed most"],
        stats=stats)


def markdown_report(book: Gradebook) -> str:
    t = _tables(book)

    def table(header, rows):
        cell = lambda s: str(s).replace("|", "\\|")
        return "\n".join(["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])
    parts = [f"# {t['title']}", ""] + [f"- {fact}" for fact in t["facts"]]
    if t["warning"]:
        parts += ["", f"**{t['warning']}**"]
    parts += ["", "## Students", "", table(t["student_header"], t["students"]),
              "", "## Exercises", "", table(t["stats_header"], t["stats"]), ""]
    return "\n".join(parts)


_HTML = jinja2.Environment(autoescape=True).from_string("""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left}th{background:#eee}
.warning{color:#b00;font-weight:bold}</style>
</head><body>
<h1>{{ title }}</h1>
<ul>{% for fact in facts %}<li>{{ fact }}</li>{% endfor %}</ul>
{% if warning %}<p class="warning">{{ warning }}</p>{% endif %}
<h2>Students</h2>
<table><tr>{% for h in student_header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in students %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
<h2>Exercises</h2>
<table><tr>{% for h in stats_header %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in stats %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
</body></html>
""")


def html_report(book: Gradebook) -> str:
    return _HTML.render(**_tables(book))


def gradescope_results(book: Gradebook, student: str) -> dict:
    """One student's results.json for Gradescope's autograder: a test per exercise that counts."""
    grades, plan = next(s for s in book.students if s.student == student), book.plan
    tests = []
    for number, points in plan.points.items():
        g = grades.exercises.get(number)
        name = f"exercise {number}: {EXERCISES[number].function}"
        if g is None:
            tests.append(dict(name=name, score=0, max_score=points, status="failed", output="not submitted"))
            continue
        output = [f"{g.cell} cases passed"] + [f"FAIL {case}: {detail}" for case, detail in g.failures]
        output += [g.note] if g.note else []
        tests.append(dict(name=name, score=g.score, max_score=points, status="passed" if g.complete else "failed",
                          output="\n".join(output)))
    return dict(score=grades.score(plan), execution_time=round(grades.seconds, 1), tests=tests,
                output=f"hidden cases drawn with seed {plan.seed}; isolation: {plan.isolation}")


def write_reports(book: Gradebook, csv_path: str | Path | None = None, gradescope_dir: str | Path | None = None,
                  single: bool = False) -> list[Path]:
    """Markdown and HTML beside the CSV (same name, .md and .html); a results.json per student in
    `gradescope_dir` (STUDENT/results.json, or results.json itself when `single`). -> the files written."""
    written = []
    if csv_path is not None:
        for suffix, text in ((".md", markdown_report(book)), (".html", html_report(book))):
            path = Path(csv_path).with_suffix(suffix)
            path.write_text(text)
            written.append(path)
    if gradescope_dir is not None:
        for s in book.students:
            path = Path(gradescope_dir) / ("" if single else s.student) / "results.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(gradescope_results(book, s.student), indent=1))
            written.append(path)
    return written
