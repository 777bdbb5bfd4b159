"""Step time of a Lightning fit with and without GockptCallback, side by side in one run.

    python experiments/bench_lightning_step.py        (EVERY=N: a checkpoint every N steps, 10)

Eight 512x512 Linear layers (25 MB of AdamW state), 60 steps of batch 64 on the CPU, two
rounds alternating; the mean step time from step 10 on, median over rounds, and the ratio.
"""
import os, sys, time, tempfile, statistics, warnings
warnings.filterwarnings("ignore")
import torch, pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gockpt.integrations.lightning import GockptCallback
class M(pl.LightningModule):
    def __init__(s):
        super().__init__(); torch.manual_seed(0)
        s.net = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]); s.t = []
    def training_step(s, b, i):
        s.t.append(time.perf_counter()); return s.net(b[0]).square().mean()
    def configure_optimizers(s): return torch.optim.AdamW(s.parameters(), lr=1e-4)
data = TensorDataset(torch.randn(64 * 8, 512))
res = {}
for rnd in range(2):
    for name in ("none", "gockpt-o"):
        m = M(); d = tempfile.mkdtemp(dir="/dev/shm")
        cbs = [GockptCallback(d, every_n_train_steps=int(os.environ.get("EVERY", 10)), overlap_steps=3)] if name != "none" else []
        t = pl.Trainer(max_steps=60, accelerator="cpu", logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, callbacks=cbs)
        t.fit(m, DataLoader(data, batch_size=64))
        steps = [b - a for a, b in zip(m.t[10:], m.t[11:])]
        res.setdefault(name, []).append(statistics.mean(steps))
base = statistics.median(res["none"])
for k, v in res.items():
    print(f"{k:10s} mean step {statistics.median(v)*1e3:.2f} ms  ({statistics.median(v)/base:.3f}x)")
