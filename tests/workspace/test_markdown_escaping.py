"""Odd user text (pipes, newlines, backticks, HTML, heading marks) never breaks the task file's markdown."""

from __future__ import annotations

from pathlib import Path

from record_helpers import JOB, replay_result

from axrl_spike_replay.investigation.task_opening import open_task
from axrl_spike_replay.workspace.render import md_block, md_cell, md_code
from axrl_spike_replay.workspace.task_record.task_log import record_failure, record_replay
from axrl_spike_replay.workspace.task_record.task_state import note, set_command

ODD = "a | b\nsecond `line` with ``two`` ticks \\| and <!-- not a comment\r\n# not a heading"


def cells(line: str) -> int:
    """Cell delimiters in a GFM table row: a backslash escapes the next character, any other pipe splits."""
    count, i = 0, 0
    while i < len(line):
        if line[i] == "\\":
            i += 2
            continue
        count += line[i] == "|"
        i += 1
    return count


def outside_fences(text: str) -> list[str]:
    """Lines of `text` outside fenced code blocks (a fence closes on the same character, at least as long)."""
    out, fence = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        marker = stripped[: len(stripped) - len(stripped.lstrip(stripped[:1]))] if stripped[:1] in "`~" else ""
        if fence:
            if marker.startswith(fence) and stripped == marker:
                fence = ""
        elif len(marker) >= 3:
            fence = marker
        else:
            out.append(line)
    assert not fence, "a fenced block is left open"
    return out


def tables(text: str) -> list[list[str]]:
    """Blocks of consecutive lines that start with a pipe."""
    blocks: list[list[str]] = []
    previous = False
    for line in text.splitlines():
        row = line.startswith("|")
        if row and not previous:
            blocks.append([])
        if row:
            blocks[-1].append(line)
        previous = row
    return blocks


def test_cell_escapes_keep_one_line_and_one_cell() -> None:
    cell = md_cell(ODD)
    assert "\n" not in cell and "\r" not in cell
    assert cells(f"| {cell} |") == 2
    assert "<!--" not in cell and "&lt;!--" in cell
    assert "\\`line\\`" in cell and "<br>" in cell


def test_code_and_block_fences_outlast_the_text() -> None:
    assert md_code("x ``` y") == "```` x ``` y ````"
    block = md_block("echo ```x```", "bash")
    assert block.startswith("````bash\n") and block.endswith("\n````")


def test_task_file_stays_valid_with_odd_text(tmp_path: Path) -> None:
    open_task(tmp_path, JOB, snapshot="/snapshots/odd|name`/iter_0000005")
    result = replay_result(Path("/snap|shots/iter_0000005"), 3.0, "cleared", mitigations={"note": ODD}, target=ODD)
    record_replay(tmp_path, JOB, result, tmp_path / "r|1.json")
    record_failure(tmp_path, JOB, reason=ODD, command="replay --patch 'a|b'\n`rm -rf`", snapshot=ODD, target="h|x")
    note(tmp_path, JOB, "observations", ODD)
    note(tmp_path, JOB, "next-steps", "## Injected section\n---\n```\nunclosed fence")
    set_command(tmp_path, JOB, "echo ``` | tee\n# comment")
    text = (tmp_path / "agent-task" / "spike-replay" / f"{JOB}.md").read_text()

    found = tables(text)
    assert len(found) == 2  # experiment table, failed attempts
    for block in found:
        widths = {cells(line) for line in block}
        assert widths == {cells(block[0])}, block
    assert cells(found[0][0]) == 13 and cells(found[1][0]) == 8
    headings = [line for line in outside_fences(text) if line.lstrip().startswith("#")]
    assert headings == [
        f"# Spike investigation: {JOB}",
        "## Active snapshot",
        "## Replay command",
        "## Experiment table",
        "## Observations",
        "## Failed attempts",
        "## Next steps",
    ]
    # Fenced blocks stay balanced: the replay command's fence is longer than the backticks inside it.
    assert "````bash\necho ``` | tee\n# comment\n````" in text
    # A note's later lines stay inside its list item and cannot open a fence or a setext heading.
    assert ": ## Injected section\n  \\---\n  \\```\n  unclosed fence" in text
