"""The text inside an eval set's files, checked where it is read (quantgate.evals.setsource), so that one cause is
one message at its place: a file saved as UTF-16 or UTF-32 (what Windows tools and Excel write) is named once with
how to save it as UTF-8, not as an error on every line; a lone surrogate escape in a JSON string (`\\ud83d`: half of
a UTF-16 pair, which Python's json accepts but which is no text: sending it fails) is named by its line and field;
a cell that starts a JSON array and does not close it is refused, not taken as the literal text.
"""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path
from typing import Any

from quantgate.base.errors import ConfigError

_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32LE"), (codecs.BOM_UTF32_BE, "UTF-32BE"),  # before UTF-16: FF FE 00 00
         (codecs.BOM_UTF16_LE, "UTF-16LE"), (codecs.BOM_UTF16_BE, "UTF-16BE"))
_SURROGATE = re.compile("[\ud800-\udfff]")


def wrong_encoding(data: bytes, path: Path) -> ConfigError | None:
    """A file in UTF-16 or UTF-32, by its byte-order mark or, without one, by the zero bytes that ASCII text has
    between its characters in UTF-16: one error at line 1 saying which and how to save it as UTF-8. None otherwise
    (a stray byte that is not UTF-8 is named at its own line by the reader)."""
    found = next(((name, "its byte-order mark") for bom, name in _BOMS if data.startswith(bom)), None)
    head = data[:4096]
    if found is None and len(head) >= 4 and head.count(0) * 3 >= len(head):
        found = ("UTF-16LE" if head[1] == 0 else "UTF-16BE", "every other byte is 0")
    if found is None:
        return None
    name, how = found
    utf8 = path.with_name(f"{path.stem}.utf8{path.suffix}").name
    return ConfigError(f"the file is {name}, not UTF-8 ({how}): every line would be misread", where=f"{path}:1",
                       fix=f"save it as UTF-8: `iconv -f {name} -t UTF-8 {path.name} > {utf8}` and use that file, or "
                           "choose 'UTF-8' in your editor's or spreadsheet's save dialog (pandas: encoding='utf-8')")


def lone_surrogate(value: Any) -> str | None:
    """Where a parsed JSON value holds a lone surrogate, as "field 'a.0': ..." (the file's own field names); None
    when it holds none. json.loads joins a whole escaped pair into its character, so any surrogate left is alone."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        at, v = stack.pop()
        if isinstance(v, dict):
            stack += [(f"{at}.{k}" if at else str(k), x) for k, x in reversed(v.items())]
            stack += [(at or "(a key)", k) for k in v if isinstance(k, str)]
        elif isinstance(v, list):
            stack += [(f"{at}.{i}" if at else str(i), x) for i, x in reversed(list(enumerate(v)))]
        elif isinstance(v, str) and (m := _SURROGATE.search(v)):
            return (f"field '{at}': a lone surrogate escape \\u{ord(m.group()):04x} at character {m.start() + 1}: "
                    "half of a UTF-16 pair, which is no text and cannot be sent; write the character itself, or "
                    "both halves of its pair (\\ud83d\\ude00 is one emoji)")
    return None


def json_list_cell(text: str) -> tuple[Any, str | None]:
    """A text cell for a list field (a CSV's `references`): a JSON array written as text becomes the list, and
    text that starts like one but is not (cut short, a quote missing) is refused rather than kept as the literal
    text; other text is one item."""
    stripped = text.strip()
    if not stripped.startswith("["):
        return [text], None
    try:
        parsed = json.loads(stripped)
    except json.JSONDecodeError as exc:
        return None, (f"starts like a JSON array but is not one ({exc.msg} at character {exc.pos + 1}): close the "
                      f"array, e.g. [\"a\", \"b\"], or for text that begins with '[' write it as a one-item array "
                      f"[{json.dumps(text)}]")
    except RecursionError:
        return None, "a JSON array nested too deeply for the parser"
    return parsed, lone_surrogate(parsed)
