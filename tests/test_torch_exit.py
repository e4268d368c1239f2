"""What is alive when an FSDP2 process ends: nothing of the library. After a few FSDP2 steps and
`destroy_process_group()`, the threads left in each process are the same whether the optimiser
is torch.optim's AdamW, the `optimisers.torch` adapter or `optimisers.update_`: no Python thread
besides the main one, no thread pool of the engine, and the same native threads (gloo's, which
FSDP2 leaves running in torch; see docs/fsdp.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc"),
]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_exit_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(kind, tmp_path) -> list[dict]:
    outdir = tmp_path / kind
    outdir.mkdir()
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), port, str(outdir), kind],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = []
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        # the record is written before interpreter exit; an abort after it is torch's (the test
        # of the threads below is what says whether any of it is ours)
        path = outdir / f"rank{rank}.json"
        assert path.exists(), (p.returncode, text[-3000:])
        out.append(json.loads(path.read_text()))
    return out


def test_nothing_of_the_library_is_alive_after_destroy_process_group(tmp_path):
    reference = records("torch", tmp_path)
    assert not any(r["optimisers_imported"] for r in reference)  # torch.optim alone
    for kind in ("adapter", "update_"):
        ours = records(kind, tmp_path)
        for rank, (r, ref) in enumerate(zip(ours, reference)):
            assert r["optimisers_imported"]
            assert r["python_threads"] == ["MainThread"], (kind, rank, r)
            assert r["engine_pool"] == "None", (kind, rank, r)
            assert r["native_threads"] == ref["native_threads"], (kind, rank, r, ref)
