"""`optimisers demo`: the command runs on every backend, prints its table, writes a valid PNG, and
turns bad options into one line and a non-zero exit."""

from __future__ import annotations

import io
import re
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

import optimisers as opt
from optimisers.tools.cli import main
from optimisers.tools.demo import Config, DemoError, Progress, _models, _plot, parse_rule, run


def read_png(path) -> np.ndarray:
    """Decode an 8-bit RGB PNG with filter 0 (what the demo writes), checking every CRC."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(height, width, 3)


def table_row(output: str, label: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.strip().startswith(label))
    return re.split(r"\s{2,}", line.strip())[1:]


def test_demo_numpy_end_to_end(tmp_path, capsys):
    assert main(["demo", "--steps", "40", "--out", str(tmp_path / "plots"), "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert "40/40" in err and "loss" in err  # the progress bar's last line
    assert "sample (temperature 0.7):" in out and "Return the " in out
    assert re.search(r"final loss: \d+\.\d+ nats/char", out)
    assert table_row(out, "embed vs unembed, max |diff|")[0] == "0"
    naive_drift = float(table_row(out, "embed vs unembed, max |diff|")[1])
    assert naive_drift > 0
    tied_bytes, naive_bytes = (int(v.replace(",", "")) for v in table_row(out, "optimiser state (bytes)"))
    # the naive run keeps a second pair of float32 Adam moments for the output layer's copy of E
    vocab, width = map(int, re.search(r"whose (\d+)x(\d+) embedding", out).groups())
    assert naive_bytes - tied_bytes == 2 * vocab * width * 4
    png = tmp_path / "plots" / "demo-numpy.png"
    assert str(png) in out
    pixels = read_png(png)
    assert pixels.shape == (420, 1000, 3)
    for colour in (_plot.BLUE, _plot.ORANGE):
        assert (pixels == colour).all(axis=2).sum() > 200, colour


def test_python_dash_m(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "optimisers", "demo", "--steps", "5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "optimiser state (bytes)" in done.stdout
    assert (tmp_path / "demo-numpy.png").stat().st_size > 1000


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_demo_other_backends(backend, tmp_path):
    stdout = io.StringIO()
    result = run(Config(backend=backend, steps=8, out=str(tmp_path)), stdout, io.StringIO())
    assert result.tied_drift == (0.0, 0.0)
    assert result.naive_drift[0] > 0
    assert result.naive_bytes > result.tied_bytes
    assert read_png(tmp_path / f"demo-{backend}.png").shape == (420, 1000, 3)
    assert "optimiser state (bytes)" in stdout.getvalue()


def test_backends_agree():
    """Hand-written NumPy gradients, torch autograd and jax.grad train the same numbers: each place
    of E contributes its own gradient, and the library sums them."""
    init = _models.init_params(20, 8, 3, 16, seed=1)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 20, (16, 3)), rng.integers(0, 20, 16)) for _ in range(5)]
    losses = {}
    for name, trainer in _models.TRAINERS.items():
        t = trainer(init, True, opt.Adam(0.01))
        losses[name] = [t.step(c, y) for c, y in batches]
        e_in, e_out = t.embeddings()
        np.testing.assert_array_equal(e_in, e_out)
        losses[name].append(float(np.abs(t.params()["proj"]["weight"]).sum()))
    np.testing.assert_allclose(losses["numpy"], losses["torch"], rtol=2e-5)
    np.testing.assert_allclose(losses["numpy"], losses["jax"], rtol=2e-5)


def test_numpy_trainer_keeps_identity():
    t = _models.NumpyTrainer(_models.init_params(10, 4, 2, 8, seed=0), True, opt.Adam())
    E = t.model["embed"]
    t.step(np.zeros((4, 2), np.int64), np.ones(4, np.int64))
    assert t.model["embed"] is E and t.model["unembed"]["weight"] is E
    assert len(t.state.leaves()) == 6  # E once, plus four weights/biases and the output bias


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "abc"], "--steps: expected a whole number"),
        (["demo", "--steps", "0"], "--steps: expected at least 1"),
        (["demo", "--lr", "-1"], "--lr: expected a positive number"),
        (["demo", "--seed", "-1"], "--seed: expected 0 or more"),
        (["demo", "--lr", "nan"], "--lr: expected a positive number"),
        (["demo", "--backend", "tensorflow"], "invalid choice"),
        (["demo", "--bogus"], "unrecognized arguments"),
        (["launch"], "invalid choice"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_arguments_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rule", "Adamm"], "unknown rule 'Adamm'; choose one of: "),
        (["--rule", "Adam("], "cannot read --rule"),
        (["--rule", "__import__('os')"], "unknown rule '__import__'"),
        (["--rule", "Adam.__class__"], "is not allowed here"),
        (["--rule", "Adam(-1.0)"], "learning rate eta cannot be negative"),
        (["--rule", "AccumGrad"], "AccumGrad needs arguments"),
        (["--rule", "ClipNorm", "--lr", "0.1"], "--lr cannot be applied"),
    ],
)
def test_bad_demo_options_one_line(argv, message, tmp_path, capsys):
    assert main(["demo", "--steps", "2", "--out", str(tmp_path), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("optimisers demo: error: ") and message in captured.err
    assert captured.out == ""


def test_diverging_run_is_reported_not_raised(tmp_path, capsys):
    """Too large a learning rate gives nan losses: the demo says so and still draws its plot."""
    argv = ["demo", "--rule", "Descent(1000.0)", "--steps", "20", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "training diverged" in out and "nan" in table_row(out, "held-out loss")
    assert "same memory" in out  # Descent keeps no state, so neither run does
    assert read_png(tmp_path / "demo-numpy.png").shape == (420, 1000, 3)


def test_out_must_be_a_folder(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["demo", "--out", str(tmp_path / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_bad_options_from_the_shell(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "optimisers", "demo", "--rule", "Nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "unknown rule 'Nope'" in done.stderr


def test_parse_rule():
    assert parse_rule("Adam") == opt.Adam()
    assert parse_rule("Adam(1e-2)") == opt.Adam(0.01)
    assert parse_rule("Adam", lr=0.5) == opt.Adam(0.5)
    assert parse_rule("Adam(beta=(0.8, 0.9))") == opt.Adam(beta=(0.8, 0.9))
    chain = parse_rule("OptimiserChain(ClipNorm(1.0), AdamW(3e-3))", lr=0.1)
    assert chain == opt.OptimiserChain(opt.ClipNorm(1.0), opt.AdamW(0.1))
    with pytest.raises(DemoError):
        parse_rule("Adam(eta=Descent)")


def test_progress_bar():
    stream = io.StringIO()
    bar = Progress(8, stream)
    for i in range(1, 9):
        bar.update(i, f"loss {i:.3f}")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("[" + "#" * 28 + "] 8/8 loss 8.000")


def test_png_round_trip(tmp_path):
    canvas = _plot.Canvas(37, 11)
    canvas.polyline([0, 36], [10, 0], _plot.BLUE, thickness=1)
    canvas.text(1, 1, "0.5", scale=1)
    canvas.save_png(tmp_path / "x.png")
    np.testing.assert_array_equal(read_png(tmp_path / "x.png"), canvas.pixels)
