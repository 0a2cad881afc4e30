"""Real texts the prompts are built from, each with the name the packaged rows record.

Everything here is on a fresh machine of this kind without a download: the Python standard library
(texts and sources of the interpreter running the script), Debian's `base-files` licences in
/usr/share/common-licenses and the `man-db` package's manual. The names carry the Python version,
since the stdlib texts change between versions.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import html.parser
import io
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

PY = f"Python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
LICENSES = Path("/usr/share/common-licenses")
MAN_DB_MANUAL = Path("/usr/share/doc/man-db/man-db-manual.txt.gz")

UNDERLINE = re.compile(r"^\s*([*=\-^~#])\1{2,}\s*$")
ANSI = re.compile(r"\x1b\[[0-9;]*m|.\x08")
PAGE_FURNITURE = re.compile(r"^\s*(\d+|_+|man-db\s+v[\d.]+\s+\d{4}-\d\d-\d\d)\s*$")


@dataclass(frozen=True)
class Text:
    """A source text: `name` is what the rows record, `body` the text itself."""

    name: str
    body: str


def licence(name: str) -> Text:
    """A licence shipped by Debian's base-files package (present on every Debian system)."""
    return Text(f"debian:common-licenses/{name}", (LICENSES / name).read_text(encoding="utf-8"))


def python_licence(part: str) -> Text:
    full = (STDLIB / "LICENSE.txt").read_text(encoding="utf-8")
    history, _, terms = full.partition("B. TERMS AND CONDITIONS")
    body = history if part == "history" else "B. TERMS AND CONDITIONS" + terms
    return Text(f"{PY} LICENSE.txt ({part})", body)


def topic(name: str) -> Text:
    """A section of the language reference, as `help()` shows it."""
    from pydoc_data.topics import topics

    return Text(f"{PY} pydoc_data.topics[{name!r}]", topics[name])


def module_doc(module: str) -> Text:
    import importlib

    return Text(f"{PY} {module}.__doc__", importlib.import_module(module).__doc__)


def stdlib_file(relative: str) -> Text:
    """A file of the standard library, e.g. `textwrap.py` or `email/architecture.rst`."""
    return Text(f"{PY} Lib/{relative}", (STDLIB / relative).read_text(encoding="utf-8"))


def zen() -> Text:
    with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the poem
        import this
    return Text(f"{PY} this (The Zen of Python)", codecs.decode(this.s, "rot13"))


def man_db_manual() -> Text:
    """The man-db user manual (Debian package man-db) as plain text: its bold/underline escapes, page
    headers and page numbers removed, words hyphenated across lines joined again."""
    raw = gzip.decompress(MAN_DB_MANUAL.read_bytes()).decode("utf-8", errors="replace")
    lines = [
        line for line in ANSI.sub("", raw).replace("\x1b[0m", "").splitlines()
        if not PAGE_FURNITURE.match(line)
    ]
    body = re.sub(r"(\w)-\n\s*(\w)", r"\1\2", "\n".join(lines))
    return Text("debian:man-db/man-db-manual.txt", body)


class _Paragraphs(html.parser.HTMLParser):
    """Text of the <p> and <li> blocks of a Sphinx page (navigation and code blocks left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: list[str] = []
        self._depth = 0
        self._parts: list[str] = []
        self._in_body = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "div" and ("role", "main") in attrs:
            self._in_body = True
        if self._in_body and tag in ("p", "dt"):
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if self._depth and tag in ("p", "dt"):
            self._depth -= 1
            if not self._depth:
                text = " ".join("".join(self._parts).split())
                if text:
                    self.blocks.append(text)
                self._parts = []

    def handle_data(self, data: str) -> None:
        if self._depth:
            self._parts.append(data)


def idle_guide() -> Text:
    """IDLE's user guide, the HTML page IDLE's Help menu opens, as plain paragraphs."""
    parser = _Paragraphs()
    parser.feed((STDLIB / "idlelib" / "help.html").read_text(encoding="utf-8"))
    return Text(f"{PY} Lib/idlelib/help.html", "\n\n".join(parser.blocks))


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks; prose is re-flowed, indented blocks (code, grammar) kept as they are.

    reST-style underlines ("=====") are dropped: joined onto their heading they read as noise.
    """
    blocks = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.split("\n") if not UNDERLINE.match(line)]
        if not any(line.strip() for line in lines):
            continue
        joined = "\n".join(lines).rstrip()
        blocks.append(joined if joined.startswith(" ") else " ".join(joined.split()))
    return blocks


def sentences(text: str) -> list[str]:
    """Text split at sentence ends, every block re-flowed, for haystacks that take needles between sentences."""
    out = []
    for block in paragraphs(text):
        flat = " ".join(block.split())
        out.extend(part for part in re.split(r"(?<=[.!?])\s+(?=[A-Z(\"'])", flat) if part)
    return out
