"""Class names: checked wherever they enter (an image folder's class folders, the official set's
batches.meta, a model file's metadata) and before a model file is written, so what ``predict``
prints, what ``evaluate`` tabulates and what the logs hold never carries a control character.

A name is refused when it is empty or blank, starts or ends with whitespace, holds a character
``str.isprintable`` rejects (the C0/C1 controls such as a newline or an escape, the format
characters such as the bidirectional overrides U+202A..U+202E and isolates U+2066..U+2069 or a
zero-width space, the line and paragraph separators U+2028/U+2029, unassigned code points), holds a
path separator (a name may become a folder name, ``train/<class>/``), or is longer than
``MAX_NAME_CHARS``; and the names must differ ignoring case (two folders ``cat`` and ``Cat`` are one
on a case-insensitive file system and read as one class). Letters of any script are fine.
"""

from __future__ import annotations

import unicodedata

MAX_NAME_CHARS = 100  # CIFAR-100's longest name has 13 characters; WordNet synset names stay under 60


def shown(name: str, limit: int = 40) -> str:
    """``name`` quoted for a one-line message: repr escapes what is not printable, and a long one is cut."""
    return repr(name[:limit]) + (f"... ({len(name)} characters)" if len(name) > limit else "")


def class_name_problem(names) -> str | None:
    """Why ``names`` (a sequence of class names) cannot be used, in a few words; None when they can."""
    seen: dict[str, str] = {}
    for i, name in enumerate(names):
        if not isinstance(name, str):
            return f"name {i} is a {type(name).__name__}, not a string"
        if not name.strip():
            return f"name {i} is {'empty' if not name else 'blank'} ({shown(name)})"
        if len(name) > MAX_NAME_CHARS:
            return f"name {i} is {len(name)} characters long (at most {MAX_NAME_CHARS})"
        if name != name.strip():
            return f"name {i} {shown(name)} starts or ends with whitespace"
        bad = next((c for c in name if not c.isprintable()), None)
        if bad is not None:
            kind = "a control" if unicodedata.category(bad) == "Cc" else "an unassigned"
            what = unicodedata.name(bad, "").lower() or f"{kind} character"
            return f"name {i} {shown(name)} holds the unprintable character U+{ord(bad):04X} ({what})"
        if "/" in name or "\\" in name:
            return f"name {i} {shown(name)} holds a path separator"
        key = unicodedata.normalize("NFKC", name).casefold()
        if key in seen:
            return f"{shown(seen[key])} and {shown(name)} name one class twice (names must differ, ignoring case)"
        seen[key] = name
    return None


def check_class_names(names, what: str, error=ValueError) -> None:
    """Raise ``error`` with one line (``what``: where the names came from) when ``class_name_problem``
    finds one."""
    problem = class_name_problem(names)
    if problem is not None:
        raise error(f"{what}: {problem}")


def printable(text: str) -> str:
    """``text`` with every unprintable character escaped (\\n, \\u202e): a path or a name from a
    file system, printed on the terminal, can neither break a line nor reorder it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
