"""The README says what the code does: the serve flag table, the layout, the demo's output."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from coordinator.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


def serve_help() -> dict[str, str]:
    """Each `serve` option's help text, by option string."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = sub.choices["serve"]
    return {option: action.help or "" for action in serve._actions
            for option in action.option_strings}


def flag_rows() -> dict[str, list[str]]:
    """The serve flag table: each flag of a row -> the row's cells (flags, default, what)."""
    table = README.split("The main `serve` flags", 1)[1].split("\n\n", 2)[1]
    rows: dict[str, list[str]] = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        for flag in re.findall(r"`(--[a-z-]+)", cells[0]):
            rows[flag] = cells
    return rows


def test_every_flag_in_the_table_exists() -> None:
    helps = serve_help()
    rows = flag_rows()
    assert len(rows) > 20
    assert set(rows) <= set(helps), set(rows) - set(helps)


def test_the_meeting_point_defaults_say_what_serve_does() -> None:
    helps, rows = serve_help(), flag_rows()
    defaults = rows["--coord-store-port"][1]
    assert defaults == rows["--master-ip"][1] == rows["--master-port"][1]
    # One default per flag, in the order the first cell names them.
    master_ip, master_port, store_port = (d.strip() for d in defaults.split(", "))
    assert "not sent" in store_port and "default: not sent" in helps["--coord-store-port"]
    assert "free port" in master_port and "a free port" in helps["--master-port"]
    assert "advertised host" in master_ip and "the advertised host" in helps["--master-ip"]
    # The help's warning about --master-ip without --master-port is in the table too.
    assert "0 is sent" in helps["--master-port"]
    assert "with `--master-ip` give `--master-port` too" in rows["--master-port"][2]


def layout() -> str:
    return README.split("## Layout", 1)[1].split("```", 2)[1]


def test_the_layout_names_every_command_and_module() -> None:
    text = layout()
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    cli_entry = text.split("coordinator/cli/", 1)[1].split("bench/", 1)[0]
    for verb in sub.choices:
        assert re.search(rf"\b{verb}\b", cli_entry), verb
    for module in (REPO / "coordinator" / "cli").glob("*.py"):
        if module.stem != "__init__":
            assert re.search(rf"\b{module.stem}\b", cli_entry), module.stem
    sim_entry = text.split("coordinator/sim/", 1)[1].split("coordinator/cli/", 1)[0]
    for module in (REPO / "coordinator" / "sim").glob("*.py"):
        if module.stem not in ("__init__", "__main__"):
            assert re.search(rf"\b{module.stem}\b", sim_entry), module.stem
    for module in (REPO / "coordinator").glob("*.py"):
        if module.stem not in ("__init__", "__main__"):
            assert f"{module.stem}.py" in text, module.stem


def readme_demo_output() -> str:
    return README.split("printed this:\n\n```\n", 1)[1].split("```", 1)[0]


def summary_labels(output: str) -> list[str]:
    """The first cell of every row of the demo's summary table."""
    return [line.split("│")[1].strip() for line in output.splitlines()
            if line.startswith("│") and line.count("│") == 3]


def per_rank_header(output: str) -> list[str]:
    (line,) = [line for line in output.splitlines() if line.startswith("┃")]
    return [cell.strip() for cell in line.strip("┃").split("┃")]


def term(text: str) -> str:
    """A row label or an explained term without units and detail: `load / drain`, `wake`."""
    return re.sub(r" \([^)]*\)", "", text).split(":")[0].strip()


def test_every_row_of_the_demo_output_is_explained() -> None:
    output = readme_demo_output()
    labels = summary_labels(output)
    assert len(labels) >= 20
    explained = README.split("What each row says:", 1)[1].split("The last line is", 1)[0]
    terms = {term(bold) for bold in re.findall(r"\*\*([^*]+)\*\*", explained)}
    for label in labels:
        assert term(label) in terms, label
    for column in per_rank_header(output):
        assert column == "rank" or column in terms, column
    assert output.rstrip().splitlines()[-1] == "result: OK  lost = 0  hang = no"


def test_the_license_the_metadata_names_is_in_the_repository() -> None:
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text(encoding="utf-8")
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_every_markdown_file_the_docs_name_exists() -> None:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = []
    for doc in docs:
        for name in re.findall(r"\b([A-Za-z_][\w-]*\.md)\b", doc.read_text(encoding="utf-8")):
            found = [p for p in (doc.parent / name, REPO / name, REPO / "docs" / name)
                     if p.exists()] or [p for p in REPO.rglob(name) if ".venv" not in p.parts]
            if not found:
                missing.append(f"{doc.name}: {name}")
    assert missing == []


def test_no_tracked_file_keeps_merge_conflict_markers() -> None:
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    found = []
    for name in tracked:
        path = REPO / name
        if path.suffix not in {".py", ".md", ".toml", ".yml", ".yaml", ".json", ".cfg", ""}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if marker.search(text):
            found.append(name)
    assert found == []
