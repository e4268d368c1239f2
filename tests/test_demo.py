"""`optimisers demo`: the command runs on every backend, prints its table, writes a valid PNG, and
turns bad options into one line and a non-zero exit."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from matplotlib import colors, image

import optimisers as opt
from optimisers.tools.cli import build_parser, main
from optimisers.tools.demo import STATE_CHOICES, Config, DemoError, _models, _plot, parse_rule, run
from optimisers.tools.demo._progress import training_progress

pytestmark = pytest.mark.slow


def read_png(path) -> np.ndarray:
    """The PNG's pixels as (height, width, RGB) floats in [0, 1]; matplotlib decodes it."""
    pixels = image.imread(path, format="png")
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    return pixels[:, :, :3]


def pixels_of(pixels: np.ndarray, colour: str) -> int:
    """How many pixels have `colour` (up to rounding to 8 bits)."""
    return int((np.abs(pixels - np.array(colors.to_rgb(colour))) < 1 / 255).all(axis=2).sum())


def table_row(output: str, label: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.strip().startswith(label))
    return re.split(r"\s{2,}", line.strip())[1:]


def test_demo_numpy_end_to_end(tmp_path, capsys):
    assert main(["demo", "--steps", "40", "--out", str(tmp_path / "plots"), "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert "40/40" in err and "loss" in err  # the progress bar's last line (not a terminal)
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
    for colour in (_plot.BLUE, _plot.ORANGE):  # both runs' curves are drawn
        assert pixels_of(pixels, colour) > 200, colour


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
        (["demo", "--state", "16bit"], "argument --state: invalid choice: '16bit' (choose from"),
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


def test_progress_bar_off_a_terminal_writes_its_last_line():
    stream = io.StringIO()
    with training_progress(8, stream) as update:
        for i in range(1, 9):
            update(i, 1.0 / i)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "8/8" in lines[0] and "loss 0.125" in lines[0]
    assert "\x1b" not in stream.getvalue()  # no terminal codes in a log file


def test_missing_extras_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["demo", "--steps", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs matplotlib: pip install 'optimisers[demo]'" in err
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


def test_plot_needs_no_display(tmp_path):
    """The figure is drawn on an Agg canvas of its own, never through pyplot: an interactive backend
    chosen by the user and no display change nothing."""
    code = (
        "import sys\n"
        "from optimisers.tools.demo import _plot\n"
        f"_plot.training_plot({str(tmp_path / 'p.png')!r}, [3.0, 2.0], [3.0, 2.5], [0.0, 0.0], "
        "[0.0, 0.1], 'title')\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["MPLBACKEND"] = "TkAgg"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert read_png(tmp_path / "p.png").shape == (420, 1000, 3)


# --- `--state`: the tied model with low-precision optimiser state beside float32 ------------------


def adam_state_bytes(n: int, state: str, min_size: int = 1024) -> int:
    """Bytes of Adam's two moments for an array of `n` elements, worked out from the layouts in
    docs/low-precision.md: 8 bits and FP8 a byte a number and a float32 scale a block of 256;
    4 bits half a byte and a scale a block of 128; bfloat16 two bytes; below `min_size`, float32."""
    if state == "bf16-sr":
        return 2 * 2 * n
    if state == "fp32" or n < min_size:
        return 2 * 4 * n
    if state == "4bit":
        return 2 * (-(-n // 2) + 4 * -(-n // 128))
    return 2 * (n + 4 * -(-n // 256))


def demo_arrays(output: str) -> list[int]:
    """The element counts of the demo model's distinct arrays (width 32, context 8, hidden 128)."""
    vocab, width = map(int, re.search(r"whose (\d+)x(\d+) embedding", output).groups())
    return [vocab * width, 128 * 8 * width, 128, width * 128, width, vocab]


def test_state_option_parses():
    parser = build_parser()
    assert parser.parse_args(["demo"]).state == "fp32"  # today's demo unless asked
    for choice in ("fp32", "8bit", "4bit", "fp8", "bf16-sr", "all"):
        assert parser.parse_args(["demo", "--state", choice]).state == choice
    assert set(STATE_CHOICES) == {"fp32", "8bit", "4bit", "fp8", "bf16-sr", "all"}


def test_state_8bit_table(tmp_path, capsys):
    assert main(["demo", "--state", "8bit", "--steps", "30", "--out", str(tmp_path), "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n\n")[1].splitlines()[0].split() == ["fp32", "8bit"]  # the table's columns
    arrays = demo_arrays(out)
    n = sum(arrays)
    big = [a for a in arrays if a >= 1024]
    fp32_bytes, low_bytes = (int(v.replace(",", "")) for v in table_row(out, "optimiser state (bytes)"))
    assert fp32_bytes == 8 * n
    assert low_bytes == sum(adam_state_bytes(a, "8bit") for a in arrays)
    per_big = [float(v) for v in table_row(out, "per parameter, arrays >= 1024")]
    assert per_big[0] == 8.0
    assert per_big[1] == pytest.approx(sum(adam_state_bytes(a, "8bit") for a in big) / sum(big), abs=5e-4)
    assert 2.0 < per_big[1] < 2.04  # codes and scales, about a quarter of fp32's
    per_all = [float(v) for v in table_row(out, "per parameter, whole model")]
    assert per_all[0] == 8.0 and per_all[1] == pytest.approx(low_bytes / n, abs=5e-4)
    assert table_row(out, "parameters (bytes)") == [f"{4 * n:,}"] * 2  # the parameters stay float32
    train = [float(v) for v in table_row(out, "training loss, last steps")]
    held = [float(v) for v in table_row(out, "held-out loss")]
    assert np.isfinite(train + held).all() and max(held) < np.log(arrays[-1])  # better than guessing
    assert held[1] == pytest.approx(held[0], rel=0.01)
    relative = table_row(out, "held-out loss vs fp32")
    assert relative[0] == "-"
    assert float(relative[1].rstrip("%")) == pytest.approx(100 * (held[1] - held[0]) / held[0], abs=0.01)
    pixels = read_png(tmp_path / "demo-numpy-8bit.png")
    assert pixels.shape == (420, 1000, 3)
    for colour in (_plot.STATE_COLOURS["fp32"], _plot.STATE_COLOURS["8bit"]):  # both curves drawn
        assert pixels_of(pixels, colour) > 200, colour


def test_state_fp32_column_is_the_default_demos_tied_run(tmp_path):
    """The same initial weights and batches: fp32's column is the default demo's tied run."""
    plain = run(Config(steps=6, out=str(tmp_path)), io.StringIO(), io.StringIO())
    states = run(Config(steps=6, out=str(tmp_path), state="4bit"), io.StringIO(), io.StringIO())
    assert states.runs["fp32"].train_loss == plain.tied_loss
    assert states.runs["fp32"].held_out == plain.tied_val
    assert states.runs["fp32"].state_bytes == plain.tied_bytes
    assert states.runs["4bit"].train_loss[0] == plain.tied_loss[0]  # the same model before a step
    assert states.runs["4bit"].train_loss != plain.tied_loss  # and then 4-bit moments


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_state_all_memory(backend, tmp_path):
    """Every state's bytes as the layouts say, the same on each backend; bf16-sr halves the
    parameters (and keeps bfloat16 moments)."""
    stdout = io.StringIO()
    result = run(Config(backend=backend, steps=3, out=str(tmp_path), state="all"), stdout, io.StringIO())
    assert list(result.runs) == ["fp32", "8bit", "4bit", "fp8", "bf16-sr"]
    arrays = demo_arrays(stdout.getvalue())
    for name, r in result.runs.items():
        assert sorted(n for n, _, _ in r.arrays) == sorted(arrays), name  # the tie counted once
        assert r.state_bytes == sum(adam_state_bytes(a, name) for a in arrays), name
        assert r.parameter_bytes == (2 if name == "bf16-sr" else 4) * sum(arrays), name
        assert np.isfinite(r.train_loss).all() and np.isfinite(r.held_out), name
    assert (tmp_path / f"demo-{backend}-all.png").stat().st_size > 1000


def test_state_bf16_without_ml_dtypes(tmp_path, capsys, monkeypatch):
    """NumPy's bfloat16 comes from ml_dtypes, which the demo's install does not bring: asked for,
    bf16-sr is refused in one line; within `all` it is left out, said so, and the rest runs."""
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as if not installed
    assert main(["demo", "--state", "bf16-sr", "--steps", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install ml_dtypes" in err
    assert main(["demo", "--state", "all", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bf16-sr left out" in out
    header = out.split("\n\n")[1].splitlines()[0]
    assert header.split() == ["fp32", "8bit", "4bit", "fp8"]


def test_unknown_state_from_python(tmp_path):
    with pytest.raises(DemoError, match="unknown --state '16bit'; choose one of: fp32, 8bit"):
        run(Config(steps=2, out=str(tmp_path), state="16bit"), io.StringIO(), io.StringIO())
