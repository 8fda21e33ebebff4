"""JSON Lines read one line at a time, a bad line named by its file and number."""
from __future__ import annotations

import json
from typing import Iterable, Iterator, Tuple, Type


def json_lines(lines: Iterable[str], where: str, error: Type[Exception] = ValueError) -> Iterator[Tuple[int, object]]:
    """``(line number, value)`` of every non-blank line of ``lines`` (a file, or its text's
    lines); a line that is not JSON raises ``error("WHERE:N: malformed JSON line (why)")``."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}:{lineno}: malformed JSON line ({exc.msg})") from None
        yield lineno, value
