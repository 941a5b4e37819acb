"""``fastattn demo`` (fastattn.models.demo.main), shortened to a few steps per task."""

import json

import pytest
import torch

from fastattn.models import demo


pytestmark = pytest.mark.usefixtures("one_thread")


def test_demo_runs_and_learns(tmp_path, capsys):
    threads = torch.get_num_threads()
    rc = demo.main(["--seconds", "120", "--max-steps", "25", "--out", str(tmp_path), "--no-progress",
                    "--sample-chars", "30", "--backend", "naive"])
    assert rc == 0
    assert torch.get_num_threads() == threads  # the demo's thread setting is undone
    out = capsys.readouterr().out
    assert "exact-match accuracy" in out and "greedy continuation (KV cache)" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert set(summary) == {"reverse", "gpt"} == set(losses)
    for task in ("reverse", "gpt"):
        assert summary[task]["steps"] == len(losses[task]) == 25
        assert sum(losses[task][-5:]) / 5 < losses[task][0] - 0.2, task  # it learns
    assert 0.0 <= summary["reverse"]["accuracy"] <= 1.0
    sample = summary["gpt"]["sample"]
    assert sample.startswith("The keeper") and len(sample) == len("The keeper") + 30


def test_reversal_batch():
    src, tgt = demo.reversal_batch(8, torch.Generator().manual_seed(0), min_len=2, max_len=5)
    assert src.shape == (8, 5) and tgt.shape == (8, 7)
    for s, t in zip(src, tgt):
        n = int((s != demo.PAD).sum())
        assert t[0] == demo.BOS and t[n + 1] == demo.EOS
        assert torch.equal(t[1 : n + 1], s[:n].flip(0))
        assert (t[n + 2 :] == demo.PAD).all() and (s[n:] == demo.PAD).all()
