"""experiments/gradbias.py: its one-signedness statistic, and a small run through the emulation."""
import torch

from experiments import gradbias


def test_z_separates_noise_from_bias():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 2, 256, 16, generator=g, dtype=torch.float64)
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64) * 1e-3
    rel, z = gradbias.stats(noise, ref)
    assert abs(rel - 1e-3) < 1e-4 and 0.6 < z < 1.0       # E|N(0, 1)| = 0.8
    _, z_biased = gradbias.stats(noise + 2e-4, ref)          # a bias of 0.2 of the noise, over 2048 samples
    assert z_biased > 5


def test_runs_on_cpu(capsys):
    gradbias.main(["--batch", "1", "--heads", "1", "--seq", "64", "--head-dim", "16", "--draws", "1",
                   "--logit-scale", "4"])
    rows = capsys.readouterr().out.strip().splitlines()
    assert len(rows) == 4 and "ours, fix off" in rows[1] and "ours, fix paper" in rows[2] and "ours, fix on" in rows[3]
    rel_rms_o = float(rows[1].split()[4])                     # bf16 O: a relative error of ~1e-3
    assert 1e-4 < rel_rms_o < 1e-2
