"""The current figures exist twice: lessons/BENCHMARKS.md's first table for readers, and the package's
data/current_figures.json for lessons to print (minillm.resources). These tests hold the two equal."""
import configparser
import fnmatch
import re

from minillm import resources

ENGINES = ["minillm", "llama.cpp", "gpt-fast", "HF transformers"]
LINK = re.compile(r"\[(?P<text>[^\]]+)\]\(#(?P<anchor>[^)]+)\)")


def benchmarks_lines() -> list[str]:
    return (resources.data_dir("lessons") / "BENCHMARKS.md").read_text(encoding="utf-8").split("\n")


def current_table() -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first table under '## Current figures', each row's cells stripped."""
    lines = benchmarks_lines()
    rows = []
    for line in lines[lines.index("## Current figures") + 1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows or line.startswith("## "):
            break
    header, _rule, *body = rows
    return header, body


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, letters, digits, '_', '-' and spaces only, spaces -> '-'."""
    return "".join(c for c in heading.lower() if c.isalnum() or c in "_- ").replace(" ", "-")


def test_the_table_has_the_columns_the_json_has():
    header, _ = current_table()
    assert header == ["figure", "unit", "machine", "date", *ENGINES, "section"]


def test_every_row_of_the_table_is_its_json_figure_number_for_number():
    _, rows = current_table()
    figures = resources.current_figures()
    assert len(rows) == len(figures) and len({f["key"] for f in figures}) == len(figures)
    for row, figure in zip(rows, figures):
        assert row[:4] == [figure["figure"], figure["unit"], figure["machine"], figure["date"]], figure["key"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", figure["date"]), figure["key"]
        assert set(figure["values"]) <= set(ENGINES) and figure["values"], figure["key"]
        for engine, cell in zip(ENGINES, row[4:8]):
            if engine in figure["values"]:
                assert float(cell.replace(",", "")) == figure["values"][engine], (figure["key"], engine)
            else:
                assert cell == "", (figure["key"], engine, cell)
        link = LINK.fullmatch(row[8])
        assert link and link["text"] == figure["section"], figure["key"]


def test_each_row_links_to_a_topic_section_of_benchmarks():
    sections = {anchor(line[3:]): line[3:] for line in benchmarks_lines() if line.startswith("## ")}
    _, rows = current_table()
    for row in rows:
        link = LINK.fullmatch(row[8])
        assert sections.get(link["anchor"]) == link["text"], row[8]


def test_the_lessons_reference_line_is_the_tables_figure():
    _, rows = current_table()
    for row, figure in zip(rows, resources.current_figures()):
        line = resources.reference(figure["key"])
        assert line.startswith(f"reference: {row[4]} {row[1]} on {row[2]}, {row[3]} "), line


def test_the_figures_file_ships_in_the_wheel():
    # setup.cfg's package_data must name it, or an installed minillm has no figures to print
    setup = configparser.ConfigParser()
    setup.read(resources.CHECKOUT_DIR / "setup.cfg")
    globs = [g.strip() for g in setup["options.package_data"].get("minillm", "").replace(",", "\n").split("\n")]
    relative = resources.FIGURES_FILE.relative_to(resources.PACKAGE_DIR).as_posix()
    assert any(g and fnmatch.fnmatch(relative, g) for g in globs), globs
