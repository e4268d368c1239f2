"""Every ```python block of README.md and docs/*.md runs as a reader would paste it.

A block runs on its own, in a fresh namespace, unless its first line says otherwise:

- `# continues the block above`: it runs after the block above it, in one namespace with it (and
  with whatever that block continues), as a reader who pasted both in order would have them;
- `# continues "<heading>"`: the same, after the last block under that heading of the page;
- `# illustration: not run (<why>)`: code that cannot run in one CPU process by nature (it
  starts several processes, needs a GPU or a download); `test_not_run_blocks_are_rare` keeps
  these few.

The blocks run in this process, so that torch and jax are imported once: each chain of blocks in a
module of its own, with a temp directory as its working directory (blocks write checkpoints there),
fixed seeds and a time limit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import re
import signal
import sys
import threading
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from test_docs import PAGES, ROOT, code_blocks

pytestmark = pytest.mark.slow

CONTINUES_ABOVE = "# continues the block above"
CONTINUES_HEADING = re.compile(r'# continues "(?P<heading>[^"]+)"$')
NOT_RUN = re.compile(r"# illustration: not run \((?P<why>[^)]+)\)$")
ALLOWED_NOT_RUN = 3
SECONDS_PER_CHAIN = 180


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the block's first line of code
    code: str
    heading: str  # the last heading above the block ("" if none)

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name
        return f"{page}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def runs(self) -> bool:
        return not NOT_RUN.match(self.first_line)


def headings(page: Path) -> list[tuple[int, str]]:
    """`(line, text)` of each Markdown heading of `page`, lines inside code fences aside."""
    out, inside = [], False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if re.match(r"[ \t]*```", line):
            inside = not inside
        elif not inside and (m := re.match(r"#{1,6} (.+?)\s*$", line)):
            out.append((number, m.group(1)))
    return out


def blocks(page: Path) -> list[Block]:
    marks = headings(page)
    return [
        Block(page, line, code, next((t for n, t in reversed(marks) if n < line), ""))
        for line, code in code_blocks(page)
    ]


def continued(page_blocks: list[Block], i: int) -> Block | None:
    """The block that block `i` continues, or None if it stands alone."""
    block = page_blocks[i]
    if block.first_line == CONTINUES_ABOVE:
        assert i > 0, f"{block.where} continues the block above, but it is the first block"
        before = page_blocks[i - 1]
    elif m := CONTINUES_HEADING.match(block.first_line):
        under = [b for b in page_blocks[:i] if b.heading == m.group("heading")]
        assert under, f'{block.where} continues "{m.group("heading")}": no block above under that heading'
        before = under[-1]
    else:
        return None
    assert before.runs, f"{block.where} continues {before.where}, which is not run"
    return before


def chains(page: Path) -> list[list[Block]]:
    """Lists of blocks to run in one namespace, in order: one for each block that runs and that no
    other block continues, holding that block and every block it continues. Together they run
    every block that runs."""
    page_blocks = blocks(page)
    before = {block: continued(page_blocks, i) for i, block in enumerate(page_blocks)}
    continued_by_some = set(before.values())
    out = []
    for block in page_blocks:
        if block.runs and block not in continued_by_some:
            chain = [block]
            while before[chain[0]] is not None:
                chain.insert(0, before[chain[0]])
            out.append(chain)
    return out


ALL_CHAINS = [chain for page in PAGES for chain in chains(page)]


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Raise TimeoutError in the running block after `seconds` (where SIGALRM exists), so that a
    block that hangs fails its test instead of stopping the run. A block stuck in C code never sees
    the signal: for that case, every thread's traceback goes to stderr a little later."""
    faulthandler.dump_traceback_later(seconds + 30)
    alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if alarm:

        def expire(signum, frame):
            raise TimeoutError(f"still running after {seconds} s")

        old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def _fresh_process_state():
    """Fixed seeds, one torch thread, and afterwards the environment variables and torch's default
    process group as they were, so that one chain cannot make another pass or fail."""
    import torch
    import torch.distributed as dist

    environ, threads = dict(os.environ), torch.get_num_threads()
    # the examples' models are tiny: PyTorch's thread pool only adds contention on a busy machine
    torch.set_num_threads(1)
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
        if dist.is_available() and dist.is_initialized():  # left by a block that failed midway
            dist.destroy_process_group()


@pytest.mark.parametrize("chain", ALL_CHAINS, ids=[chain[-1].where for chain in ALL_CHAINS])
def test_block_runs(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a real module, so that classes defined in a block work with dataclasses, pickle, ...
    module = types.ModuleType(f"docs_block_{chain[-1].page.stem.replace('-', '_')}_{chain[-1].line}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with _fresh_process_state(), _time_limit(SECONDS_PER_CHAIN):
        for block in chain:
            try:
                exec(compile(block.code, block.where, "exec", dont_inherit=True), module.__dict__)
            except Exception as e:
                raise AssertionError(f"the code block at {block.where} failed: {e!r}") from e


def test_every_block_is_run_or_marked():
    for page in PAGES:
        in_chains = {b for chain in chains(page) for b in chain}
        for block in blocks(page):
            assert block in in_chains or not block.runs, block.where


def test_not_run_blocks_are_rare():
    not_run = [b.where for page in PAGES for b in blocks(page) if not b.runs]
    assert len(not_run) <= ALLOWED_NOT_RUN, not_run


def test_markers_have_one_form():
    """A near miss (`# continued from above`, `# not run`) would silently run the block alone,
    or run a block that should not run: only the forms above are markers."""
    for page in PAGES:
        for block in blocks(page):
            first = block.first_line.lower()
            near_miss = first.startswith("#") and any(
                word in first for word in ("continue", "not run", "illustration")
            )
            is_marker = (
                block.first_line == CONTINUES_ABOVE
                or CONTINUES_HEADING.match(block.first_line)
                or not block.runs
            )
            assert is_marker or not near_miss, (
                f'{block.where}: write "{CONTINUES_ABOVE}", \'# continues "<heading>"\' or '
                "'# illustration: not run (<why>)'"
            )


PAGE = """\
# Title

```python
x = 1
```

```python
# continues the block above
y = x + 1
```

## Other

```python
# illustration: not run (needs 2 processes)
z
```

```python
# continues "Title"
w = y + 1
```

```python
# continues "Title"
v = x
```

```python
# continued from above
u = 2
```
"""


def test_markers_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE, encoding="utf-8")
    found = blocks(page)
    assert [b.heading for b in found] == ["Title", "Title", "Other", "Other", "Other", "Other"]
    assert [b.runs for b in found] == [True, True, False, True, True, True]
    lines = [[b.line for b in chain] for chain in chains(page)]
    # "Title"'s last block is the second: both blocks that continue "Title" run after it
    assert lines == [[4, 8, 20], [4, 8, 25], [30]]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("```python\n# continues the block above\ny = 1\n```\n", "it is the first block"),
        ('# A\n\n```python\n# continues "B"\ny = 1\n```\n', "no block above under that heading"),
        (
            "```python\n# illustration: not run (a GPU)\nx\n```\n\n"
            "```python\n# continues the block above\ny = x\n```\n",
            "which is not run",
        ),
    ],
    ids=["first block", "unknown heading", "after a block not run"],
)
def test_a_continuing_block_has_a_block_to_continue(tmp_path, text, message):
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    with pytest.raises(AssertionError, match=message):
        chains(page)
