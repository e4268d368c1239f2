"""The demo's training text: the prose of the Python standard library's own docstrings.

Every Python installation carries it, so the demo needs no download and no data file. Docstrings are
read from the modules' source with `ast` (nothing is imported, and `python -OO` does not matter), and
only prose paragraphs are kept: doctest sessions and indented code are dropped.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re

# Pure-Python modules with plenty of English in their docstrings. Order matters only for
# reproducibility: the text is their concatenation.
MODULES = (
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "difflib",
    "email.message",
    "enum",
    "fileinput",
    "fnmatch",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "http.client",
    "imaplib",
    "inspect",
    "ipaddress",
    "json.decoder",
    "json.encoder",
    "locale",
    "logging",
    "mailbox",
    "mimetypes",
    "netrc",
    "numbers",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pkgutil",
    "platform",
    "poplib",
    "pprint",
    "pydoc",
    "queue",
    "quopri",
    "random",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "turtle",
    "typing",
    "unittest.case",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "weakref",
    "webbrowser",
    "zipfile",
)

_PRINTABLE = re.compile(r"[^ -~\n]")
_SPACES = re.compile(r"\s+")


def _docstrings(source: str):
    """Docstrings of the module and of the classes and functions in it (nested ones included),
    found by following statement bodies only, which is much faster than `ast.walk`."""
    stack = [ast.parse(source)]
    while stack:
        node = stack.pop()
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield doc
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        stack.extend(reversed([n for n in node.body if isinstance(n, defs)]))


def _prose(doc: str):
    """The paragraphs of a docstring that read as sentences, each joined onto one line."""
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if not lines or any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
            continue
        text = _SPACES.sub(" ", " ".join(lines)).strip()
        if len(text) < 40 or not text[0].isupper() or text[-1] not in ".:":
            continue
        letters = sum(c.isalpha() or c == " " for c in text)
        if letters < 0.85 * len(text):
            continue
        yield text


def _source(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def standard_library_text(limit: int = 400_000) -> str:
    """About `limit` characters of English from the standard library's docstrings, one paragraph a
    line, printable ASCII only. Raises RuntimeError when the sources are missing."""
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for name in MODULES:
        source = _source(name)
        if source is None:
            continue
        try:
            docs = list(_docstrings(source))
        except (SyntaxError, ValueError):
            continue
        for doc in docs:
            for para in _prose(doc):
                para = _PRINTABLE.sub("", para)
                if para in seen:
                    continue
                seen.add(para)
                parts.append(para)
                size += len(para) + 1
                if size >= limit:
                    return "\n".join(parts) + "\n"
    if size < 20_000:
        raise RuntimeError(
            "cannot find the standard library's Python sources to build the demo's training text"
        )
    return "\n".join(parts) + "\n"
